"""Engine replicas: the Serve deployment (``replica``) over a Ray-free core
(``replica_core``, ``engine_loop``), TP worker actors (``tp``), the ingress <-> replica
messages (``messages``) and the ``EngineClient`` protocol the HTTP layer calls
(``engine_client``)."""
