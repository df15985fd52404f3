"""Training: the train step and loop, optimizer, metrics, checkpoints."""
