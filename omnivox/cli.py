"""omnivox command line: `omnivox generate | speak | duplex | serve | bench`. Errors print one line, never a traceback
(set OMNIVOX_DEBUG=1 to see one)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from omnivox.args import HelpFormatter, add_quantization_args, subcommand
from omnivox.errors import OmnivoxError


def _ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError("expected comma-separated integers, e.g. 1,2,3") from None


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="Hugging Face model folder (default: the built-in demo model)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights' dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    add_quantization_args(p)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="omnivox", description="Serve and run omni speech models.",
                                     formatter_class=HelpFormatter)
    from omnivox import __version__
    parser.add_argument("--version", action="version", version=f"omnivox {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = subcommand(sub, "generate", "answer one prompt offline: text and speech")
    add_model_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the user's text")
    src.add_argument("--prompt-ids", type=_ids, help="prompt token ids, comma-separated (one placeholder per media token)")
    g.add_argument("--system", help="system prompt (with --prompt)")
    g.add_argument("--audio", action="append", default=[], metavar="FILE", help="audio input (repeatable)")
    g.add_argument("--image", action="append", default=[], metavar="FILE", help="image input (repeatable)")
    g.add_argument("--speaker", help="voice, e.g. ethan")
    g.add_argument("--greedy", action="store_true", help="argmax decoding everywhere (reference-equal)")
    g.add_argument("--temperature", type=float, help="Thinker sampling temperature; it, --top-p and --top-k "
                                                      "default to the checkpoint's generation_config.json")
    g.add_argument("--top-p", type=float)
    g.add_argument("--top-k", type=int)
    g.add_argument("--seed", type=int, help="sampling seed (the same seed, the same reply)")
    g.add_argument("--max-tokens", type=int, help="at most this many Thinker tokens")
    g.add_argument("--max-frames", type=int, help="at most this many 80 ms speech frames")
    g.add_argument("--no-audio", action="store_true", help="text only")
    g.add_argument("--out", type=Path, help="write the reply's speech to this .wav file")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.set_defaults(func=cmd_generate)
    k = subcommand(sub, "speak", "text to speech offline, on any family (Qwen3-Omni or Fish S2)")
    k.add_argument("--model", help="model folder, `fish-demo` (built-in S2 demo) or `qwen-demo` "
                                   "(default: the built-in Qwen3-Omni demo)")
    k.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights' dtype")
    k.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    k.add_argument("--text", required=True, help="the text to speak")
    k.add_argument("--voice", help="Qwen3-Omni: a speaker (ethan, chelsie, aiden); S2: a saved voice's name "
                                   "(or `default`)")
    k.add_argument("--ref-audio", type=Path, help="S2: reference clip to clone (with --ref-text)")
    k.add_argument("--ref-text", help="S2: the reference clip's transcript")
    k.add_argument("--voices-dir", type=Path, help="S2 saved voices folder (default: the server's, "
                                                   "$OMNIVOX_CACHE/voices/<served model name>)")
    k.add_argument("--out", type=Path, required=True, help="write the speech to this .wav file")
    k.add_argument("--seed", type=int, help="sampling seed (the same seed, the same speech)")
    k.add_argument("--max-frames", type=int, help="at most this many frames (S2: 21.5 Hz; Qwen3-Omni: 80 ms)")
    k.set_defaults(func=cmd_speak)
    d = subcommand(sub, "duplex", "full-duplex speech offline (Moshi): the model listens to a whole input file "
                              "and speaks at the same time, frame by frame")
    d.add_argument("--model", required=True, help="Kyutai Moshi folder (config.json names its files) or `moshi-demo` "
                                                  "(the built-in tiny demo)")
    d.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                   help="the LM's dtype (Mimi runs in float32)")
    d.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    d.add_argument("--input", type=Path, required=True, help="the user's audio (wav/flac/ogg/mp3, resampled to 24 kHz)")
    d.add_argument("--out", type=Path, required=True, help="write the model's speech to this .wav file")
    mode = d.add_mutually_exclusive_group()
    mode.add_argument("--greedy", action="store_true", help="argmax everywhere (equal to moshi's use_sampling=False)")
    mode.add_argument("--sample", dest="greedy", action="store_false",
                      help="sample with the checkpoint's lm_gen_config (the default)")
    d.add_argument("--seed", type=int, default=0, help="sampling seed (the same seed, the same reply)")
    d.add_argument("--json", action="store_true", help="print one JSON object: text, frames, seconds, timing")
    d.set_defaults(func=cmd_duplex)
    s = subcommand(sub, "serve", "serve the OpenAI-compatible HTTP API (chat completions, speech, voices)")
    from omnivox.serve_args import add_serve_args
    add_serve_args(s)
    s.set_defaults(func=cmd_serve)
    from omnivox.bench import add_parser as add_bench
    add_bench(sub)
    return parser


def cmd_serve(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        from omnivox.replicas.launch import serve_replicas  # the only path that imports ray
        return serve_replicas(args)
    from omnivox.serve import cmd_serve as run
    return run(args)


def cmd_generate(args: argparse.Namespace) -> int:
    from omnivox.models.registry import detect

    family, folder = detect(args.model)
    if not family.chat:
        raise OmnivoxError(f"{family.label} is a text-to-speech model: `omnivox generate` needs a model that "
                           "understands prompts; use `omnivox speak`")
    from omnivox.offline import OfflineModel
    omni = OfflineModel(family.load(folder, dtype=args.dtype, device=args.device, progress=not args.json,
                                    quantization=args.quantization, fp8_compute=args.fp8_compute))
    try:  # the engine thread stops before the interpreter does (a live one can abort the exit)
        return _generate(omni, args)
    finally:
        omni.close()


def _generate(omni, args: argparse.Namespace) -> int:
    from omnivox.audio.io import write_wav
    from omnivox.demo import NOISE_NOTE

    opts = dict(max_tokens=args.max_tokens, max_frames=args.max_frames, greedy=args.greedy,
                temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                speaker=args.speaker, return_audio=not args.no_audio)
    if args.prompt is not None:
        parts = [{"type": "audio", "audio": str(a)} for a in args.audio]
        parts += [{"type": "image", "image": str(i)} for i in args.image]
        parts.append({"type": "text", "text": args.prompt})
        out = omni.generate([{"role": "user", "content": parts}], system=args.system, **opts)
    else:
        out = omni.generate(prompt_ids=args.prompt_ids, audio=[str(a) for a in args.audio],
                            images=[str(i) for i in args.image], **opts)
    if args.out is not None and out.audio.size:
        write_wav(args.out, out.audio, out.sample_rate)
    if args.json:
        print(json.dumps({"text": out.text, "text_ids": out.text_ids, "codes": out.codes.tolist(),
                          "audio_seconds": round(out.audio_seconds, 6), "sample_rate": out.sample_rate,
                          "finish_reason": out.finish_reason}))
        return 0
    if omni.is_demo:
        print(NOISE_NOTE, file=sys.stderr)
    print(out.text)
    where = f" -> {args.out}" if args.out is not None and out.audio.size else ""
    print(f"[{len(out.text_ids)} tokens, {out.codes.shape[0]} speech frames, "
          f"{out.audio_seconds:.2f} s of audio at {out.sample_rate} Hz{where}]", file=sys.stderr)
    return 0


def cmd_speak(args: argparse.Namespace) -> int:
    from omnivox.audio.io import write_wav
    from omnivox.demo import NOISE_NOTE
    from omnivox.models.registry import detect, load
    from omnivox.serving import SpeechParams

    family, folder = detect(args.model)
    if (args.ref_audio is None) != (args.ref_text is None):
        raise OmnivoxError("--ref-audio and --ref-text go together (the clip and its transcript)")
    if args.ref_audio is not None and args.voice is not None:
        raise OmnivoxError("pass either --voice or --ref-audio/--ref-text, not both")
    if not family.cloning and (args.ref_audio is not None or args.voices_dir is not None):
        raise OmnivoxError(f"voice cloning (--ref-audio, --voices-dir) needs a model that clones voices (Fish S2); "
                           f"{family.label} speaks with its own voices (--voice)")
    voice, refs, saved = _speak_voice(family, folder, args)  # before loading: errors come fast
    model = load(args.model, dtype=args.dtype, device=args.device, progress=False)
    try:
        if saved is not None:  # a saved voice: the model reads its own bytes back
            voice = model.voice_from_bytes(saved)
        fin, audio = model.speech(args.text, SpeechParams(seed=args.seed, max_frames=args.max_frames), voice=voice,
                                  references=refs).collect()
    finally:
        model.close()
    write_wav(args.out, audio, model.sample_rate)
    if model.is_demo:
        print(NOISE_NOTE, file=sys.stderr)
    print(f"[{fin.codes.shape[0]} {model.family.label} frames, {audio.shape[0] / model.sample_rate:.3f} s of audio "
          f"at {model.sample_rate} Hz -> {args.out}]", file=sys.stderr)
    return 0


def cmd_duplex(args: argparse.Namespace) -> int:
    from omnivox.audio.io import load_audio, write_wav
    from omnivox.demo import NOISE_NOTE
    from omnivox.models.registry import detect

    family, _ = detect(args.model, any_family=True)
    if family.name != "moshi":
        raise OmnivoxError(f"`omnivox duplex` runs Moshi checkpoints; {args.model} is {family.label}")
    if args.seed < 0:
        raise OmnivoxError(f"--seed must be non-negative, got {args.seed}")
    pcm = load_audio(args.input, target_sr=24000)  # before loading: errors come fast
    from omnivox import Duplex
    load_start = time.perf_counter()
    duplex = Duplex(model=args.model, dtype=args.dtype, device=args.device)
    load_s = time.perf_counter() - load_start
    try:
        out = duplex.converse(pcm, sample_rate=24000, greedy=args.greedy, seed=args.seed)
    finally:
        duplex.close()  # its engine thread
    write_wav(args.out, out.audio, out.sample_rate)
    if args.json:
        print(json.dumps({"text": out.text, "input_frames": out.input_frames, "frames": out.frames,
                          "audio_seconds": round(out.audio.size / out.sample_rate, 6), "sample_rate": out.sample_rate,
                          "load_seconds": round(load_s, 3), "loop_seconds": round(out.seconds, 3),
                          "ms_per_frame": round(1000 * out.seconds / max(out.input_frames, 1), 3)}))
        return 0
    if duplex.is_demo:
        print(NOISE_NOTE, file=sys.stderr)
    print(out.text)
    print(f"[{out.input_frames} frames in, {out.frames} out, {out.audio.size / out.sample_rate:.2f} s of audio at "
          f"{out.sample_rate} Hz -> {args.out}; {1000 * out.seconds / max(out.input_frames, 1):.1f} ms per frame]",
          file=sys.stderr)
    return 0


def _speak_voice(family, folder: Path | None, args: argparse.Namespace):
    """(voice, references, saved voice bytes) of `omnivox speak`: a saved voice by name (families
    with cloning: its file's bytes, which the loaded model reads), a clip and its transcript, or a
    built-in voice name for the model to check."""
    from omnivox.api.voices import NAME_RE, SUFFIX
    from omnivox.serve import default_voices_dir

    if args.ref_audio is not None:
        if not args.ref_audio.is_file():
            raise OmnivoxError(f"reference audio {args.ref_audio} not found")
        return None, [(args.ref_audio.read_bytes(), args.ref_text)], None
    if args.voice in (None, "default") or not family.cloning:
        return args.voice, [], None
    served = family.demo_served_name if folder is None else folder.resolve().name
    folder = args.voices_dir or default_voices_dir(served)
    if not NAME_RE.fullmatch(args.voice):
        raise OmnivoxError(f"invalid voice name {args.voice!r}: use letters, digits, '_' and '-'")
    path = folder / (args.voice + SUFFIX)
    if not path.is_file():
        saved = sorted(p.stem for p in folder.glob("*" + SUFFIX)) if folder.is_dir() else []
        raise OmnivoxError(f"no saved voice {args.voice!r} in {folder} (saved: {', '.join(saved) or 'none'}); "
                           "create one with POST /v1/audio/voices or pass --ref-audio/--ref-text")
    return None, [], path.read_bytes()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except OmnivoxError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # never a traceback for the user
        if os.environ.get("OMNIVOX_DEBUG"):
            raise
        print(f"error: internal: {type(e).__name__}: {e} (set OMNIVOX_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
