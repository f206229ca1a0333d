"""The Triton paged backend against a per-sequence SDPA reference written here: on a GPU, or on CPU
under Triton's interpreter (tests/triton_interpreter.py)."""
import pytest
import torch
import torch.nn.functional as F

from triton_interpreter import DEVICE, here, in_a_fresh_process

from omnivox.attention.metadata import build_metadata  # noqa: E402
from omnivox.attention.triton_paged import (TritonPagedAttention, paged_attention, paged_kv_store,  # noqa: E402
                                            triton_available)

test_in_a_fresh_process = in_a_fresh_process(__file__)


def _setup(past, new, *, heads, kv_heads, head_dim, block_size, dtype, pad_rows=2, seed=0):
    """A NaN-poisoned pool layer whose rows own shuffled pages (page 0, where unused block-table
    entries point, and the spare pages belong to no row), each row's past written, this step's
    q/k/v as views of one fused projection, and the metadata."""
    g = torch.Generator().manual_seed(seed)
    pages_needed = [-(-(p + n) // block_size) for p, n in zip(past, new)]
    num_pages = sum(pages_needed) + 4  # page 0, two spares, the dummy page
    order = (torch.randperm(num_pages - 2, generator=g) + 1).tolist()  # never page 0 or the dummy page
    tables, i = [], 0
    for k in pages_needed:
        tables.append(order[i:i + k])
        i += k
    dummy_slot = (num_pages - 1) * block_size
    meta = build_metadata(tables, past, new, block_size=block_size, dummy_slot=dummy_slot,
                          device=DEVICE, pad_rows=pad_rows)
    shape = (num_pages * block_size, kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for t, p in zip(tables, past):
        s = _slots(t, p, block_size)
        k_cache[s] = torch.randn(p, kv_heads, head_dim, generator=g).to(dtype)
        v_cache[s] = torch.randn(p, kv_heads, head_dim, generator=g).to(dtype)
    qkv = torch.randn(meta.num_tokens, heads + 2 * kv_heads, head_dim, generator=g).to(dtype)
    real = meta.cu_q_host[len(past)]
    qkv[real:] = qkv[real - 1]  # padding tokens alike: which of them lands last in the dummy slot is not fixed
    q, k, v = qkv.to(DEVICE).split([heads, kv_heads, kv_heads], dim=1)  # strided views, as a fused projection gives
    return tables, meta, q, k, v, k_cache.to(DEVICE), v_cache.to(DEVICE)


def _slots(table, length, block_size):
    pos = torch.arange(length)
    return torch.tensor(table, dtype=torch.long)[pos // block_size] * block_size + pos % block_size


def _reference(q, k_cache, v_cache, tables, past, new, meta):
    """Per row: gather its slots, repeat kv heads, causal SDPA in fp64 (query i sits at past + i)."""
    outs = []
    group = q.shape[1] // k_cache.shape[1]
    for b, (t, p, n) in enumerate(zip(tables, past, new)):
        s = _slots(t, p + n, meta.block_size)
        kb = k_cache[s].double().repeat_interleave(group, 1).transpose(0, 1)  # [H, L, D]
        vb = v_cache[s].double().repeat_interleave(group, 1).transpose(0, 1)
        c = meta.cu_q_host[b]
        qb = q[c:c + n].double().transpose(0, 1)  # [H, n, D]
        mask = torch.arange(p + n)[None, :] <= (p + torch.arange(n))[:, None]
        outs.append(F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask).transpose(0, 1))
    return torch.cat(outs)


def _same(a, b):
    """Equal, NaN where the other is NaN."""
    return torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def _check(past, new, *, heads, kv_heads, head_dim, block_size, dtype, atol):
    tables, meta, q, k, v, k_cache, v_cache = _setup(past, new, heads=heads, kv_heads=kv_heads,
                                                     head_dim=head_dim, block_size=block_size, dtype=dtype)
    want_k, want_v = k_cache.cpu().clone(), v_cache.cpu().clone()
    want_k[meta.write_slots.cpu()] = k.cpu()
    want_v[meta.write_slots.cpu()] = v.cpu()

    out = TritonPagedAttention().forward(q, k, v, k_cache, v_cache, meta)

    # the store wrote this step's k/v exactly at write_slots (padding at the dummy slot) and nothing else
    assert _same(k_cache.cpu(), want_k) and _same(v_cache.cpu(), want_v)
    assert out.shape == q.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "a poisoned page, a padding row or an empty softmax leaked NaN"
    real = meta.cu_q_host[len(past)]
    ref = _reference(q.cpu(), want_k, want_v, tables, past, new, meta)
    torch.testing.assert_close(out[:real].cpu().double(), ref, rtol=0, atol=atol)


@here
@pytest.mark.parametrize("heads, kv_heads, head_dim, block_size", [
    (4, 2, 16, 4),  # GQA, pages smaller than a key tile
    (2, 2, 16, 16),  # MHA
    (6, 2, 24, 1),  # a group that does not divide BLOCK_M, head_dim padded to 32, one token a page
])
def test_mixed_batch_fp32(heads, kv_heads, head_dim, block_size):
    # a decode row over more than one key tile, a chunk over a past, a fresh prefill, a short
    # decode row, then two padding rows
    _check([70, 21, 0, 5], [1, 9, 13, 1], heads=heads, kv_heads=kv_heads, head_dim=head_dim,
           block_size=block_size, dtype=torch.float32, atol=1e-5)


@here
def test_mixed_batch_fp16():
    _check([70, 21, 0, 5], [1, 9, 13, 1], heads=4, kv_heads=2, head_dim=16, block_size=4,
           dtype=torch.float16, atol=2e-2)


@pytest.mark.skipif(DEVICE == "cpu", reason="Triton's interpreter multiplies bf16 tl.dot operands as raw uint16; "
                                            "bf16 is checked on a GPU")
@here
def test_mixed_batch_bf16():
    _check([70, 21, 0, 5], [1, 9, 13, 1], heads=4, kv_heads=2, head_dim=16, block_size=4,
           dtype=torch.bfloat16, atol=2e-2)


@here
def test_decode_only_step():
    # the 16-row query block of decode steps; Thinker-shaped group (32 q / 4 kv heads = 8)
    _check([3, 40, 17], [1, 1, 1], heads=16, kv_heads=2, head_dim=16, block_size=8,
           dtype=torch.float32, atol=1e-5)


@here
def test_long_rows_span_query_blocks():
    # 40 new tokens x group 2 = 80 (token, head) rows: two 64-row query blocks per kv head
    _check([50, 0], [40, 33], heads=4, kv_heads=2, head_dim=16, block_size=16,
           dtype=torch.float32, atol=1e-5)


@here
def test_qwen3_thinker_head_shapes():
    # the real head layout: 32 q heads, 4 kv heads, head_dim 128, 16-token pages
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float16
    _check([20, 0], [1, 5], heads=32, kv_heads=4, head_dim=128, block_size=16, dtype=dtype, atol=2e-2)


@pytest.mark.skipif(DEVICE == "cpu", reason="long rows are for a GPU; the interpreter runs one program at a time")
def test_long_context_on_gpu():
    _check([3000, 700, 0, 1], [1, 300, 257, 1], heads=32, kv_heads=4, head_dim=128, block_size=16,
           dtype=torch.bfloat16, atol=2e-2)


@here
def test_custom_ops_pass_opcheck():
    tables, meta, q, k, v, k_cache, v_cache = _setup([6, 0], [1, 5], heads=4, kv_heads=2, head_dim=16,
                                                     block_size=4, dtype=torch.float32, pad_rows=1)
    k_cache, v_cache = k_cache.nan_to_num(0.0), v_cache.nan_to_num(0.0)  # opcheck compares outputs with NaN-unaware checks
    k, v = k.contiguous(), v.contiguous()
    torch.library.opcheck(paged_kv_store, (k, v, k_cache, v_cache, meta.write_slots))
    torch.library.opcheck(paged_attention, (q.contiguous(), k_cache, v_cache, meta.cu_q, meta.seq_lens,
                                            meta.block_table, meta.block_size, meta.max_q))


@here
def test_compiled_step_writes_the_pool_in_place():
    from torch._inductor.utils import run_and_get_code

    tables, meta, q, k, v, k_cache, v_cache = _setup([6, 0], [1, 5], heads=4, kv_heads=2, head_dim=16,
                                                     block_size=4, dtype=torch.float32, pad_rows=1)
    backend = TritonPagedAttention()
    k_eager, v_eager = k_cache.clone(), v_cache.clone()
    want = backend.forward(q, k, v, k_eager, v_eager, meta)
    step = torch.compile(lambda q, k, v, kc, vc: backend.forward(q, k, v, kc, vc, meta), fullgraph=True)
    out, (code,) = run_and_get_code(step, q, k, v, k_cache, v_cache)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert _same(k_cache.cpu(), k_eager.cpu()) and _same(v_cache.cpu(), v_eager.cpu())
    call = code[code.index("def call("):code.index("return (")]
    assert "paged_kv_store.default(" in call and "copy_" not in call and "clone" not in call, call


@here
def test_schema_declares_the_caches_mutated():
    store = torch.ops.omnivox.paged_kv_store.default._schema
    mutated = [a.name for a in store.arguments if a.alias_info is not None and a.alias_info.is_write]
    assert mutated == ["k_cache", "v_cache"]
    attn = torch.ops.omnivox.paged_attention.default._schema
    assert not any(a.alias_info is not None and a.alias_info.is_write for a in attn.arguments)


@here
def test_triton_available(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert triton_available()
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert triton_available() == torch.cuda.is_available()
