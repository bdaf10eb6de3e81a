"""Prefill progress: how often a long prefill reports, and the one line that shows it.

The conversation loop feeds a long prompt in pieces (see Conversation._prefill) and reports
``PrefillProgress`` through ``PrefillMeter``; ``run`` prints ``progress_line`` on standard
error and the app shows ``progress_bar`` plus the same figures. No UI imports here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from k3chat.events import EventHandler, PrefillProgress

# At most this often (seconds) between two progress events; the first (0 done) and the last
# (all done, or where a stop left it) are always sent.
PROGRESS_INTERVAL = 0.25


class PrefillMeter:
    """Counts the tokens one turn's prefill feeds and emits PrefillProgress, throttled."""

    def __init__(self, total: int, emit: EventHandler, *, interval: float = PROGRESS_INTERVAL,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.total = total
        self.done = 0
        self._emit = emit
        self._interval = interval
        self._clock = clock
        self._start = clock()
        self._last_sent: float | None = None
        self._sent_done = -1

    @property
    def seconds(self) -> float:
        return self._clock() - self._start

    def start(self) -> None:
        self._send()

    def advance(self, n: int) -> None:
        self.done += n
        now = self._clock()
        if self.done >= self.total or self._last_sent is None or now - self._last_sent >= self._interval:
            self._send()

    def close(self) -> None:
        """The final figures (where a stop left the prefill), unless they were just sent."""
        if self._sent_done != self.done:
            self._send()

    def _send(self) -> None:
        self._last_sent = self._clock()
        self._sent_done = self.done
        self._emit(PrefillProgress(self.done, self.total, self._last_sent - self._start))


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


def progress_figures(p: PrefillProgress) -> str:
    """``1,024/5,000 tokens (20%), 310 tok/s, ETA 13 s``: what both front-ends show."""
    pct = 100 * p.done // p.total if p.total else 100
    text = f"{p.done:,}/{p.total:,} tokens ({pct}%)"
    rate, eta = p.tokens_per_second, p.eta_seconds
    text += f", {rate:,.0f} tok/s" if rate is not None else ", - tok/s"
    if p.done < p.total:
        text += f", ETA {_duration(eta)}" if eta is not None else ", ETA -"
    else:
        text += f", {_duration(p.seconds)}"
    return text


def progress_line(p: PrefillProgress) -> str:
    return f"prefill {progress_figures(p)}"


def progress_bar(p: PrefillProgress, width: int = 24) -> str:
    """A text bar, ``[#########...............]``, so it reads the same in any terminal."""
    filled = width * p.done // p.total if p.total else width
    return "[" + "#" * filled + "." * (width - filled) + "]"


__all__ = ["PROGRESS_INTERVAL", "PrefillMeter", "progress_figures", "progress_line", "progress_bar"]
