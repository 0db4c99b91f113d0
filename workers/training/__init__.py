"""Training the shipped default model (``python -m workers.training.train_default``)."""
