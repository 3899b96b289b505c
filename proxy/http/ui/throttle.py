"""LoginThrottle: failed logins to the page, slowed down per client address.

A client's first few failures cost nothing (a person mistypes); from then on each failure makes it wait twice as long
as the last before its next try is even checked, up to a minute, so guessing the token from one address takes
years. A try counts as a failure from when it comes, before its token is read, so that tries sent all at once meet
the wait as they come rather than once all are checked; a login succeeds and the count starts again. Clients are
remembered in a bounded map, oldest forgotten first.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

FREE_FAILURES = 2  # failures before any wait
FIRST_WAIT_S = 5.0
LONGEST_WAIT_S = 60.0
CLIENTS_KEPT = 10_000


@dataclass(slots=True)
class _Failures:
    count: int
    until: float  # when the client may try again (monotonic seconds)


class LoginThrottle:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._clients: OrderedDict[str, _Failures] = OrderedDict()

    def wait_s(self, client: str) -> float:
        """How long `client` must wait before its next try is checked (0: it may try now)."""
        failures = self._clients.get(client)
        return 0.0 if failures is None else max(0.0, failures.until - self._clock())

    def failed(self, client: str) -> int:
        """Count a failed try; how many in a row `client` has made."""
        failures = self._clients.pop(client, None) or _Failures(0, 0.0)
        failures.count += 1
        beyond = failures.count - FREE_FAILURES
        wait_s = 0.0 if beyond <= 0 else min(LONGEST_WAIT_S, FIRST_WAIT_S * 2 ** min(beyond - 1, 16))
        failures.until = self._clock() + wait_s
        self._clients[client] = failures
        while len(self._clients) > CLIENTS_KEPT:
            self._clients.popitem(last=False)
        return failures.count

    def succeeded(self, client: str) -> None:
        self._clients.pop(client, None)


def retry_after(wait_s: float) -> str:
    """A Retry-After header's value: whole seconds, at least one."""
    return str(max(1, math.ceil(wait_s)))
