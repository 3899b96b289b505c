"""Agents as data: manifests (the presets are agents/*.toml), the bundles they install, and their injection."""
