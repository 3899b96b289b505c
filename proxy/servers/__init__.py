"""The servers in front of the app (uvicorn's, granian's), their sockets and log redaction, and the proxy embedded in
a Python program."""
