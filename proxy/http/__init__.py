"""The HTTP edge: FastAPI routes for agents and trainers; the one place that imports FastAPI and Starlette."""
