"""Tools that make checkpoints, apart from the serving packages: the tiny random checkpoints of
the tests and of the bench's models (``tools.tiny``, one entry per family in
``tools.tiny_registry``) and the training of the shipped default model (``tools.training``).
Nothing in ``workers/``, ``kernels/`` or ``configs/`` imports them; in ``cluster/`` only the
bench does, for its random models (``tests/test_layout.py``)."""
