"""Agent-facing dialects: parse a wire request into the normalised chat turn, render replies and errors back."""
