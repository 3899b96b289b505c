"""One TLS context for every HTTP client the tests make. httpx makes each client's anew (OpenSSL 3 reads certifi's
CA bundle: about 30 ms of CPU), and the tests make thousands, every SDK client and every `httpx.get`, all to reach
servers on the loopback over plain HTTP: a third of a trainer API test's CPU went to it. A client that asks for
httpx's default verification (`verify=True`, no client certificate) gets the one context, made on first use; any
other asks httpx as before. Nothing of trajproxy's is changed: its servers and commands run in processes of their
own, or make their clients once."""

from __future__ import annotations

import ssl
from typing import Any

import httpx
import httpx._transports.default as transports  # where HTTPTransport and AsyncHTTPTransport look it up

_made = httpx.create_ssl_context
_shared: dict[bool, ssl.SSLContext] = {}  # by trust_env (which chooses SSL_CERT_FILE or certifi's bundle)


def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
    if verify is not True or cert is not None:
        return _made(verify=verify, cert=cert, trust_env=trust_env)
    if trust_env not in _shared:
        _shared[trust_env] = _made(verify=True, cert=None, trust_env=trust_env)
    return _shared[trust_env]


def pytest_configure() -> None:
    setattr(transports, "create_ssl_context", create_ssl_context)  # noqa: B010 (not exported: mypy would refuse)
