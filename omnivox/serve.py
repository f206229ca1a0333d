"""`omnivox serve`: load one model (either family), start the engine, serve the OpenAI-compatible API.

Also the model loading that `omnivox speak` and `omnivox bench` share: the family is read from
the folder's `config.json` `model_type` (`qwen3_omni_moe` -> Qwen3-Omni `Omni`;
`fish_qwen3_omni` or `dual_ar` -> Fish S2 Pro `FishTTS`), or named by a built-in demo spelling.
"""
from __future__ import annotations

import argparse
import errno
import json
import math
import re
import socket
from dataclasses import replace
from pathlib import Path

from omnivox.errors import CheckpointError, OmnivoxError

QWEN, FISH = "qwen3_omni", "fish_s2"
FAMILIES = {"qwen3_omni_moe": QWEN, "fish_qwen3_omni": FISH, "dual_ar": FISH}
DEMOS = {"qwen-demo": QWEN, "fish-demo": FISH}  # --model spellings of the built-in demo checkpoints
FISH_DEMO_NAME = "omnivox-demo-fish-s2"
QWEN_KV_MB = 256.0  # Qwen3-Omni default KV budget (Thinker + Talker)
FISH_KV_MB = 4096.0  # S2 Pro: bf16 slow AR ~144 KiB per token -> ~29k tokens; capped at what can be used


