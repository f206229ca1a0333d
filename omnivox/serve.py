"""`omnivox serve`: load one model, start the engine, serve the OpenAI-compatible API."""
from __future__ import annotations

import argparse
import errno
import socket

from omnivox.errors import OmnivoxError


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--served-model-name", help="the model id clients send (default: the folder's name; "
                                                "omnivox-demo-qwen3-omni for the demo)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` on /v1 routes")
    p.add_argument("--max-running", type=int, default=32, help="requests running at once")
    p.add_argument("--max-queue", type=int, default=256,
                   help="requests waiting beyond --max-running; more get HTTP 503")
    p.add_argument("--kv-cache-mb", type=float, default=256.0, help="KV cache memory (Thinker + Talker)")
    p.add_argument("--max-body-mb", type=float, default=32.0, help="largest request body accepted (413 beyond)")
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


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from omnivox.api.hooks import load_hook_factory
    from omnivox.api.server import create_app
    from omnivox.demo import DEMO_NAME, NOISE_NOTE
    from omnivox.engine.config import EngineConfig
    from omnivox.omni import Omni

    for name in ("max_running", "max_queue"):
        if getattr(args, name) < (1 if name == "max_running" else 0):
            raise OmnivoxError(f"--{name.replace('_', '-')} must be {'>= 1' if name == 'max_running' else '>= 0'}")
    if args.max_body_mb <= 0:
        raise OmnivoxError("--max-body-mb must be positive")
    hook_factory = load_hook_factory(args.text_hook) if args.text_hook else None
    sock = _bind(args.host, args.port)  # fail fast, before loading weights
    cfg = EngineConfig(max_running=args.max_running, max_queue=args.max_queue, kv_cache_mb=args.kv_cache_mb)
    omni = Omni(model=args.model, dtype=args.dtype, device=args.device, engine_config=cfg)
    name = args.served_model_name or (DEMO_NAME if omni.is_demo else omni.folder.resolve().name)
    app = create_app(omni, name, api_key=args.api_key, hook_factory=hook_factory,
                     max_body_bytes=int(args.max_body_mb * 2**20))
    _announce(omni, name, args, sock, NOISE_NOTE if omni.is_demo else None)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=args.log_level in ("debug", "info"),
                            timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _announce(omni, name: str, args: argparse.Namespace, sock: socket.socket, note: str | None) -> None:
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    what = "the built-in demo model" if omni.is_demo else "model"
    from omnivox.models.qwen3_omni.stages.graph import split_kv_budget

    thinker_pages, talker_pages = split_kv_budget(omni.model, omni.engine_config)
    kv = f"thinker {thinker_pages} pages" + (f", talker {talker_pages} pages" if talker_pages else "")
    lines = [
        f"omnivox serve: {what} {omni.folder} as {name!r}",
        f"  voices: {', '.join(omni.speakers) or '(none: text only)'}; context "
        f"{omni.cfg.thinker.text.max_position_embeddings} tokens; {args.dtype} on {args.device}",
        f"  engine: max_running {args.max_running}, max_queue {args.max_queue}; KV cache: {kv}",
        f"  api key: {'required' if args.api_key else 'none'}; text hook: {args.text_hook or 'none'}",
    ]
    if note:
        lines.append(f"  {note}")
    lines.append(f"listening on {url} (OpenAI API: {url}/v1, metrics: {url}/metrics)")
    print("\n".join(lines), flush=True)
