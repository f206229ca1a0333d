"""The configured speculative method -> its drafter (and what its KV costs per page)."""
from __future__ import annotations

from pathlib import Path

import torch

from omnivox.engine.config import SpeculativeConfig
from omnivox.kv_cache.pool import KVPool
from omnivox.speculative.dflash.config import DFlashConfig
from omnivox.speculative.drafter import Drafter
from omnivox.speculative.eagle3.config import Eagle3Config
from omnivox.speculative.fit import DraftMismatch
from omnivox.speculative.ngram import NgramDrafter

NAMES = {"dflash": "DFlash", "eagle3": "EAGLE-3"}


def draft_folder(spec: SpeculativeConfig) -> Path:
    """A learned draft's folder: `spec.model`, or the demo model's draft of that method for "demo"."""
    if spec.model == "demo":
        from omnivox.speculative.demo import demo_draft_folder
        return demo_draft_folder(spec.method)
    folder = Path(spec.model).expanduser()
    if not folder.is_dir():
        raise DraftMismatch(f"speculative model {spec.model!r}: no such folder")
    return folder


def draft_page_bytes(spec: SpeculativeConfig | None, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of the draft's state per page of the Thinker's (it shares the Thinker's pages); 0
    for prompt lookup. Reads the draft's config only."""
    if spec is None or spec.method == "ngram":
        return 0
    if spec.method == "eagle3":
        return Eagle3Config.load(draft_folder(spec)).page_bytes(block_size, dtype)
    c = DFlashConfig.load(draft_folder(spec))
    return KVPool.bytes_per_block(c.num_hidden_layers, block_size, c.num_key_value_heads, c.head_dim, dtype)


def make_drafter(spec: SpeculativeConfig | None, model, demo_version: int) -> Drafter | None:
    """The drafter of `spec` for a Qwen3-Omni model's Thinker (None: no speculation); `demo_version`:
    the built-in demo model's, which "model": "demo" drafts are checked against. Raises
    DraftMismatch (one line) for a learned draft that does not fit this Thinker."""
    if spec is None:
        return None
    thinker = model.thinker
    device, dtype = thinker.lm_head.weight.device, thinker.lm_head.weight.dtype
    if spec.method == "ngram":
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max, device)
    if thinker.tp is not None:
        raise DraftMismatch(f"speculative method {spec.method!r} with tensor parallelism: not supported yet (the draft "
                            "reads the Thinker's embedding and features on rank 0); use 'ngram' or one rank")
    folder = draft_folder(spec)
    drafter = (_eagle3 if spec.method == "eagle3" else _dflash)(spec, folder, model, dtype, device)
    if spec.model == "demo":
        from omnivox.speculative.demo import check_demo_draft
        check_demo_draft(folder, model, spec.method, demo_version)
    return drafter


def _dflash(spec: SpeculativeConfig, folder: Path, model, dtype, device) -> Drafter:
    from omnivox.speculative.dflash.drafter import DFlashDrafter, load_draft
    draft = load_draft(folder, model.cfg.thinker.text, dtype, device)
    most = draft.cfg.block_size - 1
    if spec.num_speculative_tokens > most:
        raise DraftMismatch(f"speculative num_speculative_tokens is {spec.num_speculative_tokens} but the draft's "
                            f"block_size {draft.cfg.block_size} proposes at most {most}")
    return DFlashDrafter(draft, model.thinker.model.embed_tokens, model.thinker.lm_head)


def _eagle3(spec: SpeculativeConfig, folder: Path, model, dtype, device) -> Drafter:
    from omnivox.speculative.eagle3.drafter import Eagle3Drafter, load_head
    th = model.cfg.thinker.text
    head, own_embed = load_head(folder, th, dtype, device)
    embed = model.thinker.model.embed_tokens
    if own_embed:
        embed = torch.nn.Embedding(th.vocab_size, th.hidden_size, device=device, dtype=dtype)
        embed.load_state_dict({"weight": own_embed["embed_tokens.weight"]})
    return Eagle3Drafter(head, embed, head.cfg.taps(th.num_hidden_layers))