def detect_family(model: str | None) -> tuple[str, Path | None]:
    """(family, folder) for a --model value; folder None means the family's built-in demo."""
    if model is None or model in DEMOS:
        return (DEMOS.get(model, QWEN) if model else QWEN), None
    folder = Path(model)
    if not folder.is_dir():
        raise CheckpointError(f"model folder {folder} does not exist (or pass --model fish-demo / qwen-demo)")
    config = folder / "config.json"
    if not config.is_file():
        raise CheckpointError(f"{folder} has no config.json: not a Hugging Face model folder")
    try:
        kind = json.loads(config.read_text()).get("model_type")
    except (ValueError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{config} is not a valid JSON object ({type(e).__name__})") from None
    if kind not in FAMILIES:
        raise CheckpointError(f"config.json model_type {kind!r} is not supported; omnivox serves qwen3_omni_moe "
                              "(Qwen3-Omni) and fish_qwen3_omni / dual_ar (Fish S2 Pro)")
    return FAMILIES[kind], folder


def load_any(model: str | None, *, dtype: str = "float32", device: str = "cpu", progress: bool = True,
             engine_config=None, kv_cache_mb: float | None = None, cpu_threads: int | None = None):
    """An `Omni` or a `FishTTS` for `model` (a folder, `fish-demo`, `qwen-demo` or None = Qwen demo).
    kv_cache_mb None: the family's default (see `default_kv_mb`)."""
    from omnivox.engine.config import EngineConfig

    family, folder = detect_family(model)
    cfg = engine_config or EngineConfig()
    if family == FISH:
        from omnivox.tts import FishTTS
        loaded = FishTTS(model=folder, dtype=dtype, device=device, progress=progress, engine_config=cfg)
    else:
        from omnivox.omni import Omni
        loaded = Omni(model=folder, dtype=dtype, device=device, progress=progress, engine_config=cfg)
    mb = kv_cache_mb if kv_cache_mb is not None else default_kv_mb(loaded)
    loaded.engine_config = replace(loaded.engine_config, kv_cache_mb=mb)  # the engine starts later, on first use
    if device == "cpu":
        configure_cpu_threads(loaded, cpu_threads)
    return loaded


def _cpu_threads() -> int:
    import torch
    return torch.get_num_threads()


def configure_cpu_threads(loaded, threads: int | None = None) -> int:
    """Intra-op threads for CPU serving. None = auto: one thread for models under 100M
    parameters, whose steps are many tiny ops where thread hand-offs cost more than they
    save (measured on 2 cores: 3x the audio throughput of the default); torch's default
    otherwise. Process-wide: call it only in processes omnivox owns (serve, bench, speak)."""
    import torch

    if threads is None:
        modules = [loaded.model] if hasattr(loaded, "model") else [loaded.slow, loaded.fast, loaded.codec]
        params = sum(p.numel() for m in modules for p in m.parameters())
        threads = 1 if params < 100_000_000 else torch.get_num_threads()
    torch.set_num_threads(max(1, int(threads)))
    return torch.get_num_threads()


def family_of(model) -> str:
    from omnivox.tts import FishTTS
    return FISH if isinstance(model, FishTTS) else QWEN


def default_kv_mb(model) -> float:
    """Qwen3-Omni: 256 MB. S2: 4096 MB, or less when max_running sequences of the whole context
    need less (the tiny demo), so the pool is never larger than can ever be used."""
    if family_of(model) != FISH:
        return QWEN_KV_MB
    from omnivox.kv_cache.pool import KVPool
    t = model.cfg.text
    per_token = KVPool.bytes_per_block(t.n_layer, 1, t.n_local_heads, t.head_dim, model.slow.norm.weight.dtype)
    need = model.engine_config.max_running * (t.max_seq_len + model.engine_config.block_size) * per_token
    return min(FISH_KV_MB, math.ceil(need / 2**20))


def default_served_name(model) -> str:
    if model.is_demo:
        from omnivox.demo import DEMO_NAME
        return FISH_DEMO_NAME if family_of(model) == FISH else DEMO_NAME
    return model.folder.resolve().name


def default_voices_dir(served_name: str) -> Path:
    """$OMNIVOX_CACHE/voices/<served name> (unsafe characters of the name replaced by `_`)."""
    from omnivox.demo import cache_root
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", served_name).lstrip(".") or "model"
    return cache_root() / "voices" / safe


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", help="the model id clients send (default: the folder's name; "
                                                "omnivox-demo-qwen3-omni / omnivox-demo-fish-s2 for the demos)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 routes")
    p.add_argument("--max-running", type=int, default=32, help="requests running at once")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting beyond --max-running; more get HTTP 503")
    p.add_argument("--kv-cache-mb", type=float, default=None,
                   help=f"KV cache memory (default: Qwen3-Omni {QWEN_KV_MB:.0f} for Thinker + Talker; "
                        f"S2 {FISH_KV_MB:.0f}, or what --max-running full contexts need if less)")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted (413 beyond)")
    p.add_argument("--cpu-threads", type=int, default=None,
                   help="torch intra-op threads on CPU (default: 1 for models under 100M parameters)")
    p.add_argument("--voices-dir", type=Path, help="saved voices folder (S2; default $OMNIVOX_CACHE/voices/<name>)")
    p.add_argument("--max-voices", type=int, default=100, help="most saved voices kept (S2)")
    p.add_argument("--max-voice-sample-mb", type=float, default=10.0,
                   help="largest audio sample accepted by POST /v1/audio/voices")
    p.add_argument("--text-hook", metavar="MODULE:FUNCTION",
                   help="a text hook plug-in: FUNCTION(request_json) -> hook(delta, final) -> text to voice")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
        raise OmnivoxError(f"{host}:{port} {why}; pass another --port or --host") from None
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _check_args(args: argparse.Namespace) -> None:
    for name in ("max_running", "max_queue"):
        if getattr(args, name) < (1 if name == "max_running" else 0):
            raise OmnivoxError(f"--{name.replace('_', '-')} must be {'>= 1' if name == 'max_running' else '>= 0'}")
    for name in ("max_body_mb", "max_voice_sample_mb"):
        if getattr(args, name) <= 0:
            raise OmnivoxError(f"--{name.replace('_', '-')} must be positive")
    if args.kv_cache_mb is not None and args.kv_cache_mb <= 0:
        raise OmnivoxError("--kv-cache-mb must be positive")
    if args.max_voices < 0:
        raise OmnivoxError("--max-voices must be >= 0")


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from omnivox.api.hooks import load_hook_factory
    from omnivox.api.server import create_app
    from omnivox.api.voices import VoiceStore
    from omnivox.demo import NOISE_NOTE
    from omnivox.engine.config import EngineConfig

    _check_args(args)
    detect_family(args.model)  # a bad --model fails before binding
    hook_factory = load_hook_factory(args.text_hook) if args.text_hook else None
    sock = _bind(args.host, args.port)  # fail fast, before loading weights
    cfg = EngineConfig(max_running=args.max_running, max_queue=args.max_queue)
    model = load_any(args.model, dtype=args.dtype, device=args.device, engine_config=cfg,
                     kv_cache_mb=args.kv_cache_mb, cpu_threads=args.cpu_threads)
    name = args.served_model_name or default_served_name(model)
    voices = None
    if family_of(model) == FISH:
        voices = VoiceStore(args.voices_dir or default_voices_dir(name), max_voices=args.max_voices,
                            max_sample_bytes=int(args.max_voice_sample_mb * 2**20))
    app = create_app(model, name, api_key=args.api_key, hook_factory=hook_factory,
                     max_body_bytes=int(args.max_body_mb * 2**20), voices=voices)
    _announce(model, name, args, sock, NOISE_NOTE if model.is_demo else None, voices)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level in ("debug", "info"),
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _kv_line(model) -> str:
    cfg = model.engine_config
    if family_of(model) == FISH:
        from omnivox.models.fish_s2.stages.dual_ar import kv_blocks
        pages = kv_blocks(model.slow, cfg)
        return f"slow AR {pages} pages ({pages * cfg.block_size} tokens, {cfg.kv_cache_mb:g} MB)"
    from omnivox.models.qwen3_omni.stages.graph import split_kv_budget
    thinker_pages, talker_pages = split_kv_budget(model.model, cfg)
    return f"thinker {thinker_pages} pages" + (f", talker {talker_pages} pages" if talker_pages else "") + \
        f" ({cfg.kv_cache_mb:g} MB)"


def _announce(model, name: str, args: argparse.Namespace, sock: socket.socket, note: str | None, voices) -> None:
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    what = "the built-in demo model" if model.is_demo else "model"
    if family_of(model) == FISH:
        from omnivox.models.fish_s2 import LICENSE_NOTICE
        kind = f"Fish S2 (text to speech, {model.sample_rate} Hz); context {model.cfg.text.max_seq_len} tokens"
        who = f"voices: default + {len(voices.names())} saved in {voices.folder}"
        extra = [] if model.is_demo else [f"  note: {LICENSE_NOTICE}"]
    else:
        kind = f"Qwen3-Omni; context {model.cfg.thinker.text.max_position_embeddings} tokens"
        who = f"voices: {', '.join(model.speakers) or '(none: text only)'}"
        extra = []
    lines = [
        f"omnivox serve: {what} {model.folder} as {name!r}",
        f"  {kind}; {who}; {args.dtype} on {args.device}"
        + (f" ({_cpu_threads()} CPU threads)" if args.device == "cpu" else ""),
        f"  engine: max_running {args.max_running}, max_queue {args.max_queue}; KV cache: {_kv_line(model)}",
        f"  api key: {'required' if args.api_key else 'none'}; text hook: {args.text_hook or 'none'}",
        *extra,
    ]
    if note:
        lines.append(f"  {note}")
    lines.append(f"listening on {url} (OpenAI API: {url}/v1, metrics: {url}/metrics)")
    print("\n".join(lines), flush=True)
