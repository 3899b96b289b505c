"""Who is logged in to the page: each login its own session, ended by logging out; a logout from another site
refused; failed logins slowed down per client and logged without what was tried."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest


@contextmanager
def logged_in(server: Any) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=10) as http:
        assert http.post("/ui/login", data={"token": server.token}).status_code == 303
        assert http.get("/ui/").status_code == 200
        yield http


def test_logging_out_ends_that_session_and_no_other(server: Any) -> None:
    with logged_in(server) as first, logged_in(server) as second:
        assert first.cookies["trajproxy_ui"] != second.cookies["trajproxy_ui"]
        kept = first.cookies["trajproxy_ui"]
        assert first.post("/ui/logout").status_code == 303
        assert first.get("/ui/").status_code == 303
        replayed = httpx.get(f"{server.url}/ui/", cookies={"trajproxy_ui": kept})  # the cookie, kept by a thief
        assert replayed.status_code == 303 and replayed.headers["location"].startswith("/ui/login")
        assert second.get("/ui/").status_code == 200


def test_a_logout_posted_from_another_site_is_refused(server: Any) -> None:
    with logged_in(server) as http:
        forged = http.post("/ui/logout", headers={"origin": "https://evil.example"})
        assert forged.status_code == 403 and "another site" in forged.text
        assert http.get("/ui/").status_code == 200
        no_referrer = {"origin": "null", "sec-fetch-site": "same-origin"}  # this page's own form, no-referrer
        assert http.post("/ui/logout", headers=no_referrer).status_code == 303
        assert http.get("/ui/").status_code == 303


def test_failed_logins_are_slowed_down_per_client_and_logged_without_the_token(
    server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trajproxy")
    with httpx.Client(base_url=server.url, timeout=10) as http:
        for attempt in range(3):
            wrong = http.post("/ui/login", data={"token": f"guess-{attempt}"})
            assert wrong.status_code == 401, attempt
        held = http.post("/ui/login", data={"token": server.token})  # even the token, while this client waits
        assert held.status_code == 429 and "set-cookie" not in held.headers
        assert int(held.headers["retry-after"]) >= 1 and "too many failed logins" in held.text
    failures = [record.getMessage() for record in caplog.records if "login" in record.getMessage()]
    assert len(failures) == 3 and "127.0.0.1" in failures[-1]
    assert not any("guess" in line or str(server.token) in line for line in caplog.messages)
