"""The HTTP edge: the route table (`proxy.http.routes`) and the handlers it names, for agents and trainers; the one
place that imports FastAPI and Starlette."""
