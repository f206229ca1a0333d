"""The protocol client (`moshi_protocol_client.py`) against moshi 0.2.13's OWN server code
(`moshi/server.py`'s `ServerState.handle_chat` on aiohttp) run in this process on the moshi demo
checkpoint: the client's reading of the protocol is moshi's. The same client drives
`omnivox serve --model moshi-demo` in test_moshi_chat.py (one client, two servers).

moshi's server module runs its `main()` at import, so its source is executed without that last
statement; its warm-up (which calls `torch.cuda.synchronize()`) is skipped: the session resets
every streaming state before the handshake anyway."""
from __future__ import annotations

import ast
import asyncio
import json
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from omnivox.audio.io import load_audio
from omnivox.models.moshi.demo import moshi_demo_path
from omnivox.models.moshi.tokenizer import MoshiTokenizer

pytest.importorskip("moshi")
pytest.importorskip("aiohttp")
pytest.importorskip("sphn")

from moshi_protocol_client import F, chat  # noqa: E402

SPEECH = load_audio(Path(__file__).resolve().parents[1] / "media" / "question_24k.wav", target_sr=24000)[:12 * F]


def moshi_server_module() -> types.ModuleType:
    """moshi/server.py without its trailing `with torch.no_grad(): main()`."""
    import moshi
    path = Path(moshi.__file__).parent / "server.py"
    tree = ast.parse(path.read_text())
    assert isinstance(tree.body[-1], ast.With), "moshi's server.py no longer ends by running main()"
    tree.body = tree.body[:-1]
    module = types.ModuleType("moshi_server_code")
    module.__file__, module.__package__ = str(path), "moshi"
    sys.modules[module.__name__] = module  # its dataclass looks its module up
    exec(compile(tree, str(path), "exec"), module.__dict__)
    return module


@pytest.fixture(scope="module")
def moshi_server():
    """(url, folder): moshi's handle_chat on 127.0.0.1, its event loop in a thread."""
    from aiohttp import web
    from moshi.models import loaders
    from moshi.utils.compile import no_compile

    folder = moshi_demo_path()  # the one `omnivox serve --model moshi-demo` loads (this session's OMNIVOX_CACHE)
    raw = json.loads((folder / "config.json").read_text())
    info = loaders.CheckpointInfo.from_hf_repo(
        None, moshi_weights=folder / raw["moshi_name"], mimi_weights=folder / raw["mimi_name"],
        tokenizer=folder / raw["tokenizer_name"], config_path=folder / "config.json",
        mimi_config_path=folder / raw["mimi_config_name"])
    server = moshi_server_module()
    mimi, lm = info.get_mimi(device="cpu"), info.get_moshi(device="cpu", dtype=torch.float32)
    loop, started = asyncio.new_event_loop(), threading.Event()
    holder: dict = {}

    def run() -> None:
        torch.set_grad_enabled(False)  # moshi's main runs under torch.no_grad()
        asyncio.set_event_loop(loop)
        state = server.ServerState(info.model_type, mimi, info.get_text_tokenizer(), lm, 1.0, "cpu",
                                   **{**info.lm_gen_config, "use_sampling": False})
        app = web.Application()
        app.router.add_get("/api/chat", state.handle_chat)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        holder["port"], holder["runner"] = site._server.sockets[0].getsockname()[1], runner
        started.set()
        with no_compile():  # moshi would torch.compile its sampling on first use (a minute on CPU)
            loop.run_forever()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model's frame is many small ops: one thread runs them far faster on a busy CPU
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(60), "moshi's server did not start"
    yield f"ws://127.0.0.1:{holder['port']}/api/chat", folder
    asyncio.run_coroutine_threadsafe(holder["runner"].cleanup(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(30)
    torch.set_num_threads(threads)


def test_client_against_moshi_own_server(moshi_server):
    url, folder = moshi_server
    result = asyncio.run(chat(url, SPEECH))
    frames = len(SPEECH) // F
    assert result.first == b"\x00"  # the handshake comes first
    audio_kinds = [k for k in result.kinds if k == 1]
    assert len(audio_kinds) == frames and set(result.kinds) <= {1, 2}  # one frame out per frame in but the first
    assert all(len(a) == F for a in result.audio)  # each 80 ms message decodes to one frame
    assert all(n >= 1 for n in result.text_after)  # a frame's text follows its audio
    tokenizer = MoshiTokenizer(folder / "tokenizer.model")
    pieces = {tokenizer.piece(t) for t in range(tokenizer.sp.GetPieceSize())} - {""}
    assert result.text and set(result.text) <= pieces  # pieces as the tokenizer renders them ("▁" as a space)
    assert np.abs(result.pcm).max() > 0
