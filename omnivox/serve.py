"""`omnivox serve`: load one model (any family the registry knows), start the engine, serve the
OpenAI-compatible API. The family decides nothing here: the loaded model (`ServedModel`) says
what it offers, its voices, its KV cache and its startup lines."""
from __future__ import annotations

import argparse
import errno
import os
import re
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from omnivox.api import access_log
from omnivox.errors import OmnivoxError
from omnivox.media_budget import MediaLimits
from omnivox.models.registry import detect, load
from omnivox.serving import Family, ServedModel, VoiceCloner, describe_weight_bytes
from omnivox.serving_duplex import DuplexModel


# a WebSocket message may be somewhat over the 15 MiB an append carries (its JSON around it): the
# append is then refused with an error event instead of the connection being closed
REALTIME_MAX_MESSAGE = 16 * 2**20 + 64 * 2**10


def default_served_name(model: ServedModel) -> str:
    return model.family.demo_served_name if model.is_demo else model.folder.resolve().name


def default_voices_dir(served_name: str) -> Path:
    """$OMNIVOX_CACHE/voices/<served name> (unsafe characters of the name replaced by `_`)."""
    from omnivox.demo import cache_root
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", served_name).lstrip(".") or "model"
    return cache_root() / "voices" / safe


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


def check_args(args: argparse.Namespace) -> Family:
    """What argparse's types (one flag each, checked at parse time) cannot say; returns the
    family --model names (a bad --model fails here, before anything binds or loads)."""
    family, _ = detect(args.model, any_family=True)
    if args.speculative_config is not None and "thinker" not in family.stages:
        raise OmnivoxError(f"--speculative-config drafts a Thinker's text; {family.label} has no Thinker: "
                           "remove the flag")
    if args.first_chunk_frames is not None and not 1 <= args.first_chunk_frames <= 25:
        raise OmnivoxError("--first-chunk-frames must be within 1-25")
    media = args.allowed_local_media_path
    if media is not None and not media.is_dir():
        raise OmnivoxError(f"--allowed-local-media-path {media} is not a directory")
    return family


def resolve_api_key(args: argparse.Namespace, env: dict[str, str] | None = None) -> str | None:
    """The API key: --api-key, else --api-key-file's first line, else $OMNIVOX_API_KEY, else none."""
    env = os.environ if env is None else env
    if args.api_key is not None and args.api_key_file is not None:
        raise OmnivoxError("pass one of --api-key and --api-key-file")
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise OmnivoxError(f"--api-key-file {args.api_key_file}: cannot read it ({e})") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise OmnivoxError(f"--api-key-file {args.api_key_file} is empty: write the key on its first line")
        return key
    if args.api_key is not None:
        if not args.api_key.strip():
            raise OmnivoxError("--api-key is empty")
        return args.api_key
    return env.get("OMNIVOX_API_KEY", "").strip() or None


def cmd_serve(args: argparse.Namespace) -> int:
    """Bind, answer HTTP at once (probes; 503 `loading` elsewhere), load the model in a thread,
    serve it once warm; drain on SIGTERM/SIGINT (`omnivox.api.lifecycle`)."""
    import threading

    import uvicorn

    from omnivox.api.guards import HostPolicy
    from omnivox.api.hooks import load_hook_factory
    from omnivox.api.lifecycle import GRACE_S, STOP_S, DrainingServer, Front, Lifecycle
    from omnivox.api.timeouts import protocol_with

    family = check_args(args)  # a bad --model fails before binding
    api_key = resolve_api_key(args)
    hook_factory = load_hook_factory(args.text_hook) if args.text_hook else None
    sock = _bind(args.host, args.port)  # fail fast, before loading weights
    hosts = HostPolicy.from_flags(args)
    lifecycle = Lifecycle()
    config = uvicorn.Config(Front(lifecycle, hosts), log_level=args.log_level, lifespan="off",
                            access_log=args.log_level in ("debug", "info"), timeout_graceful_shutdown=GRACE_S,
                            timeout_keep_alive=args.keep_alive_timeout, http=protocol_with(args.header_timeout),
                            server_header=False, ws="websockets-sansio", ws_max_size=REALTIME_MAX_MESSAGE)
    access_log.install()  # after uvicorn's logging set-up: key-like query values are logged as ***
    server = DrainingServer(config, lifecycle, args.drain_timeout)
    url = _url(sock)
    print(f"omnivox serve: loading {args.model or family.demo}; {url}/health/live answers now, {url}/health and "
          f"{url}/health/ready once it serves", flush=True)
    loader = threading.Thread(target=_load_and_serve, args=(args, lifecycle, hosts, api_key, hook_factory, url),
                              name="omnivox-load", daemon=True)
    loader.start()
    server.run(sockets=[sock])
    if lifecycle.error is not None:
        raise lifecycle.error
    if not loader.is_alive() and lifecycle.app is not None:  # (stopped while loading: nothing ran, nothing to close)
        closing = threading.Thread(target=lifecycle.app.state.close, name="omnivox-close", daemon=True)
        closing.start()  # the engine stops after its current step; tensor-parallel workers with it
        closing.join(timeout=STOP_S)
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: never wait for a thread inside torch (nor let the interpreter finalize under it), nor for a
    # worker pool's job: the exit is bounded (lifecycle.exit_bound)
    os._exit(0)


