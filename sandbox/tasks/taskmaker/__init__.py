"""Tasks from a repository: `trajproxy tasks make` turns a Python project's own tests into Harbor tasks."""
