"""The tests' one TLS context (tests/tls_context.py): what httpx's transports make for default verification is one
context, verifying certificates; anything else they ask for is made as httpx makes it."""

from __future__ import annotations

import ssl

import httpx._transports.default as transports


def test_default_verification_gets_one_verifying_context_and_anything_else_its_own() -> None:
    make = transports.create_ssl_context  # type: ignore[attr-defined]
    shared = make(verify=True, cert=None, trust_env=True)
    assert make() is shared and shared.verify_mode is ssl.CERT_REQUIRED and shared.check_hostname
    unverified = make(verify=False)
    assert unverified is not shared and unverified.verify_mode is ssl.CERT_NONE
    assert make(verify=False) is not unverified
