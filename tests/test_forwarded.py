"""X-Forwarded-For names the client only where the settings trust its sender (`--forwarded-allow-ips`), alike on
both servers: by default the peer is the client, so the page's login throttle counts a guesser's every try however
it dresses them."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.conftest import LiveServer
from tests.test_cli import run_cli

sqlite_only = pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)


def guesses(server: LiveServer, forwarded_for: Callable[[int], str], tries: int = 5) -> list[int]:
    """The statuses of `tries` wrong logins to the page, the i-th claiming to come from `forwarded_for(i)`."""
    with httpx.Client(base_url=server.url, timeout=10) as http:
        return [
            http.post("/ui/login", data={"token": "a guess"}, headers={"x-forwarded-for": forwarded_for(i)}).status_code
            for i in range(tries)
        ]


@sqlite_only
def test_forwarded_for_is_ignored_by_default_so_each_guess_counts_against_the_peer(
    make_server: Callable[..., LiveServer],
) -> None:
    server = make_server()
    statuses = guesses(server, lambda i: f"10.0.0.{i}")
    assert statuses[:3] == [401, 401, 401] and statuses[3:] == [429, 429], statuses  # two free, then a wait


@sqlite_only
def test_a_trusted_proxy_names_the_client_and_the_throttle_counts_that_client(
    make_server: Callable[..., LiveServer],
) -> None:
    server = make_server(forwarded_allow_ips="127.0.0.0/8, ::1")
    assert guesses(server, lambda i: f"10.0.0.{i}") == [401] * 5  # five clients behind the proxy, one try each
    # one client behind the proxy, however it pads the header before the proxy's own entry
    assert guesses(server, lambda i: f"192.0.2.{i}, 10.0.1.1") == [401, 401, 401, 429, 429]


def test_forwarded_allow_ips_that_are_not_addresses_are_refused_in_one_line(tmp_path: Path) -> None:
    done = run_cli(["serve", "--forwarded-allow-ips", "10.0.0.1,proxy.example"], tmp_path)
    assert done.returncode != 0
    assert "'proxy.example' is not an IP address or network" in done.stderr, done.stderr
