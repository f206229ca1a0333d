"""The DFlash draft network equals the reference's (`dflash.model.DFlashDraftModel`, fp32, 1e-5):
block logits for the same target features, in one batched call over rows with different contexts,
with the context written in chunks; and drafts that do not fit the Thinker are refused in one line
naming the field and both values."""
import json
from types import SimpleNamespace

import pytest
import torch

from omnivox.kv_cache.pool import KVPool
from omnivox.speculative.dflash.config import DFlashConfig
from omnivox.speculative.fit import DraftMismatch
from omnivox.speculative.dflash.drafter import load_draft
from omnivox.speculative.dflash.model import BlockLayout
from dflash_reference import build_reference_draft

THINKER = SimpleNamespace(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=64,
                          num_hidden_layers=2)
BLOCK, BS = 4, 4


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dflash")
    ref = build_reference_draft(folder, block=BLOCK)
    return ref, load_draft(folder, THINKER, torch.float32, "cpu"), folder


def _reference_logits(ref, feats, block_ids, embed, head):
    ctx = feats.shape[0]
    h = ref(target_hidden=feats[None], noise_embedding=embed(block_ids)[None],
            position_ids=torch.arange(ctx + BLOCK)[None], past_key_values=None, use_cache=False)
    return ref.compute_logits(h, head)[0, 1:]


@torch.no_grad()
def test_block_logits_equal_the_reference_batched_and_chunked(drafts):
    ref, ours, _ = drafts
    g = torch.Generator().manual_seed(1)
    embed, head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64, bias=False)
    torch.nn.init.normal_(embed.weight, generator=g)
    torch.nn.init.normal_(head.weight, std=0.3, generator=g)
    pool = KVPool(2, 16, BS, 2, 16, torch.float32, "cpu")
    lengths, tables, want, blocks = (7, 12, 1), ([3, 0], [5, 9, 2], [7]), [], []
    for n, table in zip(lengths, tables):
        feats = torch.randn(n, 64, generator=g)
        pos = torch.arange(n)
        slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
        cut = n // 2  # the context arrives in two steps (chunked prefill, then decode)
        ours.write_context(feats[:cut], pos[:cut], slots[:cut], pool)
        ours.write_context(feats[cut:], pos[cut:], slots[cut:], pool)
        ids = torch.tensor([int(torch.randint(64, (1,), generator=g))] + [5] * (BLOCK - 1))
        blocks.append(ids)
        want.append(_reference_logits(ref, feats, ids, embed, head))
    lay = BlockLayout.build([list(t) for t in tables], list(lengths), BLOCK, BS, pool.dummy_slot, torch.float32, "cpu")
    got = ours.logits(ours.block(embed(torch.stack(blocks)), pool, lay)[:, 1:], head)
    for r in range(3):
        torch.testing.assert_close(got[r], want[r], rtol=0, atol=1e-5)
    assert (want[0] - want[1]).abs().max() > 0.1  # the rows' contexts matter


def _config(folder, **over):
    d = json.loads((folder / "config.json").read_text())
    for k, v in over.items():
        if k.startswith("dflash_config."):
            d["dflash_config"][k.split(".", 1)[1]] = v
        else:
            d[k] = v
    return DFlashConfig.from_hf(d)


@pytest.mark.parametrize("over, message", [
    (dict(hidden_size=48), "draft hidden_size is 48 but the Thinker's is 32"),
    (dict(num_attention_heads=8), "draft num_attention_heads is 8 but the Thinker's is 4"),
    (dict(vocab_size=65), "draft vocab_size is 65 but the Thinker's is 64"),
    (dict(num_target_layers=48), "draft num_target_layers is 48 but the Thinker has 2 layers"),
    ({"dflash_config.target_layer_ids": [-1, 1]}, "target_layer_ids is [-1, 1] but the Thinker's layers are 0..1"),
    ({"dflash_config.target_layer_ids": [0, 2]}, "target_layer_ids is [0, 2] but the Thinker's layers are 0..1"),
    ({"dflash_config.target_layer_ids": [1, 0]}, "target_layer_ids is [1, 0], not increasing"),
    ({"dflash_config.target_layer_ids": [1, 1]}, "target_layer_ids is [1, 1], not increasing"),
    ({"dflash_config.mask_token_id": 64}, "mask_token_id is 64 but the Thinker's vocab_size is 64"),
])
def test_a_draft_that_does_not_fit_is_refused_naming_both_values(drafts, over, message):
    with pytest.raises(DraftMismatch) as e:
        _config(drafts[2], **over).check(THINKER)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_layer_ids_must_be_explicit_and_unsupported_layouts_are_named(drafts):
    d = json.loads((drafts[2] / "config.json").read_text())
    del d["dflash_config"]["target_layer_ids"]
    with pytest.raises(DraftMismatch, match="target_layer_ids: omnivox needs them explicit"):
        DFlashConfig.from_hf(d)
    with pytest.raises(DraftMismatch, match="layer_types"):
        _config(drafts[2], layer_types=["sliding_attention", "full_attention"])
    with pytest.raises(DraftMismatch, match="DFlash2DraftModel"):
        _config(drafts[2], architectures=["DFlash2DraftModel"])
