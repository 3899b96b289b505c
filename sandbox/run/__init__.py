"""A run: `trajproxy run` and its parts, the Runner that plays one episode, AgentEnv, policies, reports."""
