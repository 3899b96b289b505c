"""What the tests and the benchmarks both use: a real vLLM serving the tiny model and what its own tokenizer says, the
example task, each preset's scripted answers, agents in every dialect, a local Ray cluster, a Postgres schema of one's
own. Plain helpers, no fixtures: tests/conftest.py wires them in; no benchmark imports a test module."""
