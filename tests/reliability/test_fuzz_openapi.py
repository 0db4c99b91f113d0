"""Schemathesis against our own ``/openapi.json`` on a deployed app.

Every operation of the served document is fuzzed through Ray Serve's HTTP proxy with
``N`` derandomized examples per operation (the document's examples and schema-valid
bodies, then schema-invalid ones for the operations that take a body), and every response must pass
``not_a_server_error``, ``status_code_conformance`` and ``response_schema_conformance``.
The engine's context is 32 tokens (the checkpoint's ``max_position_embeddings``), so no generated request can
ask for long generations and the run stays bounded. Operations without any input
(``GET /v1/models`` ...) have a single distinct example; hypothesis stops there.
"""

from __future__ import annotations

import collections
import time
from typing import Any

import httpx
import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
KEY = "sk-fuzz"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_MODEL_LEN = 32


@pytest.fixture(scope="module")
def short_context_dir(tmp_path_factory):
    """A tiny checkpoint whose context is ``MAX_MODEL_LEN`` tokens (the pools stay large,
    so ``n`` = 16 choices run side by side)."""
    from tools.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(
        "qwen3_next", tmp_path_factory.mktemp("fuzz_model"), seed=0, max_position_embeddings=MAX_MODEL_LEN
    )


@pytest.fixture(scope="module")
def app(deployed, short_context_dir):
    return deployed(
        "fuzz", str(short_context_dir), args={"model_name": "tiny-fuzz"}, overrides={"server": {"api_key": KEY}}
    )


@pytest.fixture(scope="module")
def schema(app) -> Any:
    import schemathesis

    assert httpx.get(f"{app.base_url}/openapi.json").status_code == 401  # the key guards it
    r = httpx.get(f"{app.base_url}/openapi.json", headers=AUTH, timeout=60)
    r.raise_for_status()
    models = httpx.get(f"{app.openai_base}/models", headers=AUTH, timeout=60).json()
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    return schemathesis.openapi.from_dict(r.json())


def fuzz_operation(app, operation: Any, mode: Any, max_examples: int) -> collections.Counter[str]:
    """Run ``max_examples`` derandomized cases of one operation; statuses counted.

    A failed check raises (hypothesis then shrinks it and reports the smallest case).
    """
    from hypothesis import HealthCheck, Phase, given, settings
    from schemathesis import checks
    from schemathesis.generation import GenerationMode
    from schemathesis.generation.hypothesis.builder import add_examples

    statuses: collections.Counter[str] = collections.Counter()
    wanted = [checks.not_a_server_error, checks.status_code_conformance, checks.response_schema_conformance]

    @settings(
        max_examples=max_examples,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode, headers=AUTH))
    def run(case: Any) -> None:
        response = case.call(base_url=app.base_url, headers=AUTH, timeout=120)
        sse = any(v.startswith("text/event-stream") for v in response.headers.get("content-type", []))
        statuses[f"{response.status_code}{' sse' if sse else ''}"] += 1
        case.validate_response(response, checks=wanted, headers=AUTH)

    if mode == GenerationMode.POSITIVE:  # the document's own examples run first
        run = add_examples(run, operation, fill_missing=False)
    run()
    return statuses


def _streams(op: Any) -> bool:
    """The operation's success may be an event stream (the generate routes)."""
    ok = op.definition.raw.get("responses", {}).get("200", {})
    return "text/event-stream" in ok.get("content", {})


def fuzz_all(app, schema: Any, max_examples: int) -> None:
    from schemathesis.generation import GenerationMode

    report = []
    for result in schema.get_all_operations():
        op = result.ok()
        modes = [GenerationMode.POSITIVE]
        if op.method.upper() == "POST" and op.body:
            modes.append(GenerationMode.NEGATIVE)
        for mode in modes:
            start = time.monotonic()
            statuses = fuzz_operation(app, op, mode, max_examples)
            report.append(
                f"{op.label} {mode.value}: {sum(statuses.values())} requests, "
                f"statuses {dict(sorted(statuses.items()))}, {time.monotonic() - start:.1f}s"
            )
            print(report[-1], flush=True)
            assert not any(s.startswith("5") for s in statuses), report[-1]
            if op.body and mode == GenerationMode.POSITIVE:
                assert sum(statuses.values()) >= max_examples, report[-1]
                assert statuses["200"] > 0, report[-1]  # past validation
                assert statuses["200 sse"] > 0 or not _streams(op), report[-1]
    print("\nfuzz:", *report, sep="\n  ")
    assert httpx.get(f"{app.base_url}/health", timeout=30).status_code == 200


def test_fuzz_openapi_short(app, schema):
    fuzz_all(app, schema, max_examples=50)


@pytest.mark.slow
def test_fuzz_openapi_long(app, schema):
    fuzz_all(app, schema, max_examples=500)
