"""`omnivox bench`: in-process streaming-speech benchmark of either family.

Qwen3-Omni: N requests with distinct text prompts of a fixed length, each generating exactly
`--reply-tokens` Thinker tokens and `--reply-frames` speech frames (end tokens ignored);
baseline: transformers, one by one and batched.
Fish S2 (text to speech): N distinct texts of `--prompt-tokens` words, each request seeded
(seed + i) and capped at `--reply-frames` S2 frames (21.5 Hz; a request may stop earlier at
<|im_end|>, identically in both runs since seeded requests are batch-invariant); there is no
transformers reference, so the baseline is omnivox running the same requests one at a time.
Both run closed-loop at concurrency C or open-loop with Poisson arrivals at rate R. Definitions
as in ANCHORS.md: TTFA = arrival -> first playable audio; RTF = wall time / audio seconds; a
chunk is on time if the audio received before it lasts longer than the time since the first
chunk. Audio seconds are counted at the sample rate actually produced (S2: 44.1 kHz).
"""
from __future__ import annotations

import argparse
import random
import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np


@dataclass
class RequestResult:
    arrival: float
    chunks: list[tuple[float, float]]  # (time, seconds of audio)
    finish: float
    audio_seconds: float

    @property
    def ttfa(self) -> float:
        return (self.chunks[0][0] if self.chunks else self.finish) - self.arrival

    @property
    def rtf(self) -> float:
        return (self.finish - self.arrival) / self.audio_seconds if self.audio_seconds else float("inf")

    def on_time(self) -> list[bool]:
        """Per chunk after the first: did it arrive before the audio already received ran out?"""
        if not self.chunks:
            return []
        t0, received, flags = self.chunks[0][0], self.chunks[0][1], []
        for t, secs in self.chunks[1:]:
            flags.append(received > t - t0)
            received += secs
        return flags


def summarize(name: str, results: list[RequestResult], wall: float) -> dict:
    ttfa = sorted(r.ttfa for r in results)
    flags = [f for r in results for f in r.on_time()]
    return {
        "system": name,
        "ttfa_p50": float(np.percentile(ttfa, 50)), "ttfa_p90": float(np.percentile(ttfa, 90)),
        "rtf": statistics.mean([r.rtf for r in results if r.audio_seconds] or [float("nan")]),
        "on_time": (sum(flags) / len(flags)) if flags else float("nan"),
        "no_stall": sum(all(r.on_time()) for r in results) / len(results),
        "audio_s_per_s": sum(r.audio_seconds for r in results) / wall,
        "wall": wall,
    }


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


def run_omnivox(omni, plist, args) -> tuple[list[RequestResult], float]:
    """Qwen3-Omni: the prompts through the engine (fixed reply length, end tokens ignored)."""
    return run_requests(lambda i: omni.submit(prompt_ids=plist[i], greedy=True, ignore_eos=True,
                                              max_tokens=args.reply_tokens, max_frames=args.reply_frames),
                        len(plist), args.concurrency, args.rate, args.seed)


