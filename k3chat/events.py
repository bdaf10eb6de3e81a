"""Events the conversation loop emits while a turn runs (design 3; no UI imports here).

The CLI prints them and the app renders them; both receive them through one callback,
``on_event(event)``, called on the thread that runs the turn. Text events carry display text
from the streaming parser (control ids never appear in them); what is stored always comes
from the strict or lenient parse of every sampled id, so a UI never needs to rebuild it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Literal, Union

if TYPE_CHECKING:
    from k3chat.conversation import TurnResult

Phase = Literal["prefill", "reasoning", "answer", "sync", "done"]


@dataclass(frozen=True)
class PhaseChanged:
    """The turn moved to another phase.

    prefill: feeding the prompt tail; reasoning / answer: generating in that channel;
    sync: after an interrupted or malformed turn, bringing the engine state in line with the
    stored history (so the next turn reuses it); done: the turn is over (TurnDone follows).
    """

    phase: Phase


@dataclass(frozen=True)
class Prefill:
    """What the prompt costs: ``prefilled_tokens`` of ``prompt_tokens`` are fed, the rest
    (``reused_tokens``) come from ``source`` ("live", "snapshot", "state_file" or None)."""

    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    source: str | None


@dataclass(frozen=True)
class PrefillProgress:
    """The prefill so far: ``done`` of the ``total`` tokens this turn feeds (reused ones are
    not counted), ``seconds`` after it started. Sent when it starts (0 done), then at most a
    few times a second at chunk boundaries, and when it ends or stops."""

    done: int
    total: int
    seconds: float

    @property
    def tokens_per_second(self) -> float | None:
        return self.done / self.seconds if self.done > 0 and self.seconds > 0 else None

    @property
    def eta_seconds(self) -> float | None:
        """The rest at the rate so far (None before the first chunk is done)."""
        rate = self.tokens_per_second
        return (self.total - self.done) / rate if rate else None


@dataclass(frozen=True)
class ReasoningToken:
    """Reasoning text that became displayable after a sampled id (may span several ids)."""

    text: str


@dataclass(frozen=True)
class AnswerToken:
    """Answer text that became displayable after a sampled id (may span several ids)."""

    text: str


@dataclass(frozen=True)
class Stats:
    """Counters for a status bar; sent after the prefill, every few steps and at the end."""

    prompt_tokens: int
    reused_tokens: int
    prefilled_tokens: int
    generated_tokens: int
    prefill_seconds: float
    decode_seconds: float
    context_used: int  # positions in the engine state now
    context_limit: int  # N_ctx
    engine: dict[str, int] = field(default_factory=dict)  # Model.stats()
    draft_proposed: int = 0  # speculative decoding: drafted tokens verified this turn
    draft_accepted: int = 0  # ... and sampled as drafted

    @property
    def draft_acceptance(self) -> float | None:
        return self.draft_accepted / self.draft_proposed if self.draft_proposed else None

    @property
    def tokens_per_second(self) -> float | None:
        steps = self.generated_tokens - 1  # the first token comes from the prefill's logits
        if steps <= 0 or self.decode_seconds <= 0:
            return None
        return steps / self.decode_seconds


@dataclass(frozen=True)
class Notice:
    """Something the user should be told, never persisted.

    kind: "state" (a state file was refused or not found: the history is prefilled instead),
    "limit" (the token limit ended the turn), "cancelled", "malformed", "error".
    """

    kind: str
    text: str


@dataclass(frozen=True)
class TurnDone:
    """The last event of a turn; the result was already appended to the history."""

    result: "TurnResult"


Event = Union[PhaseChanged, Prefill, PrefillProgress, ReasoningToken, AnswerToken, Stats, Notice, TurnDone]
EventHandler = Callable[[Event], Any]


def ignore(event: Event) -> None:
    """The default handler."""
