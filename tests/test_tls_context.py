"""The tests' one TLS context (tests/tls_context.py): what httpx's and httpx2's transports make for the default
verification is one context a library, verifying certificates; anything else they ask for is made anew."""

from __future__ import annotations

import importlib
import ssl

import pytest

from tests.tls_context import LIBRARIES


@pytest.mark.parametrize("library", LIBRARIES)
def test_default_verification_gets_one_verifying_context_and_anything_else_its_own(library: str) -> None:
    make = importlib.import_module(f"{library}._transports.default").create_ssl_context
    shared = make(verify=True, cert=None, trust_env=True)
    assert make() is shared and shared.verify_mode is ssl.CERT_REQUIRED and shared.check_hostname
    unverified = make(verify=False)
    assert unverified is not shared and unverified.verify_mode is ssl.CERT_NONE
    assert make(verify=False) is not unverified