def run_requests(submit, n: int, concurrency: int, rate: float | None, seed: int) -> tuple[list[RequestResult], float]:
    """Run `submit(i)` for i < n, closed-loop (at most `concurrency` in flight) or open-loop
    (Poisson arrivals at `rate`), recording each request's audio chunk times."""
    from omnivox.engine.events import AudioChunk, Failed, Finished

    results: list[RequestResult | None] = [None] * n
    sem = threading.Semaphore(concurrency if rate is None else n)

    def one(i: int) -> None:
        try:
            arrival = time.monotonic()
            h = submit(i)
            chunks, fin = [], None
            for ev in h:
                if isinstance(ev, AudioChunk):
                    chunks.append((ev.time, ev.samples.shape[0] / ev.sample_rate))
                elif isinstance(ev, Finished):
                    fin = ev
                elif isinstance(ev, Failed):
                    print(f"request {i} failed: {ev.message}")
            results[i] = RequestResult(fin.arrival if fin else arrival, chunks, fin.time if fin else time.monotonic(),
                                       sum(c[1] for c in chunks))
        finally:
            sem.release()

    rng = random.Random(seed)
    threads = []
    start = time.monotonic()
    for i in range(n):
        if rate is not None:
            time.sleep(rng.expovariate(rate))
        sem.acquire()
        t = threading.Thread(target=one, args=(i,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    return [r for r in results if r is not None], time.monotonic() - start


WORDS = ("the quick brown fox jumps over a lazy dog while seven bright stars watch quietly above "
         "an old harbour where ships return each evening carrying salt wool letters and stories").split()


def tts_texts(n: int, words: int, seed: int) -> list[str]:
    """n distinct sentences of `words` words (numbered, so no two share a prompt)."""
    rng = random.Random(seed)
    return [f"Sentence {i + 1}: " + " ".join(rng.choice(WORDS) for _ in range(max(1, words))) + "."
            for i in range(n)]


def run_transformers(folder, plist, args, batched: bool) -> tuple[list[RequestResult], float] | None:
    """transformers' generate on the same prompts: one by one, or in batches of C (left-padded)."""
    try:
        import torch
        from transformers import Qwen3OmniMoeForConditionalGeneration
    except ImportError:
        return None
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    model = Qwen3OmniMoeForConditionalGeneration.from_pretrained(folder, dtype=dtype).to(args.device).eval()
    model.set_experts_implementation("eager") if args.device == "cpu" else None
    results: list[RequestResult] = []
    size = args.concurrency if batched else 1
    start = time.monotonic()
    for b in range(0, len(plist), size):
        group = plist[b:b + size]
        width = max(len(p) for p in group)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in group], device=args.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group], device=args.device)
        t0 = time.monotonic()
        with torch.no_grad():
            _, wav = model.generate(input_ids=ids, attention_mask=mask, thinker_max_new_tokens=args.reply_tokens,
                                    thinker_do_sample=False, talker_do_sample=False,
                                    talker_max_new_tokens=args.reply_frames + 1)
        t1 = time.monotonic()
        wavs = wav if isinstance(wav, list) else [wav.reshape(-1)] * len(group)
        for w in wavs[:len(group)]:
            secs = w.numel() / 24000
            results.append(RequestResult(t0, [(t1, secs)], t1, secs))
    return results, time.monotonic() - start


