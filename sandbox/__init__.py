"""Sandboxes: one container per episode (arrives with the sandbox issue)."""
