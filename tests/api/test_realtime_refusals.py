"""A refused `/v1/realtime` connection tells the client why: the official `openai` client's exception
holds the reason for each refusal (API key, web origin, Host, model, capacity), and the server logs
no ERROR for it (an upgrade refused over HTTP showed the client a bare status, and uvicorn logged
"ASGI callable returned without completing handshake")."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch
import websockets

from omnivox import Omni
from omnivox.engine.config import EngineConfig
from realtime_helpers import MODEL, live_server, wait_for

KEY = "sk-refusals-test"


@pytest.fixture(scope="module")
def omni(demo_cache):
    torch.set_num_threads(1)
    o = Omni(model=demo_cache[1], progress=False, engine_config=EngineConfig(max_running=1, max_queue=1))
    yield o
    o.close()


async def official(url: str, key: str = KEY, model: str = MODEL, **options) -> str:
    """The first event's type, through the official client."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
    async with client.realtime.connect(model=model, websocket_connection_options=options) as conn:
        return (await asyncio.wait_for(conn.recv(), 30)).type


def refusal(url: str, **kw) -> str:
    with pytest.raises(Exception) as refused:
        asyncio.run(official(url, **kw))
    return str(refused.value)


def test_refusals_reach_the_official_client_with_their_reason(omni, capfd):
    with live_server(omni, api_key=KEY) as (url, app):
        port = int(url.rsplit(":", 1)[1])
        assert asyncio.run(official(url)) == "session.created"
        assert "4401" in (why := refusal(url, key="sk-wrong")) and "needs its API key" in why, why
        assert "4403" in (why := refusal(url, origin="http://evil.example")) and "'http://evil.example'" in why, why
        rebound = f"http://rebound.example:{port}"  # a name that is not the bind address (DNS rebinding)
        why = refusal(rebound, host="127.0.0.1", port=port)
        assert "4400" in why and f"Host 'rebound.example:{port}' is not served here" in why, why
        assert "4404" in (why := refusal(url, model="gpt-realtime")) and "'gpt-realtime' is not served" in why, why

        async def full():  # --max-realtime-sessions (max_running: 1) sessions held open, then one more
            held = [await websockets.connect(url.replace("http", "ws", 1) + "/v1/realtime",
                                             additional_headers={"Authorization": f"Bearer {KEY}"}) for _ in range(1)]
            for ws in held:
                assert json.loads(await ws.recv())["type"] == "session.created"
            try:
                with pytest.raises(Exception) as refused:
                    await official(url)
                return str(refused.value)
            finally:
                for ws in held:
                    await ws.close()
        wait_for(lambda: not app.state.realtime.sessions, what="the first session to end")
        why = asyncio.run(full())
        assert "1013" in why and "server busy" in why, why
        refused = app.state.realtime.metrics.refused.values
        assert {dict(k)["reason"]: v for k, v in refused.items()} == {
            "invalid_api_key": 1, "cross_origin_refused": 1, "invalid_host": 1, "model_not_found": 1,
            "server_overloaded": 1}
    log = capfd.readouterr().err  # uvicorn's log (its handler writes to the process's stderr)
    assert not [line for line in log.splitlines() if line.startswith("ERROR")], log