def print_table(rows: list[dict]) -> None:
    cols = ["system", "ttfa_p50", "ttfa_p90", "rtf", "on_time", "no_stall", "audio_s_per_s", "wall"]
    print("  ".join(f"{c:>14}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]:>14}" if isinstance(r[c], str) else f"{r[c]:>14.3f}" for c in cols))
    base = next((r for r in rows if r["system"].startswith("omnivox")), None)
    for r in rows:
        if r is base or base is None:
            continue
        print(f"{base['system']} vs {r['system']}: TTFA p50 {r['ttfa_p50'] / base['ttfa_p50']:.2f}x lower, "
              f"throughput {base['audio_s_per_s'] / r['audio_s_per_s']:.2f}x higher, "
              f"RTF {r['rtf'] / base['rtf']:.2f}x lower (ratios above 1: {base['system']} is better)")


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="streaming-speech benchmark (Qwen3-Omni: vs transformers; "
                                     "S2: vs omnivox one request at a time)")
    p.add_argument("--model", help="model folder (Qwen3-Omni or Fish S2), `fish-demo` or `qwen-demo` "
                                   "(default: the built-in Qwen3-Omni demo)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads on CPU for both systems (default: 1 for models under 100M parameters)")
    p.add_argument("--num-requests", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8, help="closed loop: requests in flight")
    p.add_argument("--rate", type=float, help="open loop: Poisson arrivals per second (overrides --concurrency)")
    p.add_argument("--prompt-tokens", type=int, default=None,
                   help="prompt length (default 32 tokens; S2: words of text, default 12)")
    p.add_argument("--reply-tokens", type=int, default=16, help="Thinker tokens per reply (Qwen3-Omni)")
    p.add_argument("--reply-frames", type=int, default=25,
                   help="speech frames per reply (Qwen3-Omni: exactly, 80 ms; S2: at most, 21.5 Hz)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-baseline", action="store_true", help="skip the baseline (transformers; S2: one at a time)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    from omnivox.engine.config import EngineConfig
    from omnivox.errors import OmnivoxError
    from omnivox.serve import FISH, detect_family, load_any

    if args.num_requests < 1 or args.concurrency < 1 or args.reply_frames < 1 or (args.rate is not None and args.rate <= 0):
        raise OmnivoxError("--num-requests, --concurrency, --reply-frames and --rate must be positive")
    family, _ = detect_family(args.model)
    cfg = EngineConfig(max_running=max(args.concurrency, 1), max_queue=args.num_requests)
    if family == FISH:
        return bench_tts(load_any(args.model, dtype=args.dtype, device=args.device, engine_config=cfg,
                                  cpu_threads=args.cpu_threads,
                                  progress=False), args)
    omni = load_any(args.model, dtype=args.dtype, device=args.device, engine_config=cfg, cpu_threads=args.cpu_threads)
    if args.prompt_tokens is None:
        args.prompt_tokens = 32
    plist = prompts(omni.cfg, args.num_requests, args.prompt_tokens, args.seed, omni.tokenizer)
    import torch
    print(f"model {omni.folder} ({args.dtype}, {args.device}, {torch.get_num_threads()} CPU threads for both "
          f"systems); {args.num_requests} requests, {_mode(args)}; "
          f"prompt {args.prompt_tokens} tokens, reply {args.reply_tokens} tokens + {args.reply_frames} frames "
          f"({args.reply_frames * 0.08:.2f} s of 24 kHz audio each)")
    run_omnivox(omni, plist[:2], args)  # warm-up
    res, wall = run_omnivox(omni, plist, args)
    stats = omni.engine.stats()
    omni.close()
    rows = [summarize("omnivox", res, wall)]
    if not args.no_baseline:
        for batched in (False, True):
            got = run_transformers(omni.folder, plist, args, batched)
            if got is None:
                print("transformers is not installed: no baseline")
                break
            rows.append(summarize(f"hf batch={args.concurrency if batched else 1}", *got))
    print_table(rows)
    t = stats.stages.get("talker")
    if t is not None:
        print(f"engine: thinker mean batch {stats.stages['thinker'].mean_batch:.1f}, talker mean batch "
              f"{t.mean_batch:.1f}, vocoder mean batch {stats.stages['vocoder'].mean_batch:.1f}, "
              f"preemptions {stats.preemptions}")
    return 0


def _mode(args: argparse.Namespace) -> str:
    return f"Poisson {args.rate}/s" if args.rate is not None else f"closed loop, concurrency {args.concurrency}"


def bench_tts(tts, args: argparse.Namespace) -> int:
    """Fish S2: omnivox at the requested load vs omnivox one request at a time (same requests)."""
    if args.prompt_tokens is None:
        args.prompt_tokens = 12
    texts = tts_texts(args.num_requests, args.prompt_tokens, args.seed)

    def submit(i: int):
        return tts.submit(texts[i], seed=args.seed + i, max_frames=args.reply_frames, ignore_eos=True)

    print(f"model {tts.folder} (Fish S2, {args.dtype}, {args.device}); {args.num_requests} distinct texts of "
          f"{args.prompt_tokens} words, {_mode(args)}; at most {args.reply_frames} S2 frames each; "
          f"audio produced at {tts.sample_rate} Hz")
    run_requests(submit, min(2, len(texts)), 2, None, args.seed)  # warm-up
    res, wall = run_requests(submit, len(texts), args.concurrency, args.rate, args.seed)
    stats = tts.engine.stats()
    rows = [summarize("omnivox", res, wall)]
    if not args.no_baseline:
        rows.append(summarize("omnivox-seq", *run_requests(submit, len(texts), 1, None, args.seed)))
    tts.close()
    print_table(rows)
    audio = sum(r.audio_seconds for r in res)
    print(f"audio: {audio:.3f} s in total at {tts.sample_rate} Hz ({audio / len(res):.3f} s per request); "
          f"engine: slow AR mean batch {stats.stages['slow_ar'].mean_batch:.1f}, vocoder mean batch "
          f"{stats.stages['vocoder'].mean_batch:.1f}, preemptions {stats.preemptions}")
    return 0
