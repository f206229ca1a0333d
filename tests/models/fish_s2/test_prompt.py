"""Invariant 2.2.6: exact prompt segments and ids."""
import torch

from omnivox.models.fish_s2.prompt import Reference, TextTokenizer, Turn, build_prompt, prompt_segments
from omnivox.models.fish_s2.tiny import TINY_CONFIG as CFG

N = CFG.num_codebooks


class FakeTokenizer:
    """Records each segment; ids = 1000 + running index of the segment, one id per character."""

    def __init__(self):
        self.segments: list[str] = []

    def encode(self, text: str) -> list[int]:
        self.segments.append(text)
        return [len(self.segments)] * len(text)


def codes(frames: int, seed: int) -> torch.Tensor:
    return torch.randint(1, CFG.codebook_size, (N, frames), generator=torch.Generator().manual_seed(seed))


def texts(segs):
    return [s for s in segs if isinstance(s, str)]


def test_no_reference_fish_and_sglang():
    tok = FakeTokenizer()
    m = build_prompt(tok, CFG, "Hi.", mode="fish")
    assert tok.segments == ["<|im_start|>system\n", "convert the provided text to speech", "<|im_end|>\n",
                            "<|im_start|>user\n", "Hi.", "<|im_end|>\n", "<|im_start|>assistant\n<|voice|>"]
    expect = sum(([i + 1] * len(s) for i, s in enumerate(tok.segments)), [])
    assert m[0].tolist() == expect and not m[1:].any()
    tok = FakeTokenizer()
    build_prompt(tok, CFG, "Hi.", mode="sglang")
    assert tok.segments == ["<|im_start|>user\n", "<|speaker:0|>Hi.", "<|im_end|>\n", "<|im_start|>assistant\n<|voice|>"]


def test_one_and_two_references():
    a, b = codes(3, 0), codes(2, 1)
    tok = FakeTokenizer()
    m = build_prompt(tok, CFG, "Target.", [Reference("first", a)])
    assert tok.segments == ["<|im_start|>system\n",
                            "convert the provided text to speech reference to the following:\n\nText:\n",
                            "<|speaker:0|>first", "\n\nSpeech:\n", "<|im_end|>\n", "<|im_start|>user\n", "Target.",
                            "<|im_end|>\n", "<|im_start|>assistant\n<|voice|>"]
    vq = (m[1:] != 0).any(0)
    start = sum(len(s) for s in tok.segments[:4])
    assert vq.nonzero().flatten().tolist() == list(range(start, start + 3))
    assert torch.equal(m[0, start:start + 3], CFG.semantic_begin + a[0])
    assert torch.equal(m[1:, start:start + 3], a)
    tok = FakeTokenizer()
    m = build_prompt(tok, CFG, "T", [Reference("one", a), Reference("<|speaker:5|>two", b)])
    assert tok.segments[2] == "<|speaker:0|>one\n<|speaker:5|>two"
    sem = (m[0] >= CFG.semantic_begin) & (m[0] <= CFG.semantic_end)
    assert torch.equal(m[1:, sem], torch.cat([a, b], 1))  # concatenated in time
    assert not m[1:, ~sem].any()
    tok = FakeTokenizer()
    build_prompt(tok, CFG, "T", [Reference("one", a), Reference("two", b)], mode="sglang")
    assert tok.segments[2:4] == ["<|speaker:0|>one", "<|speaker:0|>two"]


def test_multi_turn_history():
    a, g = codes(2, 2), codes(4, 3)
    segs = prompt_segments("next", [Reference("r", a)], [Turn("user", "earlier"), Turn("assistant", codes=g)])
    assert texts(segs) == ["<|im_start|>system\n",
                           "convert the provided text to speech reference to the following:\n\nText:\n",
                           "<|speaker:0|>r", "\n\nSpeech:\n", "<|im_end|>\n", "<|im_start|>user\n", "earlier",
                           "<|im_end|>\n", "<|im_start|>assistant\n<|voice|>", "<|im_end|>\n",
                           "<|im_start|>user\n", "next", "<|im_end|>\n", "<|im_start|>assistant\n<|voice|>"]
    assert torch.equal(segs[4], a) and torch.equal(segs[10], g)


def test_real_tokenizer_ids(tiny_folder):
    tok = TextTokenizer(tiny_folder)
    m = build_prompt(tok, CFG, "Hi", [Reference("r", codes(2, 4))])
    ids = m[0].tolist()
    assert ids[0] == 1 and ids[-1] == 3  # <|im_start|> ... <|voice|>
    assert ids.count(2) == 2 and ids.count(1) == 3  # system + user <|im_end|>; three <|im_start|>
    assert tok.encode("<|semantic:5|>") == [CFG.semantic_begin + 5]
