"""The configured speculative method -> its drafter (and what its KV costs per page)."""
from __future__ import annotations

from pathlib import Path

import torch

from omnivox.engine.config import SpeculativeConfig
from omnivox.kv_cache.pool import KVPool
from omnivox.speculative.dflash.config import DFlashConfig, DraftMismatch
from omnivox.speculative.drafter import Drafter
from omnivox.speculative.ngram import NgramDrafter


def draft_folder(spec: SpeculativeConfig) -> Path:
    """The DFlash draft's folder: `spec.model`, or the demo model's draft for "demo"."""
    if spec.model == "demo":
        from omnivox.speculative.dflash.demo import demo_draft_folder
        return demo_draft_folder()
    folder = Path(spec.model).expanduser()
    if not folder.is_dir():
        raise DraftMismatch(f"speculative model {spec.model!r}: no such folder")
    return folder


def draft_page_bytes(spec: SpeculativeConfig | None, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of the draft's KV per page of the Thinker's (its pool shares the Thinker's pages); 0
    for prompt lookup. Reads the draft's config only."""
    if spec is None or spec.method != "dflash":
        return 0
    c = DFlashConfig.load(draft_folder(spec))
    return KVPool.bytes_per_block(c.num_hidden_layers, block_size, c.num_key_value_heads, c.head_dim, dtype)


def make_drafter(spec: SpeculativeConfig | None, model) -> Drafter | None:
    """The drafter of `spec` for a Qwen3-Omni model's Thinker (None: no speculation). Raises
    DraftMismatch (one line) for a DFlash draft that does not fit this Thinker."""
    if spec is None:
        return None
    thinker = model.thinker
    device, dtype = thinker.lm_head.weight.device, thinker.lm_head.weight.dtype
    if spec.method == "ngram":
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max, device)
    from omnivox.speculative.dflash.drafter import DFlashDrafter, load_draft
    if thinker.tp is not None:
        raise DraftMismatch("speculative method 'dflash' with tensor parallelism: not supported yet (the draft reads "
                            "the Thinker's whole LM head on rank 0); use 'ngram' or one rank")
    folder = draft_folder(spec)
    draft = load_draft(folder, model.cfg.thinker.text, dtype, device)
    most = draft.cfg.block_size - 1
    if spec.num_speculative_tokens > most:
        raise DraftMismatch(f"speculative num_speculative_tokens is {spec.num_speculative_tokens} but the draft's "
                            f"block_size {draft.cfg.block_size} proposes at most {most}")
    if spec.model == "demo":
        from omnivox.speculative.dflash.demo import check_demo_draft
        check_demo_draft(folder, model)
    return DFlashDrafter(draft, thinker.model.embed_tokens, thinker.lm_head)
