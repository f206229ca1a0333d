"""`omnivox bench` on Fish S2 (text to speech): N distinct texts of `--prompt-tokens` words, each
request seeded (seed + i) and capped at `--reply-frames` S2 frames (21.5 Hz; `ignore_eos`, so
exactly that many). There is no transformers reference: the baseline is omnivox running the
same requests one at a time. Audio seconds are counted at 44.1 kHz, the rate produced."""
from __future__ import annotations

import random
from typing import Callable

from omnivox.engine.measure import RequestResult, run_requests
from omnivox.serving import SpeechParams

WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars watch quietly above "
         "an old harbour where ships return each evening carrying salt wool letters and stories").split()


def tts_texts(n: int, words: int, seed: int) -> list[str]:
    """n distinct sentences of `words` words (numbered, so no two share a prompt)."""
    rng = random.Random(seed)
    return [f"Sentence {i + 1}: " + " ".join(rng.choice(WORDS) for _ in range(max(1, words))) + "."
            for i in range(n)]


class FishWorkload:
    default_prompt_tokens = 12
    stages = ("slow_ar", "fast_ar", "vocoder")

    def __init__(self, tts, args):
        self.tts, self.args = tts, args
        if args.prompt_tokens is None:
            args.prompt_tokens = self.default_prompt_tokens
        self.texts = tts_texts(args.num_requests, args.prompt_tokens, args.seed)

    def describe(self) -> str:
        return (f"distinct texts of {self.args.prompt_tokens} words, {self.args.reply_frames} S2 frames each; "
                f"audio produced at {self.tts.sample_rate} Hz")

    def submit(self, i: int, playing: bool = True):
        """Request i; `playing`: a listener plays it (the bench measures streams: serving.PLAYING)."""
        a = self.args
        return self.tts.speech(self.texts[i], SpeechParams(seed=a.seed + i, max_frames=a.reply_frames, playing=playing),
                               ignore_eos=True)

    def baselines(self) -> list[tuple[str, Callable[[], tuple[list[RequestResult], float] | None]]]:
        return [("omnivox-seq", lambda: run_requests(self.submit, len(self.texts), 1, None, self.args.seed))]
