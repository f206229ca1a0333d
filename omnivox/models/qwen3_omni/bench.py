"""`omnivox bench` on Qwen3-Omni: distinct text prompts of a fixed length, each generating
exactly `--reply-tokens` Thinker tokens and `--reply-frames` speech frames (end tokens
ignored); baseline: transformers' `generate`, one by one and batched, in the same process."""
from __future__ import annotations

import random
import time
import warnings
from contextlib import contextmanager
from typing import Callable

from omnivox.engine.measure import RequestResult
from omnivox.models.qwen3_omni.code2wav import SAMPLE_RATE
from omnivox.serving import ChatParams


def special_ids(cfg, tokenizer=None) -> set[int]:
    """Every control id the config names (and the tokenizer's special tokens): never random text."""
    th = cfg.thinker
    ids = {cfg.im_start_token_id, cfg.im_end_token_id, cfg.system_token_id, cfg.user_token_id,
           cfg.assistant_token_id, cfg.tts_pad_token_id, cfg.tts_bos_token_id, cfg.tts_eos_token_id,
           th.audio_token_id, th.image_token_id, th.video_token_id, th.audio_start_token_id,
           th.audio_end_token_id, th.vision_start_token_id, th.vision_end_token_id}
    if tokenizer is not None:
        ids |= set(tokenizer.special_ids)
    return {i for i in ids if i is not None}


def prompts(cfg, n: int, length: int, seed: int, tokenizer=None) -> list[list[int]]:
    """Distinct chat prompts of exactly `length` ids (random user tokens; no repeats to inflate caches)."""
    rng = random.Random(seed)
    head = [cfg.im_start_token_id, cfg.user_token_id]
    tail = [cfg.im_end_token_id, cfg.im_start_token_id, cfg.assistant_token_id]
    specials = special_ids(cfg, tokenizer)
    body = max(1, length - len(head) - len(tail) - 2)
    out = []
    for _ in range(n):
        ids = []
        while len(ids) < body:
            t = rng.randrange(min(cfg.thinker.text.vocab_size, 150000))
            if t not in specials:
                ids.append(t)
        nl = ids[-1]  # any ordinary token stands for the newline in the layout
        out.append(head + [nl] + ids + tail + [nl])
    return out


class QwenWorkload:
    default_prompt_tokens = 32
    stages = ("thinker", "talker", "vocoder")

    def __init__(self, omni, args):
        self.omni, self.args = omni, args
        if args.prompt_tokens is None:
            args.prompt_tokens = self.default_prompt_tokens
        self.prompts = prompts(omni.cfg, args.num_requests, args.prompt_tokens, args.seed, omni.tokenizer)

    def describe(self) -> str:
        a = self.args
        return (f"prompt {a.prompt_tokens} tokens, reply {a.reply_tokens} tokens + {a.reply_frames} frames "
                f"({a.reply_frames * 0.08:.2f} s of 24 kHz audio each)")

    def submit(self, i: int, playing: bool = True):
        """Request i; `playing`: a listener plays it (the bench measures streams: serving.PLAYING)."""
        a = self.args
        params = ChatParams(greedy=True, ignore_eos=True, max_tokens=a.reply_tokens, max_frames=a.reply_frames,
                            playing=playing)
        return self.omni.submit_chat(self.omni.prepare_chat(None, params, prompt_ids=self.prompts[i]))

    def baselines(self) -> list[tuple[str, Callable[[], tuple[list[RequestResult], float] | None]]]:
        c = self.args.concurrency
        batched = [(f"hf batch={c}", lambda: self.run_transformers(batch=c))]
        return batched if getattr(self.args, "hf_batched_only", False) else [
            ("hf batch=1", lambda: self.run_transformers(batch=1)), *batched]

    def run_transformers(self, batch: int) -> tuple[list[RequestResult], float] | None:
        """transformers' generate on the same prompts, in batches of `batch` (left-padded)."""
        try:
            from transformers import Qwen3OmniMoeForConditionalGeneration
        except ImportError:
            return None
        with quiet_transformers():
            return self._run_transformers(Qwen3OmniMoeForConditionalGeneration, batch)

    def _run_transformers(self, model_class, batch: int) -> tuple[list[RequestResult], float]:
        import torch

        a = self.args
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[a.dtype]
        model = model_class.from_pretrained(self.omni.folder, dtype=dtype).to(a.device).eval()
        if a.device == "cpu":
            model.set_experts_implementation(a.hf_experts)
        results: list[RequestResult] = []
        start = time.monotonic()
        for b in range(0, len(self.prompts), batch):
            group = self.prompts[b:b + batch]
            width = max(len(p) for p in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device=a.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=a.device)
            t0 = time.monotonic()
            with torch.no_grad():
                _, wav = model.generate(input_ids=ids, attention_mask=mask, thinker_max_new_tokens=a.reply_tokens,
                                        thinker_do_sample=False, talker_do_sample=False,
                                        talker_max_new_tokens=a.reply_frames + 1)
            t1 = time.monotonic()
            wavs = wav if isinstance(wav, list) else [wav.reshape(-1)] * len(group)
            for w in wavs[:len(group)]:
                secs = w.numel() / SAMPLE_RATE
                results.append(RequestResult(t0, [(t1, secs)], t1, secs))
        return results, time.monotonic() - start


@contextmanager
def quiet_transformers():
    """transformers' log lines, warnings and progress bars off while the baseline runs (they are about
    its own generate and would land among the benchmark's lines); its settings restored after."""
    from transformers.utils import logging as hf_logging

    level, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