def _load_and_serve(args: argparse.Namespace, lifecycle, hosts, api_key: str | None, hook_factory,
                    url: str) -> None:
    """The loader thread: the model, its app, the warm-up; then `lifecycle` serves the app. A
    failure is handed to the main thread (`lifecycle.error`), which stops the server and reports it."""
    from omnivox.demo import NOISE_NOTE

    loaded = None
    try:
        loaded = load_app(args, lifecycle, hosts, api_key, hook_factory)
        _announce(loaded.model, loaded.name, args, url, NOISE_NOTE if loaded.model.is_demo else None, loaded.voices,
                  api_key is not None, loaded.graphs)
        lifecycle.serve(loaded.app)
    except BaseException as e:  # noqa: BLE001 - handed to the main thread, which raises it
        if loaded is not None:
            loaded.model.close()
        lifecycle.error = e


@dataclass(frozen=True)
class LoadedApp:
    model: ServedModel
    name: str  # the served model name
    voices: object | None  # the VoiceStore of a VoiceCloner
    app: object  # the model's FastAPI app (`create_app`)
    graphs: str | None  # the warm-up's CUDA graph line


def load_app(args: argparse.Namespace, lifecycle, hosts, api_key: str | None, hook_factory) -> LoadedApp:
    """The model and its app with every limit the serve flags set, warmed up (lifecycle moves to
    `warming_up`; the caller moves it to serving). One path for `omnivox serve` and for each
    engine replica of `omnivox serve --replicas` (omnivox/replicas/engine.py), so both answer
    every request with the same code. On failure the model is closed and the error raised."""
    from omnivox.api.admission import Pools
    from omnivox.api.moshi_chat import MoshiChatLimits
    from omnivox.api.output_limits import OutputLimits
    from omnivox.api.realtime import RealtimeLimits
    from omnivox.api.server import create_app
    from omnivox.api.voices import VoiceStore
    from omnivox.engine.config import EngineConfig

    model = None
    try:
        cfg = EngineConfig(max_running=args.max_running, max_queue=args.max_queue,
                           first_chunk_frames=args.first_chunk_frames,
                           cuda_graphs="off" if args.enforce_eager else "auto",
                           speculative=args.speculative_config, scheduling=args.scheduling,
                           stream_lead_s=args.stream_lead_s, stage_loops=args.stage_loops)
        model = load(args.model, dtype=args.dtype, device=args.device, engine_config=cfg, placement=args.placement,
                     tensor_parallel_size=args.tensor_parallel_size, quantization=args.quantization,
                     fp8_compute=args.fp8_compute, kv_cache_mb=args.kv_cache_mb,
                     gpu_memory_utilization=args.gpu_memory_utilization, cpu_threads=args.cpu_threads,
                     media_limits=MediaLimits(max_decode_bytes=int(args.max_media_decode_mb * 2**20)),
                     any_family=True)
        limits = OutputLimits.for_model(model, args.max_output_tokens, args.max_audio_seconds)
        name = args.served_model_name or default_served_name(model)
        voices = None
        if isinstance(model, VoiceCloner):
            voices = VoiceStore(args.voices_dir or default_voices_dir(name), max_voices=args.max_voices,
                                max_sample_bytes=int(args.max_voice_sample_mb * 2**20))
        pools = Pools.create(media_workers=args.media_workers, media_queue=args.media_queue,
                             voice_workers=args.voice_workers, voice_queue=args.voice_queue,
                             realtime_workers=args.realtime_workers)
        pending = None if args.max_pending_body_mb is None else int(args.max_pending_body_mb * 2**20)
        realtime = RealtimeLimits(allowed_origins=tuple(o.rstrip("/") for o in args.allowed_origins),
                                  idle_timeout_s=args.realtime_idle_timeout_s, max_buffer_s=args.realtime_max_buffer_s,
                                  audio_window_s=args.realtime_audio_window_s, max_sessions=args.max_realtime_sessions,
                                  send_timeout_s=args.realtime_send_timeout_s,
                                  send_buffer_bytes=args.realtime_send_buffer_kb * 2**10,
                                  turn_idle_s=args.realtime_turn_idle_s, turn_kv_share=args.realtime_turn_kv_share,
                                  duplex_max_session_s=duplex_max_session_s(model, args.duplex_max_session_s))
        app = create_app(model, name, api_key=api_key, hook_factory=hook_factory,
                         max_body_bytes=int(args.max_body_mb * 2**20), voices=voices, hosts=hosts,
                         body_timeout=args.body_timeout, max_pending_body_bytes=pending, pools=pools,
                         voice_aliases=dict(args.voice_alias), media_dir=args.allowed_local_media_path,
                         realtime=realtime, output_limits=limits, lifecycle=lifecycle,
                         stream_send_timeout=args.stream_send_timeout_s,
                         moshi_chat=MoshiChatLimits(idle_timeout_s=args.duplex_idle_timeout_s))
        lifecycle.phase = "warming_up"
        graphs = model.engine.stages.warmup()  # before any request: captures are printed, not paid by a client
        return LoadedApp(model, name, voices, app, graphs)
    except BaseException:
        if model is not None:
            model.close()
        raise


