"""Harnesses of finished investigations (``python -m tests.lab.<name>``), kept to rerun
them; their findings are in BENCHMARKS.md. The product's benchmarks are ``hybridserve bench``
(``cluster/bench/``), which imports nothing from here."""
