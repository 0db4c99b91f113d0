"""Training the shipped default model (``python -m tools.training.train_default``)."""
