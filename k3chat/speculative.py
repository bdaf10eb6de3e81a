"""Drafts for exact speculative decoding: n-gram prompt lookup in the session's own tokens.

The drafter proposes what followed the most recent earlier occurrence of the last few
tokens (the longest n-gram that occurred before wins). Drafts only decide how much is
verified in one engine pass; the sampled tokens, and so the output, never depend on them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from k3chat.engine_api import VerifyingSession

MAX_NGRAM = 3  # longest suffix looked up; shorter ones are tried when it never occurred


class NgramDrafter:
    """An index of the session's tokens: for each n-gram (n <= MAX_NGRAM), the position of
    the token that followed its latest occurrence. Updated as tokens are appended, so a
    lookup costs O(MAX_NGRAM) whatever the context length."""

    def __init__(self, tokens: Iterable[int] = (), *, stop_ids: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self.stop_ids = frozenset(stop_ids)
        self._follow: list[dict[tuple[int, ...], int]] = [{} for _ in range(MAX_NGRAM)]
        self.extend(tokens)

    def append(self, token: int) -> None:
        toks = self.tokens
        toks.append(int(token))
        at = len(toks) - 1  # the new token follows the n-grams that end just before it
        for n in range(1, MAX_NGRAM + 1):
            if at - n < 0:
                break
            self._follow[n - 1][tuple(toks[at - n:at])] = at

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def propose(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the longest recent match of the tokens' end,
        cut before the first stop id (a stop is never fed, so verifying past one is waste)."""
        toks = self.tokens
        if limit < 1 or not toks:
            return []
        for n in range(min(MAX_NGRAM, len(toks)), 0, -1):
            start = self._follow[n - 1].get(tuple(toks[len(toks) - n:]))
            if start is None:
                continue
            draft: list[int] = []
            for t in toks[start:start + limit]:
                if t in self.stop_ids:
                    break
                draft.append(t)
            return draft
        return []


class Speculator:
    """One generation's exact speculative decoding over an engine session.

    The drafter proposes what followed the latest match of the last tokens; the sampled token
    plus the draft are verified in one engine pass; the caller's sampler then draws once per
    position from the verified logits, exactly as serial decoding would, and the draft is used
    while it equals what was sampled. Only the positions the sampler went through are accepted
    into the session (``settle``), so the session ends where serial decoding's does.

    The owner keeps a mirror of the ids its session holds: ``feed`` is its own plain feed
    (which updates the mirror), ``fed`` is told the ids accepted after a verify, ``lost`` that
    the mirror is unknown (an accept that failed).
    """

    def __init__(self, session: VerifyingSession, tokens: Sequence[int], *, limit: int, stop_ids: Iterable[int],
                 feed: Callable[[Sequence[int]], Any], fed: Callable[[Sequence[int]], None],
                 lost: Callable[[], None], cancel: Any = None) -> None:
        self.session, self.limit = session, limit
        self.drafter = NgramDrafter(tokens, stop_ids=stop_ids)
        self._feed, self._fed, self._lost, self._cancel = feed, fed, lost, cancel
        self.block: list[int] = []  # the verified positions: the sampled token, then the draft
        self.rows: Any = None  # rows[i]: the logits after block[i]
        self.used = 0  # positions of the block the sampler went through
        self.proposed = 0  # drafted tokens verified
        self.accepted = 0  # ... that the sampler then produced

    def sampled(self, token: int) -> None:
        """Every sampled token, in order (the drafter looks up the session's tokens plus it)."""
        self.drafter.append(token)

    def next_logits(self, token: int, *, room: int) -> Any:
        """The logits after ``token`` (just sampled, to be fed); ``room``: how many more tokens
        the generation may sample, so nothing past its limit is verified."""
        if self.block and self.used < len(self.block) and self.block[self.used] == token:
            self.used += 1  # the draft was right: the verify pass computed these already
            self.accepted += 1
            return self.rows[self.used - 1]
        self.settle()
        space = self.session.capacity - self.session.length - 1  # never verify past the context
        draft = self.drafter.propose(min(self.limit, room - 1, space))
        if not draft:
            return self._feed([token])
        self.rows = self.session.verify([token] + draft, cancel=self._cancel)
        self.block, self.used = [token] + draft, 1
        self.proposed += len(draft)
        return self.rows[0]

    def settle(self) -> None:
        """Accept the verified positions used so far; the rest of the block is dropped. A
        verify that failed or was cancelled left the session as it was: nothing to settle."""
        if not self.block:
            return
        keep, block = self.used, self.block
        self.block, self.rows, self.used = [], None, 0
        try:
            self.session.accept(keep)
        except BaseException:
            self._lost()
            raise
        self._fed(block[:keep])


def propose(tokens: Sequence[int], limit: int, *, stop_ids: Iterable[int] = ()) -> list[int]:
    """One-shot lookup (tests and benchmarks): what ``NgramDrafter(tokens).propose`` gives."""
    return NgramDrafter(tokens, stop_ids=stop_ids).propose(limit)


__all__ = ["MAX_NGRAM", "NgramDrafter", "Speculator", "propose"]
