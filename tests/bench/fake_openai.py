"""A tiny fake OpenAI streaming server (Starlette + uvicorn on 127.0.0.1, in a thread).

It answers ``/v1/models``, ``/v1/completions`` and ``/v1/chat/completions`` with SSE:
``output_tokens = max_tokens`` chunks of one token each, the first after ``first_delay_s``
and the rest ``token_delay_s`` apart, then a usage chunk (when asked) and ``[DONE]``.
``cached_tokens`` is half the prompt length. It records every request body and the most
requests it held at once, so tests can check what the client sent.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route


class FakeOpenAI:
    def __init__(self, first_delay_s: float = 0.05, token_delay_s: float = 0.01) -> None:
        self.first_delay_s = first_delay_s
        self.token_delay_s = token_delay_s
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.peak_in_flight = 0
        self.fail_prompts: set[str] = set()  # text prompts answered with HTTP 400
        app = Starlette(
            routes=[
                Route("/v1/models", self.models),
                Route("/v1/completions", self.complete, methods=["POST"]),
                Route("/v1/chat/completions", self.complete, methods=["POST"]),
            ]
        )
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self._server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off")
        )
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FakeOpenAI:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=10)

    async def models(self, request: Request) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": "fake", "object": "model", "root": "/nowhere"}]})

    async def complete(self, request: Request) -> Any:
        body = await request.json()
        self.bodies.append(body)
        chat = "messages" in body
        prompt = body["messages"] if chat else body["prompt"]
        if isinstance(prompt, str) and prompt in self.fail_prompts:
            return JSONResponse({"error": {"message": "bad", "type": "invalid_request_error"}}, status_code=400)
        prompt_len = (
            len(prompt)
            if isinstance(prompt, list) and not chat
            else sum(len(str(m.get("content", ""))) for m in prompt)
            if chat
            else len(prompt)
        )
        n = int(body.get("max_tokens") or body.get("max_completion_tokens") or 16)
        usage = bool((body.get("stream_options") or {}).get("include_usage"))

        async def events():
            self.in_flight += 1
            self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
            try:
                if chat:  # an empty role delta first: not a token
                    yield _sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                await asyncio.sleep(self.first_delay_s)
                for i in range(n):
                    if i:
                        await asyncio.sleep(self.token_delay_s)
                    tok = f"t{i} "
                    choice = (
                        {"index": 0, "delta": {"content": tok}}
                        if chat
                        else {"index": 0, "text": tok, "token_ids": [100 + i]}
                    )
                    yield _sse({"choices": [choice], "usage": None})
                if usage:
                    yield _sse(
                        {
                            "choices": [],
                            "usage": {
                                "prompt_tokens": prompt_len,
                                "completion_tokens": n,
                                "total_tokens": prompt_len + n,
                                "prompt_tokens_details": {"cached_tokens": prompt_len // 2},
                            },
                        }
                    )
                yield "data: [DONE]\n\n"
            finally:
                self.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")


def _sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj)}\n\n"
