"""In-process HTTP apps (no Ray) over a real tiny engine: ``local_app(model_dir, ...)``.

An ``App`` is the FastAPI app of ``http_api`` over an ``OpenAIServer`` and a
``LocalEngineClient`` (one ``ReplicaCore`` in this process, its own event loop); ``call``
sends one request through httpx's ASGI transport. Apps live for the test module.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from cluster.api.http_api import make_api
from cluster.api.openai_server import OpenAIServer, ServerSettings
from cluster.serving.engine_client import LocalEngineClient
from cluster.serving.replica_core import ReplicaCore
from configs.schema import load_config

SMALL = {"device": "cpu", "dtype": "float32", "cache": {"page_size": 4, "max_kv_tokens": 2048, "max_mamba_slots": 32}}


@dataclass
class App:
    loop: asyncio.AbstractEventLoop
    api: Any
    core: ReplicaCore
    server: OpenAIServer
    headers: dict[str, str]

    def call(self, method: str, path: str, headers: dict[str, str] | None = None, **kwargs: Any) -> httpx.Response:
        async def go() -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=self.api), base_url="http://t") as c:
                return await c.request(method, path, headers=self.headers if headers is None else headers, **kwargs)

        return self.loop.run_until_complete(go())

    def with_settings(self, **changes: Any) -> App:
        """The same engine behind a second server with other settings."""
        import dataclasses

        server = OpenAIServer(
            self.server.client, self.server.tokenizer, dataclasses.replace(self.server.settings, **changes)
        )
        return App(self.loop, make_api(server), self.core, server, self.headers)


def sse_objects(text: str) -> list:
    events = [e for e in text.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


@pytest.fixture(scope="module")
def local_app() -> Iterator[Callable[..., App]]:
    """``local_app(model_dir, name="tiny", api_key=None, stream_interval_s=0.0, **config_overrides)``
    (``stream_interval_s``: the replica's stream batching, ``ReplicaCore``)."""
    made: list[App] = []

    def make(
        model_dir: Any, name: str = "tiny", api_key: str | None = None, stream_interval_s: float = 0.0, **overrides: Any
    ) -> App:
        loop = asyncio.new_event_loop()
        config = load_config(overrides={**SMALL, "model": str(model_dir), "server": {"api_key": api_key}, **overrides})
        core = loop.run_until_complete(ReplicaCore.create(config, stream_interval_s))
        server = OpenAIServer(
            LocalEngineClient(core, name), core.loop.engine.tokenizer, ServerSettings.from_config(config, name)
        )
        app = App(loop, make_api(server), core, server, {"Authorization": f"Bearer {api_key}"} if api_key else {})
        made.append(app)
        return app

    yield make
    for app in made:
        app.loop.run_until_complete(app.core.shutdown())
        app.loop.close()
