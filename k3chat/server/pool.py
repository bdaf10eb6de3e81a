"""Saved engine states for prefix reuse across requests (design 2.5, 6).

Clients resend the whole conversation each turn. The engine session holds one state; the
pool keeps a few more as exported bytes (``Session.export_state``), keyed by the ids they
hold, so that several conversations interleaved on one server each find their prefix. A
state is reused only when every id it holds begins the new prompt and the prompt is longer
(KDA state cannot be truncated: a state that runs past the point where the prompt differs
is useless). The pool never holds more than ``budget`` bytes: the memory plan sets aside
room for turn snapshots, and that room is what the server spends here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


def extends(prefix: Sequence[int], ids: Sequence[int]) -> bool:
    """0 < |prefix| < |ids| and ids begins with prefix (spec 5.3)."""
    n = len(prefix)
    return 0 < n < len(ids) and list(ids[:n]) == list(prefix)


@dataclass(frozen=True)
class Saved:
    """A state, and for a state saved at the end of a prompt the logits of its last position:
    a request with exactly that prompt (a regenerate, the same question again) then needs no
    feed at all."""

    ids: tuple[int, ...]
    payload: bytes | bytearray
    logits: Any = None  # float32 [V] or None

    @property
    def size(self) -> int:
        return len(self.payload) + (int(self.logits.nbytes) if self.logits is not None else 0)


class StatePool:
    """Least recently used states within a byte budget. Used only by the engine thread."""

    def __init__(self, budget: int) -> None:
        self.budget = max(0, int(budget))
        self._states: OrderedDict[tuple[int, ...], Saved] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._states)

    @property
    def bytes(self) -> int:
        return self._bytes

    def holds(self, ids: Sequence[int]) -> bool:
        return tuple(ids) in self._states

    def best_for(self, prompt: Sequence[int]) -> Saved | None:
        """The longest saved state that the prompt extends, or that is the prompt with its
        logits (marked as just used)."""
        key = tuple(prompt)
        usable = (s for s in self._states.values()
                  if extends(s.ids, prompt) or (s.logits is not None and s.ids == key))
        best = max(usable, key=lambda s: len(s.ids), default=None)
        if best is not None:
            self._states.move_to_end(best.ids)
        return best

    def make_room(self, size: int) -> bool:
        """Evict the least recently used states until ``size`` more bytes fit; False (and
        nothing evicted) when a state of that size can never fit."""
        if size > self.budget:
            return False
        while self._states and self._bytes + size > self.budget:
            _, old = self._states.popitem(last=False)
            self._bytes -= old.size
        return True

    def put(self, ids: Sequence[int], payload: bytes | bytearray, logits: Any = None) -> bool:
        """Keep a state (after make_room for its size); False if it does not fit."""
        key = tuple(int(i) for i in ids)
        if not key:
            return False
        previous = self._states.pop(key, None)
        if previous is not None:
            self._bytes -= previous.size
        saved = Saved(key, payload, logits)
        if not self.make_room(saved.size):
            return False
        self._states[key] = saved
        self._bytes += saved.size
        return True

    def drop(self, ids: Sequence[int]) -> None:
        old = self._states.pop(tuple(ids), None)
        if old is not None:
            self._bytes -= old.size
