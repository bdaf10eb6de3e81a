"""Training text: demo conversations rendered with the app's own XTML template.

A conversation becomes the ids the engine would see and a mask of the ids the model is
trained to produce: every assistant turn from its first reasoning id (or answer id, with
thinking off) through its closing ``<|end_of_msg|>``. Prompts are found exactly as the
conversation loop builds them (``template.render`` with the generation prompt), so the
model learns to continue precisely what the app will feed it.
"""

from __future__ import annotations

from k3chat import template
from k3chat.tokenizer import Tokenizer

from .tasks import Conversation, messages_for, thinking_of


class CorpusError(RuntimeError):
    pass


def prompt_ids(conv: Conversation, turn: int, tokenizer: Tokenizer) -> list[int]:
    """What the engine is fed before the model answers turn ``turn`` (0-based)."""
    thinking, effort = thinking_of(conv.mode)
    segs = template.render(messages_for(conv, turn + 1, answered=False), thinking=thinking,
                           effort=effort, add_generation_prompt=True)
    return template.encode(segs, tokenizer)


def _encode_with_turns(conv: Conversation, tokenizer: Tokenizer) -> tuple[list[int], list[tuple[int, int]]]:
    """The whole conversation's ids and, for each turn, the [start, end) of the ids it trains."""
    thinking, effort = thinking_of(conv.mode)
    full = template.encode(template.render(messages_for(conv), thinking=thinking, effort=effort,
                                           add_generation_prompt=False), tokenizer)
    spans = []
    for i in range(len(conv.turns)):
        start = prompt_ids(conv, i, tokenizer)
        end = template.encode(template.render(messages_for(conv, i + 1), thinking=thinking, effort=effort,
                                              add_generation_prompt=False), tokenizer)
        if full[: len(end)] != end or end[: len(start)] != start:
            raise CorpusError("a turn's prompt is not a prefix of the rendered conversation")
        spans.append((len(start), len(end)))
    return full, spans


def encode_conversation(conv: Conversation, tokenizer: Tokenizer) -> tuple[list[int], list[bool]]:
    """(ids, trained) for a whole conversation, every turn answered."""
    full, spans = _encode_with_turns(conv, tokenizer)
    mask = [False] * len(full)
    for start, end in spans:
        for j in range(start, end):
            mask[j] = True
    return full, mask


def count_decision_positions(conv: Conversation, tokenizer: Tokenizer) -> list[int]:
    """Where a counting turn decides whether a spelled letter is the one counted: the index of
    the id after each letter written alone at a line start (" (" marks it, "\n" passes it).
    Only counting turns are searched; their other letters follow a space or another letter."""
    if not any(t.task == "count" for t in conv.turns):
        return []
    full, spans = _encode_with_turns(conv, tokenizer)
    text = {i: tokenizer.decode_bytes([i]) for i in set(full) if not tokenizer.is_special(i)}
    out = []
    for turn, (start, end) in zip(conv.turns, spans):
        if turn.task != "count":
            continue
        for k in range(max(start, 2), end):
            letter, before = text.get(full[k - 1], b""), text.get(full[k - 2], b"")
            if len(letter) == 1 and letter.isalpha() and before.endswith(b"\n"):
                out.append(k)
    return out


def texts_of(conv: Conversation) -> list[str]:
    """The text segments of a rendered conversation (what the BPE is learned on)."""
    thinking, effort = thinking_of(conv.mode)
    segs = template.render(messages_for(conv), thinking=thinking, effort=effort, add_generation_prompt=False)
    return [s.text for s in segs if not s.allow_special]
