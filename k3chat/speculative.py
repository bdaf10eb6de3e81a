"""Drafts for exact speculative decoding: n-gram prompt lookup in the session's own tokens.

The drafter proposes what followed the most recent earlier occurrence of the last few
tokens (the longest n-gram that occurred before wins). Drafts only decide how much is
verified in one engine pass; the sampled tokens, and so the output, never depend on them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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


def propose(tokens: Sequence[int], limit: int, *, stop_ids: Iterable[int] = ()) -> list[int]:
    """One-shot lookup (tests and benchmarks): what ``NgramDrafter(tokens).propose`` gives."""
    return NgramDrafter(tokens, stop_ids=stop_ids).propose(limit)


__all__ = ["MAX_NGRAM", "NgramDrafter", "propose"]
