"""CUDA checks of the batched samplers (skipped without a GPU): the noise is the CPU's, greedy
rows match, and a captured CUDA graph replays what eager computes."""
import pytest
import torch

from omnivox.models.fish_s2.sampler import FishSamplingParams
from omnivox.models.fish_s2.tiny import TINY_CONFIG as CFG
from omnivox.sampling import noise
from omnivox.sampling.batched import SamplingTensors, sample
from omnivox.sampling.fish_rules import FishState, FishTensors, sample_semantic
from omnivox.sampling.params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PARAMS = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.1), SamplingParams(greedy=True),
          SamplingParams(temperature=1.2), SamplingParams(temperature=0.0, repetition_penalty=1.3)] * 4


def test_noise_is_the_same_on_cuda():
    seed = torch.tensor([0, -1, 2**62 + 7, 12345])
    step = torch.tensor([0, 5, 2**40, 77])
    for stream in (noise.THINKER, noise.code_predictor(3), noise.fish_residual(9)):
        cpu = noise.uniform(seed, stream, step, 4096)
        assert torch.equal(noise.uniform(seed.cuda(), stream, step.cuda(), 4096).cpu(), cpu)
        g = noise.gumbel(seed.cuda(), stream, step.cuda(), 4096).cpu()
        assert float((g != noise.gumbel(seed, stream, step, 4096)).double().mean()) < 1e-4  # libm's last bit


def test_greedy_rows_match_the_cpu():
    logits = torch.randn(16, 3072, generator=torch.Generator().manual_seed(0)) * 3
    seen = torch.rand(16, 3072, generator=torch.Generator().manual_seed(1)) > 0.99
    cpu = sample(logits, SamplingTensors.build(PARAMS, range(16), [3] * 16, "cpu"), noise.TALKER, seen=seen)
    gpu = sample(logits.cuda(), SamplingTensors.build(PARAMS, range(16), [3] * 16, "cuda"), noise.TALKER,
                 seen=seen.cuda()).cpu()
    greedy = torch.tensor([p.is_greedy for p in PARAMS])
    assert torch.equal(gpu[greedy], cpu[greedy])
    assert float((gpu == cpu).double().mean()) > 0.9  # sampled rows: equal unless a sum order flips a cut


def test_rows_draw_the_same_alone_or_batched_on_cuda():
    """softmax / cumsum / sort kernels must not change a row's numbers with the batch size."""
    logits = torch.randn(16, 151_936, device="cuda") * 3
    t = SamplingTensors.build(PARAMS, range(16), [9] * 16, "cuda")
    batched = sample(logits, t, noise.THINKER)
    for b in range(16):
        alone = sample(logits[b:b + 1], SamplingTensors.build(PARAMS[b:b + 1], [b], [9], "cuda"), noise.THINKER)
        assert int(alone[0]) == int(batched[b])


def _capture(fn):
    """Warm up on a side stream, capture fn() once, return (graph, static output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_qwen_sample_replays_in_a_cuda_graph():
    t = SamplingTensors.build(PARAMS, range(16), [0] * 16, "cuda")
    logits = torch.zeros(16, 3072, device="cuda")
    seen = torch.zeros(16, 3072, dtype=torch.bool, device="cuda")
    graph, out = _capture(lambda: sample(logits, t, noise.TALKER, seen=seen))
    for step in range(5):
        new = SamplingTensors.build(PARAMS, range(16), [step] * 16, "cuda")
        t.step.copy_(new.step)
        logits.copy_(torch.randn(16, 3072, device="cuda"))
        seen.copy_(torch.rand(16, 3072, device="cuda") > 0.99)
        graph.replay()
        assert torch.equal(out, sample(logits, new, noise.TALKER, seen=seen))


def test_fish_semantic_replays_in_a_cuda_graph():
    params = [FishSamplingParams(mode="sglang" if i % 2 else "fish") for i in range(8)]
    t = FishTensors.build(params, range(8), "cuda")
    vocab = CFG.text.vocab_size
    logits = torch.zeros(8, vocab, device="cuda")
    state, eager_state = FishState.fresh(8, "cuda"), FishState.fresh(8, "cuda")
    graph, out = _capture(lambda: sample_semantic(logits, t, state, CFG))
    state.window.zero_(); state.history.fill_(-1); state.steps.zero_()  # undo warm-up and capture
    for _ in range(6):
        logits.copy_(torch.randn(8, vocab, device="cuda") * 3)
        graph.replay()
        assert torch.equal(out, sample_semantic(logits, t, eager_state, CFG))
        assert torch.equal(state.history, eager_state.history) and torch.equal(state.steps, eager_state.steps)
