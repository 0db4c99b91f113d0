"""The Serve settings of ``cluster.serve_env`` reach the replicas: their code runs on the
replica's own event loop, with no user-code thread (one thread hop less per request and
per stream item)."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]


def test_replica_code_runs_on_the_replicas_own_loop(serve_session):
    import threading

    from ray import serve

    @serve.deployment(name="where")
    class Where:
        async def __call__(self) -> dict[str, object]:
            from ray.serve._private import constants

            return {
                "separate_thread": constants.RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD,
                "separate_router_loop": constants.RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP,
                "user_code_threads": [t.name for t in threading.enumerate() if "user_code_event_loop" in t.name],
            }

    handle = serve.run(Where.bind(), name="serve-env", route_prefix="/serve-env")
    try:
        got = handle.remote().result(timeout_s=60)
    finally:
        serve.delete("serve-env")
    assert got == {"separate_thread": False, "separate_router_loop": False, "user_code_threads": []}
