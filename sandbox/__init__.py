"""Sandboxes: one container per episode, in which an unmodified agent can reach trajproxy and nothing else."""
