"""The Ray Serve application and the command line (DESIGN §6), by concern.

A request's path: ``api/`` (the OpenAI HTTP layer: ingress deployment, FastAPI routes,
protocol, request preparation, streaming) -> ``routing/`` (the Serve request router and
its prefix index actor picking a replica) -> ``serving/`` (the engine replica deployment,
its engine loop, TP workers, the ingress <-> replica messages). ``store/`` is the cluster
checkpoint store; ``observability/`` holds the metrics actor, its registry, dashboards and
the local Prometheus; ``bench/`` the benchmark client, the suite and the soak.

Top level, the composition: ``app`` builds the Serve application out of the three,
``serve_local`` runs it on a local Ray cluster, ``cli`` is the ``hybridserve`` command,
``actors`` gets or creates the app's named actors (router index, metrics), ``net`` has
``free_port``.

Import directions (no circles): ``cli``/``app``/``serve_local`` -> ``api`` -> ``serving``
-> ``store``, ``observability``; ``actors`` gets the named actors (router index, metrics,
store) for them and ``routing``; ``bench`` may import any of them and only ``cli`` imports
it. Nothing here is imported by ``workers/``, ``kernels/`` or ``configs/``.
"""
