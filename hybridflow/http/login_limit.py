"""How often a client may get the sign-in token wrong: at most ``failures`` times in a
sliding minute, counted per client address; a client past that is refused (429 with
Retry-After) until its oldest failure leaves the window, even with the right token, so a
blocked client learns nothing. Memory is bounded: at most ``clients`` addresses, the one
whose last failure is oldest forgotten first."""

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
        window_s: float = 60.0,
        clients: int = MAX_CLIENTS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failures < 1 or clients < 1 or window_s <= 0:
            raise ValueError(f"login limiter needs positive bounds, got {failures}, {window_s}, {clients}")
        self.failures = failures
        self.window_s = window_s
        self.clients = clients
        self._clock = clock
        self._failed: OrderedDict[str, deque[float]] = OrderedDict()

    def retry_after(self, client: str) -> float | None:
        """Seconds until ``client`` may try again, or None when it may try now."""
        times = self._failed.get(client)
        if times is None or len(times) < self.failures:
            return None
        wait = times[0] + self.window_s - self._clock()
        return wait if wait > 0 else None

    def failed(self, client: str) -> None:
        """Count a wrong token from ``client``."""
        times = self._failed.pop(client, None)
        if times is None:
            times = deque(maxlen=self.failures)
            while len(self._failed) >= self.clients:
                self._failed.popitem(last=False)
        times.append(self._clock())
        self._failed[client] = times  # now the most recent

    def succeeded(self, client: str) -> None:
        """Forget ``client``'s failures (it knows the token)."""
        self._failed.pop(client, None)

    def __len__(self) -> int:
        return len(self._failed)
