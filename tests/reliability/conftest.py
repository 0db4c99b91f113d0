"""Reliability and security tests: apps on the session's one Ray cluster.

``deployed`` and the helpers come from ``tests/e2e/conftest.py`` (one Ray + Serve per
test session, apps per module under their own route prefix). Long variants are marked
``slow``; each has a short variant that runs in ``make test``.
"""

from __future__ import annotations

from tests.e2e.conftest import FAST_PUBLISH, SMALL_ENGINE, DeployedApp, deploy, deployed, index_actor, wait_until  # noqa: F401
