"""The EAGLE-3 head loaded from either layout (SGLang's `LlamaForCausalLMEagle3`, vLLM
`speculators`' `Eagle3Speculator`) drafts exactly what its weights say (fp32, 1e-5): a k-step
chain's draft logits, for rows of different lengths in one batched call, with target features
arriving in chunks, the head's entries made as rows grow and remade after preemption, equal a dense reference written
from the SGLang / speculators description (`eagle3_reference.py`); proposals are the Thinker's
ids (through d2t). Heads that do not fit are refused in one line naming the field and values."""
import json
from types import SimpleNamespace

import pytest
import torch

from eagle3_reference import H, VOCAB, reference_chain, write_head
from omnivox.speculative.drafter import DraftRow
from omnivox.speculative.eagle3.config import Eagle3Config
from omnivox.speculative.eagle3.drafter import Eagle3Drafter, load_head
from omnivox.speculative.fit import DraftMismatch

THINKER = SimpleNamespace(hidden_size=H, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                          num_hidden_layers=3)
BS, K = 4, 3


@torch.no_grad()
@pytest.mark.parametrize("layout", ["sglang", "speculators"])
def test_chain_logits_equal_the_reference_batched_chunked_and_growing(tmp_path, layout):
    w = write_head(tmp_path, layout)
    head, own = load_head(tmp_path, THINKER, torch.float32, "cpu")
    assert not own and head.cfg.taps(3) == (0, 1)
    g = torch.Generator().manual_seed(1)
    embed = torch.nn.Embedding(VOCAB, H)
    torch.nn.init.normal_(embed.weight, generator=g)
    drafter = Eagle3Drafter(head, embed, head.cfg.taps(3))
    drafter.bind_pages(16, BS)
    seen = []
    inner = head.logits
    head.logits = lambda a: seen.append(inner(a)) or seen[-1]
    tables = ([3, 0, 11], [5, 9, 2, 8], [7, 1])
    lengths = [7, 12, 2]
    tokens = [torch.randint(VOCAB, (16,), generator=g).tolist() for _ in lengths]
    feats = [torch.randn(16, 2 * H, generator=g) for _ in lengths]
    done = [0, 0, 0]
    for grow in (0, 3):  # then each row computes 3 more positions (as after accepted drafts)
        n_now = [n + grow for n in lengths]
        for r, (table, n) in enumerate(zip(tables, n_now)):
            pos = torch.arange(done[r], n)
            slots = torch.tensor([table[p // BS] * BS + p % BS for p in pos.tolist()])
            cut = len(pos) // 2  # the features arrive in two steps (chunked prefill, then decode)
            drafter.absorb(feats[r][pos[:cut]], pos[:cut], slots[:cut])
            drafter.absorb(feats[r][pos[cut:]], pos[cut:], slots[cut:])
            done[r] = n
        rows = [DraftRow(f"r{r}", tokens[r][:n + 1], n, tables[r], K) for r, n in enumerate(n_now)]
        seen.clear()
        got = drafter.propose(rows, None)
        drafter.settle({row.rid: row.computed for row in rows})
        for r, n in enumerate(n_now):
            want = reference_chain(w, feats[r][:n], tokens[r][:n + 1], K, embed.weight, layout)
            for j in range(K):
                torch.testing.assert_close(seen[j][r], want[j], rtol=0, atol=1e-5)
            best = [int(x.argmax()) for x in want]
            assert got.host()[r] == [b + int(w["d2t"][b]) for b in best]
        assert (seen[0][0] - seen[0][1]).abs().max() > 0.1  # the rows' contexts matter
    # preempted (settled to 0), then recomputed on other pages: its entries are made anew there
    drafter.settle({"r0": 0})
    n, table = lengths[0] + 3, [12, 13, 14]
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
    drafter.absorb(feats[0][:n], torch.arange(n), slots)
    seen.clear()
    drafter.propose([DraftRow("r0", tokens[0][:n + 1], n, table, K)], None)
    for j, want in enumerate(reference_chain(w, feats[0][:n], tokens[0][:n + 1], K, embed.weight, layout)):
        torch.testing.assert_close(seen[j][0], want, rtol=0, atol=1e-5)


def _config(folder, **over):
    d = json.loads((folder / "config.json").read_text())
    for key, v in over.items():
        if key.startswith("eagle_config."):
            d["eagle_config"][key.split(".", 1)[1]] = v
        else:
            d[key] = v
    return Eagle3Config.from_hf(d)


@pytest.mark.parametrize("layout, over, message", [
    ("sglang", dict(hidden_size=48), "draft hidden_size is 48 but the Thinker's is 32"),
    ("sglang", dict(vocab_size=65), "draft vocab_size is 65 but the Thinker's is 64"),
    ("sglang", dict(draft_vocab_size=80), "draft draft_vocab_size is 80, not within 1..vocab_size 64"),
    ("sglang", {"eagle_config.eagle_aux_hidden_state_layer_ids": [0, 3]},
     "eagle_aux_hidden_state_layer_ids (layer outputs) is [0, 3] but the Thinker's layers are 0..2"),
    ("sglang", {"eagle_config.eagle_aux_hidden_state_layer_ids": [1, 0]}, "is [1, 0], not increasing"),
    ("sglang", {"eagle_config": {}}, "default layer ids [1, N // 2 - 1, N - 4] is [1, 0, -1]"),
    ("speculators", dict(eagle_aux_hidden_state_layer_ids=[0, 2]),
     "eagle_aux_hidden_state_layer_ids - 1 (speculators' ids index hidden_states) is [-1, 1] but the Thinker's"),
    ("sglang", dict(num_hidden_layers=2), "omnivox runs one-layer EAGLE-3 heads, the draft has 2"),
    ("sglang", dict(architectures=["MedusaModel"]), "the draft has ['MedusaModel']"),
    ("sglang", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "draft rope_type: omnivox runs 'default'"),
    ("speculators", dict(fc_norm=True), "draft fc_norm: omnivox runs heads without it"),
])
def test_a_head_that_does_not_fit_is_refused_naming_both_values(tmp_path, layout, over, message):
    write_head(tmp_path, layout)
    with pytest.raises(DraftMismatch) as e:
        _config(tmp_path, **over).check(THINKER)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_head_with_three_features_needs_three_layers_and_the_fc_to_match(tmp_path):
    write_head(tmp_path, "sglang", taps=3, **{"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1]}})
    with pytest.raises(DraftMismatch, match=r"draft fc.weight is \[32, 96\] but 2 target layers of hidden size 32 "
                                            r"need \[32, 64\]"):
        load_head(tmp_path, THINKER, torch.float32, "cpu")
