"""Every flag of `omnivox serve` (`add_serve_args`; its replicas parse the same: `replicas/launch.py`),
kept apart from `serve.py`, which runs what they say."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from omnivox.args import COUNT, PORT, POSITIVE, SLOTS, add_gpu_memory_arg, add_quantization_args, first_chunk_arg, kv_budget, placement, ranged, speculative_arg
from omnivox.models.registry import FAMILIES


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
                   help="the most seconds of input audio one full-duplex session may take; it is then closed "
                        "(/api/chat: 1000; /v1/realtime: an error event session_expired, then 1001, as OpenAI's) "
                        "(default and most: the model's own maximum, 3600 s for Moshi)")
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
