"""omnivox/api holds no tensor and imports no torch (issue 37): audio crosses into the engine as host
arrays (a listening request's encoder stage does the model work), so nothing in the API layer
imports torch, and a realtime session that holds 20 turns of audio keeps no tensor reachable from
its objects (the turns' host audio and their rows on the host only); /metrics shows the host bytes
it holds.

Why an import scan and not `'torch' not in sys.modules`: omnivox.api's modules import the audio
front end (omnivox/audio: the causal log-mel uses torch's FFT on the CPU) and the VAD model, which
stay torch code on the host; the claim checked here is the API's own: no module of omnivox/api
imports torch, and no session object keeps a tensor."""
from __future__ import annotations

import ast
import asyncio
import gc
import types
from pathlib import Path

import numpy as np

import omnivox.api
from realtime_helpers import MODEL, b64, events_until, live_server, speech_pcm, wait_for

API = Path(omnivox.api.__file__).parent


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def test_no_module_of_omnivox_api_imports_torch():
    files = sorted(API.rglob("*.py"))
    assert len(files) > 20
    offenders = [str(f.relative_to(API)) for f in files if "torch" in _imports(f)]
    assert offenders == []


def _tensors_reachable(roots: list, stop: set[int]) -> list:
    """Every torch.Tensor reachable from `roots` through gc.get_referents, with the path to it; not
    past `stop` (the shared model, the event loop) nor through code (modules, functions, classes:
    their globals reach every module)."""
    import torch
    skip = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, str, bytes, int, float)
    seen, found, todo = set(stop), [], [(r, type(r).__name__) for r in roots]
    while todo:
        obj, path = todo.pop()
        if id(obj) in seen or isinstance(obj, skip):
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            found.append(path)
            continue
        todo.extend((o, f"{path} > {type(o).__name__}") for o in gc.get_referents(obj))
    return found


def test_a_session_holding_20_turns_keeps_no_tensor(demo_omni):
    """20 spoken user items (conversation.item.create with audio) and a response that reads them
    all: the session's conversation, input audio and open prompt hold host arrays only, and every
    item's rows are on the host once the encoder stage has computed them."""
    pcm = speech_pcm(lead_ms=0, tail_ms=0)[:24000 // 2]  # half a second each

    async def session(url, hub):
        from openai import AsyncOpenAI
        client = AsyncOpenAI(base_url=url + "/v1", api_key="none")
        async with client.realtime.connect(model=MODEL) as conn:
            await conn.session.update(session={"type": "realtime", "turn_detection": None,
                                               "max_output_tokens": 2, "output_modalities": ["text"]})
            await events_until(conn, "session.updated")
            for _ in range(20):
                await conn.conversation.item.create(item={"type": "message", "role": "user", "content": [
                    {"type": "input_audio", "audio": b64(pcm)}]})
                await events_until(conn, "conversation.item.done")
            await conn.response.create()
            await events_until(conn, "response.done")
            (live,) = hub.sessions.values()
            wait_for(lambda: live.responses.run is None)
            import urllib.request
            scrape = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
            gauge = f'omnivox_realtime_session_host_bytes{{session="{live.id}"}} '
            (line,) = [ln for ln in scrape.splitlines() if ln.startswith(gauge)]
            rows = sum(it.turn.rows.nbytes for it in live.conversation.items if it.role == "user")
            assert float(line.split()[-1]) == live.host_bytes >= rows > 0  # /metrics counts what it holds
            return live, _tensors_reachable([live.conversation, live.audio, live.pending, live.turn],
                                            stop={id(hub.host), id(hub.vad_model), id(live), id(live.model),
                                                  id(live.loop)})

    with live_server(demo_omni) as (url, app):
        live, found = asyncio.run(session(url, app.state.realtime))
    items = [it for it in live.conversation.items if it.role == "user"]
    assert len(items) == 20 and found == []
    for it in items:  # every row encoded once, kept on the host; the pieces dropped for them
        assert it.turn.complete and it.turn.rows.n == it.n_rows > 0
        assert isinstance(it.turn.rows.rows(), np.ndarray)
