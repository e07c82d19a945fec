"""Progress of a replay on stderr: a bar on a terminal, plain lines anywhere else.

A replay of thousands of ranks can take minutes. On a terminal tqdm draws a bar; in CI logs or
under nohup (stderr not a terminal) a bar would be one unreadable line, so a line is printed
every 10% of the steps or every 30 seconds, whichever comes first, and one at the end.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from tqdm import tqdm

__all__ = ["Progress"]

#: A plain line at least every this many seconds, and every time this many tenths are done.
LINE_SECONDS = 30.0
LINE_TENTHS = 1


class Progress:
    """Counts steps and reports them on ``stream``.

    Args:
        total: steps to come.
        stream: where to report (default stderr).
        label: what is counted.
        clock: seconds, monotonic (a parameter so that tests can drive it).
    """

    def __init__(
        self,
        total: int,
        *,
        stream: TextIO | None = None,
        label: str = "steps",
        clock=time.monotonic,  # noqa: ANN001 - any callable returning seconds
    ) -> None:
        self.total, self.label, self.clock = total, label, clock
        self.stream = sys.stderr if stream is None else stream
        self.done = 0
        self._start = self._last = clock()
        self._next_tenth = LINE_TENTHS
        isatty = getattr(self.stream, "isatty", None)
        self._bar = (
            tqdm(total=total, desc=label, unit="step", file=self.stream)
            if isatty is not None and isatty()
            else None
        )

    def update(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(n)
            return
        now = self.clock()
        tenths = 10 * self.done // self.total if self.total else 10
        if tenths >= self._next_tenth or now - self._last >= LINE_SECONDS:
            self._line(now)
            while self._next_tenth <= tenths:
                self._next_tenth += LINE_TENTHS

    def _line(self, now: float) -> None:
        self._last = now
        elapsed = now - self._start
        pct = 100.0 * self.done / self.total if self.total else 100.0
        print(
            f"{self.label} {self.done}/{self.total} ({pct:.0f}%) {elapsed:.1f} s",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
