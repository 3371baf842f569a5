"""How often the sign-in token may be got wrong, in a sliding minute:

- per client address: at most ``failures`` times; that address is then refused;
- for all clients together: at most ``total`` times, whatever address each came from;
  every client is then refused.

A refused client gets 429 with Retry-After until the oldest counted failure leaves the
window, even with the right token, so a blocked client learns nothing. The per-address
limit keeps one client's guesses from locking others out, where the service sees each
client's address; the ceiling bounds the guesses where it cannot (a proxy that names no
client, or a client that writes its own ``X-Forwarded-For`` through a proxy that passes
it on): ``docs/operations.md`` says which deployment is which. A failure without a
client address (None) counts towards the ceiling only. Memory is bounded: at most
``clients`` addresses, the one whose last failure is oldest forgotten first.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable

#: Addresses remembered at once (each holds at most ``failures`` times).
MAX_CLIENTS = 10_000


class LoginLimiter:
    def __init__(
        self,
        failures: int,
        total: int | None = None,
        window_s: float = 60.0,
        clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``total``: the ceiling for all clients together (default: ten times ``failures``)."""
        total = 10 * failures if total is None else total
        if failures < 1 or total < 1 or clients < 1 or window_s <= 0:
            raise ValueError(
                f"login limiter needs positive bounds, got {failures}, {total}, {window_s}, {clients}")
        self.failures = failures
        self.total = total
        self.window_s = window_s
        self.clients = clients
        self._clock = clock
        self._failed: OrderedDict[str, deque[float]] = OrderedDict()
        self._all: deque[float] = deque(maxlen=total)

    def _wait(self, times: deque[float] | None, bound: int) -> float | None:
        if times is None or len(times) < bound:
            return None
        wait = times[0] + self.window_s - self._clock()
        return wait if wait > 0 else None

    def retry_after(self, client: str | None) -> float | None:
        """Seconds until ``client`` may try again, or None when it may try now."""
        waits = [self._wait(self._all, self.total)]
        if client is not None:
            waits.append(self._wait(self._failed.get(client), self.failures))
        known = [w for w in waits if w is not None]
        return max(known) if known else None

    def failed(self, client: str | None) -> None:
        """Count a wrong token from ``client`` (None: an address the service cannot tell)."""
        now = self._clock()
        self._all.append(now)
        if client is None:
            return
        times = self._failed.pop(client, None)
        if times is None:
            times = deque(maxlen=self.failures)
            while len(self._failed) >= self.clients:
                self._failed.popitem(last=False)
        times.append(now)
        self._failed[client] = times  # now the most recent

    def succeeded(self, client: str | None) -> None:
        """Forget ``client``'s failures (it knows the token); the ceiling's stay."""
        if client is not None:
            self._failed.pop(client, None)

    def __len__(self) -> int:
        return len(self._failed)
