"""One TLS context for every HTTP client the tests make. httpx (and httpx2, which the openai SDK uses) makes each
client's anew (OpenSSL 3 reads the CA bundle: about 30 ms of CPU), and the tests make thousands, every SDK client and
every `httpx.get`, all to reach servers on the loopback over plain HTTP: a third of a trainer API test's CPU went to
it. A client that asks for the default verification (`verify=True`, no client certificate) gets its library's one
context, made on first use; any other is made as before. trajproxy's code is unchanged: a server the tests run in
their own process shares the context with them (its clients too reach fakes on the loopback), and a server or
command run as a process of its own makes its own, as a user's would."""

from __future__ import annotations

import importlib
import ssl
from collections.abc import Callable
from typing import Any

LIBRARIES = ("httpx", "httpx2")  # each transport module looks `create_ssl_context` up in its own namespace


def one_context(make: Callable[..., ssl.SSLContext]) -> Callable[..., ssl.SSLContext]:
    shared: dict[bool, ssl.SSLContext] = {}  # by trust_env (which may choose SSL_CERT_FILE's bundle)

    def create_ssl_context(verify: Any = True, cert: Any = None, trust_env: bool = True) -> ssl.SSLContext:
        if verify is not True or cert is not None:
            return make(verify=verify, cert=cert, trust_env=trust_env)
        if trust_env not in shared:
            shared[trust_env] = make(verify=True, cert=None, trust_env=trust_env)
        return shared[trust_env]

    return create_ssl_context


def pytest_configure() -> None:
    for library in LIBRARIES:
        transports = importlib.import_module(f"{library}._transports.default")
        made = importlib.import_module(library).create_ssl_context
        setattr(transports, "create_ssl_context", one_context(made))  # noqa: B010 (a module mypy reads as plain)
