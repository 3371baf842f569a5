"""What the CLI shows on stderr while it waits: a spinner with the elapsed time, or a bar
with a job's progress. Drawn on one line, and only when stderr is a terminal."""

from __future__ import annotations

import concurrent.futures
import itertools
import sys
import time
from collections.abc import Callable
from typing import TextIO, TypeVar

__all__ = ["ProgressLine", "wait_with_progress"]

T = TypeVar("T")
_BAR_WIDTH = 30


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d}" if minutes >= 60 else f"{minutes:02d}:{seconds:02d}"


class ProgressLine:
    """One status line on ``stream`` (default stderr), redrawn in place; ``enabled=False``
    or a stream that is not a terminal draws nothing. Use it as a context manager: the
    line is cleared on exit."""

    def __init__(self, description: str, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.description = description
        self.stream = stream or sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        self.enabled = enabled and callable(isatty) and bool(isatty())
        self.started = time.monotonic()
        self._spinner = itertools.cycle("|/-\\")
        self._width = 0

    def _draw(self, text: str) -> None:
        if self.enabled:
            self.stream.write("\r" + text.ljust(self._width))
            self.stream.flush()
            self._width = len(text)

    def spin(self) -> None:
        """A spinner, the description and the elapsed time."""
        self._draw(f"{next(self._spinner)} {self.description} {_clock(time.monotonic() - self.started)}")

    def bar(self, fraction: float, status: str = "") -> None:
        """A bar filled to ``fraction`` (0..1), the percentage, the elapsed time and ``status``."""
        fraction = min(1.0, max(0.0, fraction))
        filled = round(fraction * _BAR_WIDTH)
        self._draw(
            f"{self.description} |{'#' * filled}{' ' * (_BAR_WIDTH - filled)}| {100 * fraction:.0f}% "
            f"{_clock(time.monotonic() - self.started)} {status}".rstrip()
        )

    def __enter__(self) -> ProgressLine:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.enabled and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()


def wait_with_progress(description: str, work: Callable[[], T], enabled: bool = True) -> T:
    """Run ``work`` in a thread and return its result (or raise its exception); meanwhile
    show a spinner with the elapsed time on stderr (when it is a terminal)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool, ProgressLine(description, enabled) as line:
        future = pool.submit(work)
        while True:
            try:
                return future.result(timeout=0.1)
            except concurrent.futures.TimeoutError:
                line.spin()
