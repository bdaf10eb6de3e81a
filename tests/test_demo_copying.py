"""The demo's training text makes every copy a copy of the same ids.

What the model copies (a puzzle word, a letter, a sentence, a line of an attached file, the
numbers of a sum) must be tokenized in the reasoning and the answer exactly as where it is
copied from, with the tokenizer the trainer learns on the generated text: a small model
learns to copy ids, not to map one id to another. The copied items are read off the question
here by regex, never taken from the generator.
"""
from __future__ import annotations

import random
import re

import pytest

from k3chat.demo import corpus, tasks, train
from k3chat.tokenizer import Tokenizer
from k3engine.tokenizer_files import piece_counts, write_tokenizer

BPE_CONVERSATIONS = 1500       # train.py learns on 6,000; the same rule on fewer is enough here
TURNS_PER_TASK = 60


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """The BPE as train.build_tokenizer learns it, on a smaller generated sample."""
    rng = random.Random(0xB9E)
    sample = [tasks.training_conversation(rng) for _ in range(BPE_CONVERSATIONS)]
    freq = piece_counts(t for c in sample for t in corpus.texts_of(c))
    out = tmp_path_factory.mktemp("demo-tok")
    write_tokenizer(out, train.learn_vocabulary(freq, train.N_RANKS))
    return Tokenizer.from_dir(out)


def whole_ids(tok: Tokenizer, text: str, start: int, end: int) -> list[int] | None:
    """The ids that encode text[start:end] inside ``text``, or None if the span cuts an id."""
    lo, hi = len(text[:start].encode("utf-8")), len(text[:end].encode("utf-8"))
    pos, out = 0, []
    for i in tok.encode_text(text):
        n = len(tok.token_bytes(i))
        if lo <= pos and pos + n <= hi:
            out.append(i)
        elif pos < hi and pos + n > lo:
            return None
        pos += n
    return out


def span_ids(tok: Tokenizer, text: str, start: int, end: int) -> list[int]:
    ids = whole_ids(tok, text, start, end)
    assert ids is not None, (f"{text[start:end]!r} is not whole ids in {text!r}: "
                             f"{[tok.decode([i]) for i in tok.encode_text(text)]}")
    return ids


def contains(ids: list[int], sub: list[int]) -> bool:
    return any(ids[i:i + len(sub)] == sub for i in range(len(ids) - len(sub) + 1))


def assert_copied(tok: Tokenizer, source: str, start: int, end: int, dest: str, what: str) -> None:
    item = span_ids(tok, source, start, end)
    got = tok.encode_text(dest)
    assert contains(got, item), (f"{what}: {source[start:end]!r} is {[tok.decode([i]) for i in item]} in the "
                                 f"source but the copy reads {[tok.decode([i]) for i in got]}")


def _turns(task: str, seed: int) -> list[tasks.Turn]:
    rng = random.Random(seed)
    return [tasks.SINGLE_TASKS[task][1](rng)[1]() for _ in range(TURNS_PER_TASK)]


def _texts(t: tasks.Turn) -> list[tuple[str, str]]:
    """(where, text) of everything the model writes for this turn, in every mode."""
    return [(f"reasoning[{e}]", t.reasoning[e]) for e in tasks.EFFORTS] + [("answer[off]", t.response_for("off"))]


def test_puzzle_words_are_one_letter_per_id_in_every_form(tok: Tokenizer) -> None:
    for w in sorted(tasks.puzzle_words()):
        for form in (w, " " + w, w[::-1], " " + w[::-1]):
            pieces = [tok.decode([i]) for i in tok.encode_text(form)]
            assert [p.strip() for p in pieces] == list(form.strip()), (form, pieces)
    # the letter asked about is the letter's own id, not one id for "r's"
    assert tok.encode_text(" r's")[0] == tok.encode_text(" r")[0]


def test_sentence_words_are_whole_ids_and_never_spelled(tok: Tokenizer) -> None:
    spelled = tasks.puzzle_words() | {w[::-1] for w in tasks.puzzle_words()}
    assert not tasks.sentence_words() & spelled
    # a sentence to repeat is a short run of word ids, not a run of letters (two-letter words
    # such as " to" may be refused: BPE would build them inside a puzzle word)
    for w in sorted(tasks.sentence_words()):
        if len(w) > 2:
            assert len(tok.encode_text(" " + w)) == 1, (w, [tok.decode([i]) for i in tok.encode_text(" " + w)])