def duplex_max_session_s(model: ServedModel, seconds: float | None) -> float | None:
    """--duplex-max-session-s checked against the loaded model: OmnivoxError for a model that is
    not full duplex, or for more than the model's own maximum."""
    if seconds is None:
        return None
    if not isinstance(model, DuplexModel):
        raise OmnivoxError(f"--duplex-max-session-s applies to a full-duplex model; {model.family.label} is not one: "
                           "remove the flag")
    if seconds > model.max_session_seconds:
        raise OmnivoxError(f"--duplex-max-session-s {seconds:g} is over this model's session limit of "
                           f"{model.max_session_seconds:g} s")
    return seconds


def _url(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://{'[' + host + ']' if ':' in host else host}:{port}"


def _announce(model: ServedModel, name: str, args: argparse.Namespace, url: str, note: str | None,
              voices, keyed: bool, graphs: str | None = None) -> None:
    import torch

    from omnivox.layers.fp8 import describe_compute

    what = "the built-in demo model" if model.is_demo else "model"
    kind, *extra = model.describe()
    if voices is not None:
        kind += f"; voices: default + {len(voices.names())} saved in {voices.folder}"
    lines = [
        f"omnivox serve: {what} {model.folder} as {name!r}",
        f"  {kind}; {args.dtype} on {args.device}"
        + (f" ({torch.get_num_threads()} CPU threads)" if args.device == "cpu" else "")
        + (f"; placement {args.placement}, stage loops {args.stage_loops}" if args.placement else "")
        + (f"; Thinker tensor-parallel over {args.tensor_parallel_size} processes" if args.tensor_parallel_size > 1
           else ""),
        *(f"  {line}" for line in extra),
        f"  {describe_weight_bytes(model.weight_bytes())}"
        + (f"; FP8 weights ({args.quantization or 'checkpoint'}, "
           f"{describe_compute(args.fp8_compute, args.device, args.placement)})"
           if any("float8_e4m3fn" in by for by in model.weight_bytes().values()) else ""),
        f"  engine: max_running {args.max_running}, max_queue {args.max_queue}, scheduling {args.scheduling}; "
        f"KV cache: {model.kv_summary()}",
        *([f"  {model.kv_budget.describe()}"] if model.kv_budget is not None else []),
        f"  api key: {'required' if keyed else 'none'}; text hook: {args.text_hook or 'none'}; "
        f"local media: {args.allowed_local_media_path.resolve() if args.allowed_local_media_path else 'off'}; "
        f"media decode budget: {args.max_media_decode_mb:g} MB a request",
        *([f"  {graphs}"] if graphs else []),
    ]
    if note:
        lines.append(f"  {note}")
    ws = url.replace('http', 'ws', 1)
    live = f"realtime: {ws}/v1/realtime, playground: {url}/playground"
    if isinstance(model, DuplexModel):  # full duplex: moshi's own protocol too
        live = f"duplex (moshi's protocol): {ws}/api/chat, {live}"
    lines.append(f"serving on {url} (OpenAI API: {url}/v1, {live}, metrics: {url}/metrics)")
    print("\n".join(lines), flush=True)
