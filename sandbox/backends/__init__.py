"""Sandbox backends: the interface a run uses, and what implements it (Docker here, Docker on Ray nodes)."""
