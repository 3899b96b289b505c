"""trajproxy: an OpenAI-compatible proxy that turns any unmodified LLM agent into an RL environment."""

__version__ = "0.1.0"
