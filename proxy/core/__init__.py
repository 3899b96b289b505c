"""The domain core: episodes, turns, parking, leases and rewards; no web framework, ORM or SDK imports."""
