"""The status bar: model, memory plan, thinking effort, sampler, phase, speed, expert cache hit rate,
bytes read per token and context used (the tokens the model holds for this session: the stored
history as the model reads it between turns, plus what the running turn has fed during one;
the same after a restart). Figures for a turn are differences of the engine's cumulative
counters since the turn's prefill ended, so they describe decoding, not the history."""

from __future__ import annotations

from typing import Any

from rich.cells import cell_len
from textual.content import Content
from textual.widgets import Static

from ..text import one_line


def short_count(n: int) -> str:
    if n >= 1_000_000:
        return f"{n / 1_048_576:.1f}M" if n % 1_048_576 else f"{n // 1_048_576}M"
    if n >= 100_000:
        return f"{n // 1024}K"
    return f"{n:,}"


def format_speed(tokens_per_second: float | None) -> str:
    if not tokens_per_second:
        return ""
    if tokens_per_second >= 1:
        return f"{tokens_per_second:.1f} tok/s"
    return f"{1 / tokens_per_second:.1f} s/tok"


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


SEPARATOR = " \u2502 "
# When the line is wider than the bar, these go first, in this order: the context figure, the
# phase and the speed are what a person watches, so they stay whole.
DROP_FIRST = ("plan", "drafts", "per_token", "cache", "sampler", "model", "thinking")


def fitted(fields: list[tuple[str, str]], width: int) -> list[str]:
    """The (name, text) fields that fit in ``width`` cells, dropping those of DROP_FIRST in
    order (``width`` 0: not laid out yet, all of them)."""
    kept = [(name, text) for name, text in fields if text]
    for name in DROP_FIRST:
        if width <= 0 or cell_len(SEPARATOR.join(text for _, text in kept)) <= width:
            break
        kept = [field for field in kept if field[0] != name]
    return [text for _, text in kept]


def thinking_label(on: bool, effort: str | None) -> str:
    return f"thinking {effort}" if on and effort else ("thinking" if on else "no thinking")


class StatusBar(Static):
    """One line, built from plain values (never markup)."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__("", id=id, markup=False)
        self.model = ""
        self.plan = ""
        self.thinking = ""
        self.sampler = ""
        self.phase = "loading"
        self.speed = ""
        self.cache = ""
        self.per_token = ""
        self.drafts = ""  # speculative decoding: drafted tokens the sampler confirmed
        self.context = ""
        self._base: dict[str, int] | None = None

    # ------------------------------------------------------------------ inputs

    def set_model(self, name: str, plan: str) -> None:
        self.model, self.plan = name, plan
        self._show()

    def set_thinking(self, on: bool, effort: str | None) -> None:
        """The thinking effort the next answer uses (this session's)."""
        self.thinking = thinking_label(on, effort)
        self._show()

    def set_sampler(self, label: str) -> None:
        """How this session's answers are sampled ("greedy", "sampling t 0.7 p 0.9")."""
        self.sampler = label
        self._show()

    def set_phase(self, phase: str) -> None:
        self.phase = phase
        self._show()

    def set_context(self, used: int | None, limit: int | None, *, estimate: bool = False) -> None:
        if used is None or limit is None:
            self.context = ""
        else:
            limit_text = f"/{short_count(limit)}" if limit > 0 else ""  # 0: the (remote) server's, unknown
            self.context = f"ctx {'~' if estimate else ''}{used:,}{limit_text}"
        self._show()

    def turn_started(self) -> None:
        self.clear_speed()

    def clear_speed(self) -> None:
        """Forget the last turn's speed, cache and read figures (a turn or a session starts)."""
        self._base = None
        self.speed = self.cache = self.per_token = self.drafts = ""
        self._show()

    def update_stats(self, stats: Any) -> None:
        """From a k3chat.events.Stats event."""
        engine = dict(stats.engine or {})
        if self._base is None or stats.generated_tokens == 0:
            self._base = engine  # the counters when decoding starts
        base = self._base
        speed = stats.tokens_per_second
        if speed:
            self.speed = format_speed(speed)
        elif stats.generated_tokens == 0 and stats.prefill_seconds > 0 and stats.prefilled_tokens:
            self.speed = f"prefill {stats.prefilled_tokens / stats.prefill_seconds:.1f} tok/s"
        delta = {k: engine.get(k, 0) - base.get(k, 0) for k in engine}
        hits, misses = delta.get("cache_hits", 0), delta.get("cache_misses", 0)
        if hits + misses > 0:
            self.cache = f"cache {100 * hits / (hits + misses):.0f}%"
        fed = delta.get("tokens_fed", 0)
        read = delta.get("expert_bytes_read", 0) + delta.get("trunk_bytes_read", 0)
        if fed > 0:
            self.per_token = f"{format_bytes(read / fed)}/tok read"
        proposed = getattr(stats, "draft_proposed", 0)
        if proposed:
            accepted = getattr(stats, "draft_accepted", 0)
            self.drafts = f"drafts {accepted}/{proposed} kept ({100 * accepted / proposed:.0f}%)"
        self.set_context(stats.context_used, stats.context_limit)

    # ------------------------------------------------------------------ output

    def _fields(self) -> list[tuple[str, str]]:
        fields = [("model", self.model), ("plan", self.plan), ("thinking", self.thinking), ("sampler", self.sampler),
                  ("phase", self.phase), ("speed", self.speed), ("cache", self.cache),
                  ("per_token", self.per_token), ("drafts", self.drafts), ("context", self.context)]
        return [(name, one_line(text, 60)) for name, text in fields if text]

    def parts(self) -> list[str]:
        """Every field (what the bar shows when it is wide enough)."""
        return [text for _, text in self._fields()]

    def shown(self) -> list[str]:
        """The fields that fit the bar's width (the context figure is never cut)."""
        return fitted(self._fields(), self.content_size.width)

    def on_resize(self) -> None:
        self._show()

    def _show(self) -> None:
        self.update(Content(SEPARATOR.join(self.shown())))
