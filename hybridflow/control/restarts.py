"""The arithmetic of a group's supervision, without Ray or an event loop: how many
restarts its window still allows, how long to wait after a failed start, and what a lost
rank leads to (``supervision:`` of a group, ``hybridflow.config.groups.SupervisionConfig``).

A *restart* is a rebuild or a rank replacement after a lost rank (or a hung one, or a call
that ran past its deadline), or another try after a failed start. Restoring a group after
a client's mutating call raised is not one: the workers did nothing wrong.
"""

from __future__ import annotations

import enum
from collections import deque

from hybridflow.config import SupervisionConfig
from hybridflow.config.groups import HALT, REPLACE_RANK


class RestartWindow:
    """The restarts of one unit within a sliding window of ``window_s`` seconds, of which
    ``max_restarts`` are allowed; times are the caller's clock (monotonic seconds)."""

    def __init__(self, max_restarts: int, window_s: float) -> None:
        self.max_restarts = max_restarts
        self.window_s = window_s
        self._times: deque[float] = deque()

    def _expire(self, now: float) -> None:
        while self._times and self._times[0] <= now - self.window_s:
            self._times.popleft()

    def count(self, now: float) -> int:
        """Restarts within the window ending at ``now``."""
        self._expire(now)
        return len(self._times)

    def allows(self, now: float) -> bool:
        """Whether one more restart at ``now`` stays within the bound."""
        return self.count(now) < self.max_restarts

    def record(self, now: float) -> None:
        self._times.append(now)

    def clear(self) -> None:
        """Forget every restart (an operator restarted or reset the group)."""
        self._times.clear()

    def reason(self, now: float) -> str:
        """Why the group halts when :meth:`allows` says no."""
        return f"restarted {self.count(now)} times in {self.window_s:g} s"


class Backoff:
    """Seconds to wait before the next try after a failed start: ``initial`` after the
    first failure, doubled after each further one, at most ``maximum``; a start that
    succeeds begins the sequence again."""

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self.failures = 0

    def failed(self) -> float:
        """Count a failed start; the seconds to wait before the next try."""
        self.failures += 1
        return min(self.initial * 2 ** min(self.failures - 1, 64), self.maximum)

    def succeeded(self) -> None:
        self.failures = 0


class Decision(enum.Enum):
    """What a lost rank leads to."""

    REBUILD = "rebuild"
    REPLACE = "replace"
    #: ``on_rank_lost: halt``.
    HALT = "halt"
    #: The restart window is spent.
    HALT_INTENSITY = "halt_intensity"


def on_rank_lost(config: SupervisionConfig, window: RestartWindow, now: float) -> Decision:
    """The policy's answer to a lost rank at ``now``; a restart it decides on is recorded
    in ``window``."""
    if config.on_rank_lost == HALT:
        return Decision.HALT
    if not window.allows(now):
        return Decision.HALT_INTENSITY
    window.record(now)
    return Decision.REPLACE if config.on_rank_lost == REPLACE_RANK else Decision.REBUILD


def may_restart(window: RestartWindow, now: float) -> bool:
    """Whether a restart that no lost rank asked for (another try after a failed start, a
    hung call's rebuild) may happen at ``now``; recorded if so."""
    if not window.allows(now):
        return False
    window.record(now)
    return True


class Supervision:
    """One unit's supervision state: its config, its restart window and its backoff."""

    def __init__(self, config: SupervisionConfig) -> None:
        self.config = config
        self.window = RestartWindow(config.max_restarts, config.restart_window_s)
        self.backoff = Backoff(config.backoff_s.initial, config.backoff_s.max)

    def reset(self) -> None:
        """An operator restarted or reset the group: its count starts again."""
        self.window.clear()
        self.backoff.succeeded()