def test_count_copies_the_word_and_the_letter_as_the_question_has_them(tok: Tokenizer) -> None:
    for t in _turns("count", 21):
        q = t.question
        w = re.search(r"(?:in the word|word|in) ([a-z]+)", q)
        c = re.search(r"(?:many|letter|Count the|times is) ([a-z])(?:'s|s)?\b", q)
        assert w and c, q
        for where, text in _texts(t):
            assert_copied(tok, q, w.start(1) - 1, w.end(1), text, f"count {where}: the word")
            assert_copied(tok, q, c.start(1) - 1, c.end(1), text, f"count {where}: the letter")


def test_reverse_copies_the_word_and_the_answer_copies_the_reasoning(tok: Tokenizer) -> None:
    stop = {"reverse", "the", "word", "spell", "backwards", "what", "is", "reversed", "write", "can", "you",
            "spelled"}
    for t in _turns("reverse", 22):
        q = t.question
        (m,) = [m for m in re.finditer(r"[a-z]+", q.lower()) if m.group() not in stop]
        word = m.group()
        for where, text in _texts(t):
            assert_copied(tok, q, m.start() - 1, m.end(), text, f"reverse {where}: the word")
        answer = re.search(r"\*\*([a-z]+)\*\*", t.response)
        assert answer and answer.group(1) == word[::-1], t.response
        for e in tasks.EFFORTS:
            assert_copied(tok, t.response, answer.start(1), answer.end(1), t.reasoning[e],
                          f"reverse reasoning[{e}]: the reversed word the answer gives")


def test_repeat_copies_the_sentence_with_the_questions_ids(tok: Tokenizer) -> None:
    for t in _turns("repeat", 23):
        q = t.question
        start = q.index(": ") + 1                     # the sentence with the space before it
        sentence = q[start + 1:]
        for e in tasks.EFFORTS:
            assert_copied(tok, q, start, len(q), t.reasoning[e], f"repeat reasoning[{e}]")
        # the answer is the sentence itself: the question's ids but for its first word's space
        assert t.response == t.response_for("off") == sentence
        asked, answered = span_ids(tok, q, start, len(q)), tok.encode_text(sentence)
        assert answered[1:] == asked[1:] and tok.decode(answered[:1]) == tok.decode(asked[:1]).lstrip(" "), q


def test_document_answers_quote_the_files_own_lines(tok: Tokenizer) -> None:
    for t in _turns("document", 24):
        head, ask = t.question.rsplit("\n\n", 1)         # the rendered file, the typed question
        rows = list(re.finditer(r"^(?:- )?([A-Z][A-Za-z ]*?)[:,] ?(\d+)$", head, re.M))
        named = [r for r in rows if r.group(1) in ask]
        used = sorted(named, key=lambda r: ask.find(r.group(1))) if named else rows
        assert len(used) == 2, t.question
        for r in used:
            # the line with the newline before it when that newline is an id of its own
            start = r.start() - 1 if whole_ids(tok, t.question, r.start() - 1, r.start()) else r.start()
            for where, text in _texts(t) + [("answer", t.response)]:
                assert_copied(tok, t.question, start, r.end(), text, f"document {where}: the line")


@pytest.mark.parametrize("task", ["add_2d", "sub_3d", "compare"])
def test_numbers_are_copied_digit_for_digit(tok: Tokenizer, task: str) -> None:
    # low and high effort work on the column digits alone; max restates the numbers
    for t in _turns(task, 25):
        for m in re.finditer(r"\d+", t.question):
            assert [tok.decode([i]) for i in span_ids(tok, t.question, m.start(), m.end())] == list(m.group())
            texts = [("reasoning[max]", t.reasoning["max"])]
            if task != "compare":
                texts.append(("answer[off]", t.response_for("off")))
            for where, text in texts:
                assert_copied(tok, t.question, m.start(), m.end(), text, f"{task} {where}: {m.group()}")


def test_copy_warmup_draws_words_letters_and_digits_and_nothing_else(tok: Tokenizer) -> None:
    pool = set(train.copy_pool(tok))
    for i in pool:
        piece = tok.token_bytes(i)
        bare = piece[1:] if piece.startswith(b" ") else piece
        assert bare.isascii() and bare.isalnum(), piece
    assert not any(tok.is_special(i) for i in pool)
    want = [" " + w for w in tasks.sentence_words() if len(w) > 2] + list("0123456789") + list("abcxyz") + [" r"]
    for text in want:
        (i,) = tok.encode_text(text)
        assert i in pool, text
    for text in ("\n", ".", ":", "**", " ("):
        assert not pool & set(tok.encode_text(text)), text


