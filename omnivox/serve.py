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
from omnivox.args import COUNT, PORT, POSITIVE, SLOTS, add_gpu_memory_arg, add_quantization_args, first_chunk_arg, kv_budget, placement, ranged, speculative_arg
from omnivox.errors import OmnivoxError
from omnivox.media_budget import MediaLimits
from omnivox.models.registry import FAMILIES, detect, load
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


def add_serve_args(p: argparse.ArgumentParser) -> None:
    """Every flag of `omnivox serve` (its replicas' too: `replicas/launch.py` parses the same)."""
    p.add_argument("--model", help="model folder (Qwen3-Omni or Fish S2, detected from config.json), "
                                   "`fish-demo` or `qwen-demo` (default: the built-in Qwen3-Omni demo)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="weights' dtype")
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    add_quantization_args(p)
    p.add_argument("--served-model-name", help="the model id clients send (default: the folder's name; "
                                                f"{' / '.join(f.demo_served_name for f in FAMILIES)} for the demos)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind")
    p.add_argument("--port", type=PORT, default=8000, help="port to bind; 0 picks a free one")
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 routes (visible in the process "
                                     "list: prefer --api-key-file or $OMNIVOX_API_KEY)")
    p.add_argument("--api-key-file", type=Path, help="read the API key from this file's first line")
    p.add_argument("--allowed-hosts", default="",
                   help="comma-separated host names the server answers besides its bind address (and localhost "
                        "on loopback); `*` for any (Host headers are checked against DNS rebinding)")
    p.add_argument("--max-running", type=COUNT, default=32, help="requests running at once")
    p.add_argument("--max-queue", type=SLOTS, default=256,
                   help="requests waiting beyond --max-running; more get HTTP 503")
    p.add_argument("--kv-cache-mb", type=kv_budget, default=None,
                   help="KV cache memory in MB, or each stage's: thinker=MB,talker=MB (default: on CUDA, from the "
                        "device's memory under --gpu-memory-utilization; on CPU Qwen3-Omni 256 for Thinker + Talker, "
                        "half each, S2 4096, or what --max-running full contexts need if less)")
    add_gpu_memory_arg(p)
    p.add_argument("--placement", type=placement, default=None, metavar="STAGE=DEVICE,...",
                   help="a device per stage, e.g. thinker=cuda:0,talker=cuda:1,vocoder=cuda:1,encoder=cuda:0 "
                        "(Qwen3-Omni: thinker, talker, vocoder, encoder; S2: slow_ar, vocoder); unnamed stages run "
                        "on --device")
    p.add_argument("--tensor-parallel-size", type=COUNT, default=1, metavar="N",
                   help="shard Qwen3-Omni's Thinker over N processes (torch.distributed: NCCL on CUDA, gloo on CPU; "
                        "ranks on consecutive devices from the Thinker's); other stages stay in this process")
    p.add_argument("--stage-loops", default="device", metavar="device|one|STAGE+STAGE,...",
                   help="device (default): the stages of each device step in their own thread, all devices at "
                        "once; one: every stage in one thread; or an explicit split, e.g. thinker,talker+vocoder")
    p.add_argument("--max-output-tokens", type=COUNT, default=None,
                   help="most text tokens one reply may ask for (chat max_tokens; 400 beyond; default: the model's "
                        "context)")
    p.add_argument("--max-audio-seconds", type=POSITIVE, default=None,
                   help="most audio one reply may ask for (chat max_audio_frames, speech max_frames; 400 beyond; "
                        "default: what the Talker's / S2 slow AR's context holds)")
    p.add_argument("--max-body-mb", type=POSITIVE, default=32.0, help="largest request body accepted (413 beyond)")
    p.add_argument("--cpu-threads", type=COUNT, default=None,
                   help="torch intra-op threads on CPU (default: 1 for models under 100M parameters)")
    p.add_argument("--voices-dir", type=Path, help="saved voices folder (S2; default $OMNIVOX_CACHE/voices/<name>)")
    p.add_argument("--max-voices", type=SLOTS, default=100, help="most saved voices kept (S2)")
    p.add_argument("--max-voice-sample-mb", type=POSITIVE, default=10.0,
                   help="largest audio sample accepted by POST /v1/audio/voices")
    p.add_argument("--max-pending-body-mb", type=POSITIVE, default=None,
                   help="request bodies being received at once, in MB (503 beyond; default 4 x --max-body-mb)")
    p.add_argument("--body-timeout", type=POSITIVE, default=60.0,
                   help="seconds a request body may take to arrive in full (408 and the connection closed beyond)")
    p.add_argument("--header-timeout", type=POSITIVE, default=10.0,
                   help="seconds a request's headers may take to arrive (the connection is closed beyond)")
    p.add_argument("--keep-alive-timeout", type=POSITIVE, default=5.0,
                   help="seconds an idle keep-alive connection is kept open")
    p.add_argument("--stream-send-timeout-s", type=POSITIVE, default=None,
                   help="drop a client that reads nothing of a streamed reply (event stream or chunked audio) this "
                        "long while the socket is full, and cancel its request (default: --realtime-send-timeout-s)")
    p.add_argument("--media-workers", type=COUNT, default=2, help="threads decoding chat media (audio, images, video)")
    p.add_argument("--max-media-decode-mb", type=POSITIVE, default=512.0,
                   help="memory one request's media may take while decoded and preprocessed, priced from each "
                        "file's header before decoding (400 beyond; docs/limits.md)")
    p.add_argument("--media-queue", type=SLOTS, default=32,
                   help="media jobs waiting beyond --media-workers (503 beyond)")
    p.add_argument("--voice-workers", type=COUNT, default=1,
                   help="threads encoding voice samples (saved voices, speech references; S2)")
    p.add_argument("--voice-queue", type=SLOTS, default=4,
                   help="voice jobs waiting beyond --voice-workers (503 beyond)")
    p.add_argument("--voice-alias", metavar="NAME=VOICE", action="append", default=[], type=_voice_alias,
                   help="answer voice NAME with the model's VOICE (repeatable; replaces that name's entry of the "
                        "default table mapping OpenAI's voice names, e.g. alloy=chelsie)")
    p.add_argument("--allowed-local-media-path", metavar="DIR", type=Path,
                   help="let requests name local media files (ref_audio, references[].audio_path, image/audio/"
                        "video_url parts) whose real path lies inside DIR; off by default")
    p.add_argument("--text-hook", metavar="MODULE:FUNCTION",
                   help="a text hook plug-in: FUNCTION(request_json) -> hook(delta, final) -> text to voice")
    p.add_argument("--first-chunk-frames", type=first_chunk_arg, default=None, metavar="{auto,1-25}",
                   help="codec frames in a reply's first audio chunk; auto (default): 1 while engine steps are fast, "
                        "more when a step outlasts the first frame's audio, so playback does not stall after it")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: every step runs eagerly (graphs are captured at start-up on a GPU otherwise)")
    p.add_argument("--speculative-config", type=speculative_arg, default=None, metavar="JSON",
                   help='Thinker speculative decoding (off by default), vLLM\'s keys: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}\' '
                        '(prompt lookup) or \'{"method": "dflash", "model": DIR, "num_speculative_tokens": 7}\' '
                        '(a DFlash draft in z-lab\'s layout; "model": "demo" is the demo model\'s); optional '
                        '"disable_by_batch_size", default 8: no drafts above that many decoding requests')
    p.add_argument("--scheduling", choices=["slack", "fifo"], default="slack",
                   help="slack (default): streaming-aware (see the README): the stream closest to a stall goes first, "
                        "streams --stream-lead-s ahead of their listener yield, a prefill chunk fits the smallest "
                        "slack, and a new request waits until the engine can make its audio in time. fifo: every "
                        "running request steps, in arrival order, and nothing waits for capacity")
    p.add_argument("--stream-lead-s", type=POSITIVE, default=1.0,
                   help="slack: seconds of audio a stream keeps ready ahead of its listener's playback; beyond it the "
                        "stream yields its steps to others")
    p.add_argument("--allowed-origins", nargs="*", default=[], metavar="ORIGIN",
                   help="web origins (scheme://host:port) besides the server's own that may open /v1/realtime")
    p.add_argument("--realtime-idle-timeout-s", type=POSITIVE, default=300.0,
                   help="close a realtime session after this long without a client event")
    p.add_argument("--duplex-idle-timeout-s", type=POSITIVE, default=10.0,
                   help="close an /api/chat session (a full-duplex model) after this long without a client message")
    p.add_argument("--duplex-max-session-s", type=POSITIVE, default=None,
                   help="the most seconds of input audio one full-duplex session may take (/api/chat and "
                        "/v1/realtime); it is then closed with 1000 (default and most: the model's own maximum, "
                        "3600 s for Moshi)")
    p.add_argument("--realtime-max-buffer-s", type=POSITIVE, default=300.0,
                   help="the most audio one realtime user turn may hold")
    p.add_argument("--realtime-audio-window-s", type=ranged(float, 0.08, 8), default=1.0,
                   help="AuT attention window of realtime input, in seconds (0.08-8; sessions may change it)")
    p.add_argument("--max-realtime-sessions", type=COUNT, default=None,
                   help="realtime sessions at once (1013 beyond; default --max-running); an open turn counts only "
                        "here, its response against --max-running like any request")
    p.add_argument("--realtime-send-timeout-s", type=POSITIVE, default=10.0,
                   help="close a realtime or /api/chat session (1008) whose client leaves over "
                        "--realtime-send-buffer-kb unread this long")
    p.add_argument("--realtime-send-buffer-kb", type=COUNT, default=1024,
                   help="what a realtime or /api/chat session's socket may hold unsent (and the kernel's send "
                        "buffer as much) before its sends wait for the client to read")
    p.add_argument("--realtime-workers", type=COUNT, default=2,
                   help="threads for realtime sessions' audio input (resampling, turn detection, AuT), shared fairly: "
                        "one job of at most 1 s of audio per session at a time")
    p.add_argument("--realtime-turn-idle-s", type=POSITIVE, default=30.0,
                   help="an open realtime turn with no audio for this long gives back its KV pages (recomputed when "
                        "the user speaks again)")
    p.add_argument("--realtime-turn-kv-share", type=ranged(float, 0.0, 1.0), default=0.5,
                   help="the most of the Thinker's KV pages that open realtime turns hold together (0-1); beyond it "
                        "a turn is computed when its response starts (an error event says so: turn_kv_budget)")
    p.add_argument("--drain-timeout", type=ranged(float, 0, 86400), default=30.0,
                   help="seconds SIGTERM or SIGINT waits for running requests and realtime responses to finish, and "
                        "/api/chat sessions to end (new and waiting ones get 503 draining meanwhile; what still runs "
                        "then ends with a draining error, an /api/chat session with close 1012) before the server "
                        "exits, at most 14 s later; a second signal exits now")
    p.add_argument("--replicas", type=COUNT, default=None, metavar="N",
                   help="N >= 2 engine replicas behind a router, on Ray Serve (pip install 'omnivox[ray]'): a local Ray "
                        "instance, or the cluster at --ray-address. Realtime and /api/chat sessions stay on one "
                        "replica; chat and speech go to the replica that holds their prompt prefix unless it is much "
                        "busier. Ray's "
                        "proxy takes --host, --port and --keep-alive-timeout; it has no --header-timeout (refused) "
                        "and caps a WebSocket message at 16 MiB; --drain-timeout is each replica's graceful shutdown")
    p.add_argument("--ray-address", default=os.environ.get("RAY_ADDRESS") or None, metavar="ADDRESS",
                   help="with --replicas: join this Ray cluster, with its own settings (default $RAY_ADDRESS; none: "
                        "start a local one, with token authentication on)")
    p.add_argument("--ray-insecure", action="store_true",
                   help="with --replicas and no --ray-address: turn off the token authentication of the Ray instance "
                        "omnivox starts (anyone reaching its ports can then run code as this user)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="server log verbosity")


def _voice_alias(text: str) -> tuple[str, str]:
    from omnivox.api.dialects import parse_voice_alias
    return parse_voice_alias(text)


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
    live = f"duplex (moshi's protocol): {ws}/api/chat" if isinstance(model, DuplexModel) else \
        f"realtime: {ws}/v1/realtime, playground: {url}/playground"
    lines.append(f"serving on {url} (OpenAI API: {url}/v1, {live}, metrics: {url}/metrics)")
    print("\n".join(lines), flush=True)