def test_copy_mix_draws_the_tasks_words_and_letters_and_never_digits(tok: Tokenizer) -> None:
    pool = set(train.task_copy_pool(tok))
    assert pool and not any(tok.is_special(i) for i in pool)
    want = ([" " + w for w in tasks.sentence_words() if len(w) > 2] + list("abcxyz") + [" r"]
            + [" " + w for label in tasks.DOC_LABELS for w in label.split()])
    for text in want:
        (i,) = tok.encode_text(text)
        assert i in pool, text
    # digits are copied by position inside the column lines; the scaffolding is not copied
    for text in list("0123456789") + [" 7", "\n", ":", "**", " file", " column", " carry"]:
        assert not pool & set(tok.encode_text(text)), text


def test_copy_words_only_leaves_out_the_single_letters(tok: Tokenizer) -> None:
    """--copy-words-only: the same pool less every letter that is not itself a task word."""
    full, words = set(train.task_copy_pool(tok)), set(train.task_copy_pool(tok, letters=False))
    assert words < full
    kept = set(tasks.sentence_words()) | {w for label in tasks.DOC_LABELS for w in label.split()}
    for text in [" " + w for w in tasks.sentence_words() if len(w) > 2]:
        (i,) = tok.encode_text(text)
        assert i in words, text
    for letter in tasks.LETTERS:
        if letter in kept or letter.upper() in kept:
            continue
        for text in (letter, " " + letter):
            ids = tok.encode_text(text)
            assert len(ids) != 1 or ids[0] not in words, text
    for i in full - words:          # only single letters were dropped
        piece = tok.token_bytes(i).strip()
        assert len(piece) == 1 and piece.isalpha(), piece


def test_recall_rows_ask_for_a_files_own_lines_tokenized_as_the_file_has_them(tok: Tokenizer) -> None:
    """--recall-mix: each asked line is a line of the file (read off the file text by regex),
    and its label part then its figure part encode to the ids of that line in the file, so
    the figure the row trains on is the file's own ids, as a document answer quotes them."""
    rng = random.Random(0x4EC)
    kinds, counts = set(), set()
    for _ in range(300):
        text, asked = tasks.recall_row(rng)
        lines = {m.group(0): m for m in re.finditer(r"^(?:- )?[A-Z][A-Za-z ]*?[:,] ?\d+$", text, re.M)}
        counts.add(len(lines))
        assert 1 <= len(asked) <= len(lines)
        assert len({h for h, _ in asked}) == len(asked), asked          # no line asked twice
        for head, tail in asked:
            assert tail.endswith("\n") and re.fullmatch(r"(?:: |,)\d+\n", tail), tail
            line = head + tail[:-1]
            assert line in lines, (line, text)
            kinds.add(tail[0])
            m = lines[line]
            ids = tok.encode_text(head) + tok.encode_text(tail[:-1])
            assert ids == span_ids(tok, text, m.start(), m.end()), (line, text)
    assert kinds == {":", ","} and counts == {2, 3, 4, 5, 6}


def test_recall_rows_never_hold_a_held_out_questions_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """The file of every held-out document question (eval_conversation's, read off its key)
    is one the recall rows refuse, and no row drawn is such a file."""
    held = set()
    for mode in tasks.MODES:
        rng = random.Random(7)
        for _ in range(40):
            key = tasks.eval_conversation(rng, "document", mode).turns[0].key
            _, name, *rows, _ = key.split(":")
            pairs = [(r.split("=")[0], int(r.split("=")[1])) for r in rows]
            assert tasks._file_of_held_out_question(name, pairs), key
            held.add((name, tuple(pairs)))
    # every file a row is drawn on is checked, and only the files that pass are given
    checked: list[tuple[str, tuple[tuple[str, int], ...], bool]] = []
    real = tasks._file_of_held_out_question

    def spy(name: str, rows: list[tuple[str, int]]) -> bool:
        checked.append((name, tuple(rows), real(name, rows)))
        return checked[-1][2]

    monkeypatch.setattr(tasks, "_file_of_held_out_question", spy)
    rng, refused = random.Random(8), 0
    for _ in range(2000):
        checked.clear()
        text, _ = tasks.recall_row(rng)
        name, rows, bad = checked[-1]
        assert not bad and text == tasks._doc_text(name, list(rows))
        assert (name, rows) not in held
        refused += sum(b for _, _, b in checked[:-1])
    assert refused > 100          # short files often could be a held-out question's, and are redrawn
