"""The demo model's training text: tasks, the held-out split, rendering and the tokenizer.

Expected answers here are computed from the question text alone (regex + Python), never
taken from the generator under test.
"""
from __future__ import annotations

import collections
import random
import re

import pytest

from k3chat import template
from k3chat.demo import corpus, tasks
from k3chat.tokenizer import Tokenizer


def _independent_answer(task: str, question: str) -> str:
    nums = [int(x) for x in re.findall(r"\d+", question)]
    if task.startswith("add"):
        return str(nums[0] + nums[1])
    if task.startswith("sub"):
        a, b = nums
        if question.startswith("Subtract"):
            a, b = b, a                         # "Subtract B from A"
        return str(a - b)
    if task == "compare":
        pick = max if ("larger" in question or "bigger" in question or "greater" in question
                       or "more" in question) else min
        return str(pick(nums))
    if task == "count":
        word = re.search(r"(?:in the word|word|in) ([a-z]+)", question).group(1)
        letter = re.search(r"(?:many|letter|Count the|times is) ([a-z])(?:'s|s)?\b", question).group(1)
        return str(word.count(letter))
    if task == "reverse":
        stop = {"reverse", "the", "word", "spell", "backwards", "what", "is", "reversed", "write", "can",
                "you", "spelled"}
        (word,) = [w for w in re.findall(r"[a-z]+", question.lower()) if w not in stop]
        return word[::-1]
    if task == "repeat":
        return question.split(": ", 1)[1]
    if task == "document":
        return _document_answer(question)
    raise AssertionError(task)


def _document_answer(message: str) -> str:
    """Read the attached file's figures and the question after the block, as a person would."""
    head, ask = message.rsplit("\n\n", 1)
    figures = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(?:- )?([A-Z][A-Za-z ]*?)[:,] ?(\d+)$", head, re.M)}
    named = sorted((ask.find(label), value) for label, value in figures.items() if label in ask)
    a, b = [v for _, v in named] if named else list(figures.values())
    minus = any(w in ask for w in ("minus", "difference", "Subtract", "more is", " - "))
    return str(a - b if minus else a + b)


@pytest.mark.parametrize("task", [t for t in tasks.SINGLE_TASKS if t not in ("about", "other")])
def test_every_answer_is_right_by_an_independent_computation(task: str) -> None:
    rng = random.Random(3)
    maker = tasks.SINGLE_TASKS[task][1]
    for _ in range(150):
        _, make = maker(rng)
        t = make()
        want = _independent_answer(task, t.question)
        assert t.accept == (want,), (t.question, t.accept)
        assert tasks.is_correct(t, t.response), (t.question, t.response)
        assert tasks.is_correct(t, t.response_for("off")), (t.question, t.response_for("off"))
        assert want in t.reasoning["high"].replace(", ", "").replace(" ", "") or task in ("count", "repeat", "compare")


def test_thinking_off_answers_show_their_steps_before_the_result() -> None:
    rng = random.Random(9)
    for task in ("add_2d", "add_3d", "sub_2d", "sub_3d"):
        for _ in range(100):
            _, make = tasks.SINGLE_TASKS[task][1](rng)
            t = make()
            off = t.response_for("off")
            head, steps, result = off.split("\n\n")
            a, b = (int(x) for x in re.findall(r"\d+", t.question))
            if t.question.startswith("Subtract"):
                a, b = b, a
            top, bottom = (a, b) if task.startswith("add") or a >= b else (b, a)
            op = "+" if task.startswith("add") else "-"
            assert head == f"{a} {op} {b} by columns:", off
            assert steps.startswith("- ") and "**" not in steps, off
            lines = [ln for ln in steps.splitlines() if "negate" not in ln]   # a < b: one line first
            x, y = top % 10, bottom % 10
            assert lines[0].startswith((f"- {x} {op} {y} =", f"- {x + 10} - {y} =")), off
            assert len(lines) >= len(str(top)), off                          # one line per column
            assert result == f"{a} {op} {b} = **{_independent_answer(task, t.question)}**.", off
    _, make = tasks.follow_up(rng, 24, "k")     # a follow-up starts from the previous answer
    assert make().response_for("off").startswith("24 ")


def test_repeat_reasoning_copies_the_sentence_and_reverse_numbers_its_letters() -> None:
    rng = random.Random(10)
    for _ in range(50):
        t = tasks.repeat_sentence(rng)[1]()
        sentence = _independent_answer("repeat", t.question)
        for effort in tasks.EFFORTS:
            assert sentence in t.reasoning[effort], (effort, t.reasoning[effort])
        assert t.response_for("off") == sentence
        r = tasks.reverse_word(rng)[1]()
        word = _independent_answer("reverse", r.question)[::-1]
        n = len(word)
        for effort in tasks.EFFORTS:
            # read back by number from the last, then the reversed word on a line of its own
            assert f" {n}{word[-1]} {n - 1}{word[-2]} " in r.reasoning[effort], r.reasoning[effort]
            assert r.reasoning[effort].endswith("\n" + word[::-1]), r.reasoning[effort]
        assert r.response_for("off").endswith(r.response)


def test_follow_ups_use_the_previous_answer() -> None:
    rng = random.Random(4)
    for _ in range(200):
        prev = rng.randint(0, 999)
        _, make = tasks.follow_up(rng, prev, "k")
        t = make()
        n = int(re.findall(r"\d+", t.question)[0])
        want = prev + n if ("add" in t.question.lower() or "plus" in t.question) else prev - n
        assert t.accept == (str(want),), t.question
        assert f"previous answer was {prev}" in t.reasoning["high"]


def test_reasoning_length_follows_the_effort() -> None:
    rng = random.Random(5)
    for name, (_, maker) in tasks.SINGLE_TASKS.items():
        for _ in range(20):
            _, make = maker(rng)
            r = make().reasoning
            assert len(r["low"]) < len(r["high"]) < len(r["max"]), (name, r)


def test_training_never_sees_a_held_out_key_and_evaluation_only_sees_them() -> None:
    rng = random.Random(6)
    train_keys = {t.key for _ in range(3000) for t in tasks.training_conversation(rng).turns}
    assert train_keys and not any(tasks.held_out(k) for k in train_keys)
    ev = random.Random(7)
    for task in tasks.EVAL_TASKS:
        for mode in tasks.MODES:
            conv = tasks.eval_conversation(ev, task, mode)
            scored = conv.turns[conv.scored[-1]]
            assert tasks.held_out(scored.key) and scored.key not in train_keys
            assert scored.task == task
    # the split is a fixed rule of the key: about one in ten held out
    share = sum(tasks.held_out(f"add_2d:{a}:{b}") for a in range(10, 100) for b in range(10, 100)) / 8100
    assert 0.07 < share < 0.13


def test_answers_are_extracted_strictly() -> None:
    t = tasks.Turn("add_2d", "k", "q", {}, "", ("83",))
    assert tasks.is_correct(t, "36 + 47 = **83**.")
    assert not tasks.is_correct(t, "36 + 47 = 83.")          # no bold answer
    assert not tasks.is_correct(t, "**84**, or **83**")      # the first bold counts
    w = tasks.Turn("repeat", "k", "q", {}, "", ("the fox.",), extract="whole")
    assert tasks.is_correct(w, "the fox.") and not tasks.is_correct(w, "the fox")


@pytest.fixture(scope="module")
def demo_tok() -> Tokenizer:
    from k3chat.demo import model_dir

    path = model_dir()
    if not (path / "tiktoken.model").is_file():
        pytest.fail(f"the shipped demo model is missing at {path}")
    return Tokenizer.from_dir(path)


def test_shipped_tokenizer_keeps_digits_apart_and_has_k3_specials(demo_tok: Tokenizer) -> None:
    for n in (7, 42, 305, 1998):
        assert [demo_tok.decode([i]) for i in demo_tok.encode_text(str(n))] == list(str(n))
    n = demo_tok.n_ranks
    for offset, name in ((0, "[BOS]"), (1, "[EOS]"), (2, "<|end_of_msg|>"), (3, "<|open|>"),
                         (4, "<|close|>"), (5, "<|sep|>"), (255, "[PAD]")):
        assert demo_tok.special_id(name) == n + offset
    # learned on the training text: its words are single tokens
    for word in (" column", " answer", " letter", "think"):
        assert len(demo_tok.encode_text(word)) == 1, word


def test_training_rows_mask_exactly_the_assistant_turns(demo_tok: Tokenizer) -> None:
    rng = random.Random(8)
    grammar = template.Grammar(demo_tok)
    for _ in range(60):
        conv = tasks.training_conversation(rng)
        ids, mask = corpus.encode_conversation(conv, demo_tok)
        spans, start = [], None
        for i, m in enumerate(mask + [False]):
            if m and start is None:
                start = i
            elif not m and start is not None:
                spans.append((start, i))
                start = None
        assert len(spans) == len(conv.turns)
        for (a, b), turn, i in zip(spans, conv.turns, range(len(conv.turns))):
            assert ids[:a] == corpus.prompt_ids(conv, i, demo_tok)   # what the app would feed
            thinking, _ = tasks.thinking_of(conv.mode)
            parsed = grammar.parse_strict(ids[a:b], thinking)        # a well-formed turn, end id last
            assert parsed.content == turn.response_for(conv.mode)
            assert parsed.reasoning == (turn.reasoning[conv.mode] if thinking else None)


def _larger_by_places(a: int, b: int) -> tuple[str, int, int] | None:
    """(place, digit of a, digit of b) where a and b first differ from the highest place, for
    numbers of the same length; computed here from the strings, not by the generator."""
    names = ("Ones", "Tens", "Hundreds", "Thousands")
    sa, sb = str(a), str(b)
    for i in range(len(sa)):
        if sa[i] != sb[i]:
            return names[len(sa) - 1 - i], int(sa[i]), int(sb[i])
    return None


def test_the_default_text_style_writes_no_sign_verdict() -> None:
    """The shipped model's text: a difference states no place-by-place verdict, and a >= b has
    no sign line at all (so `train-demo` with no text options reproduces it)."""
    assert tasks.current_style() == tasks.TextStyle()
    for a, b in ((706, 343), (197, 454), (3, 3)):
        reasoning, _, off = tasks._arith_reasoning(a, "-", b)
        for text in list(reasoning.values()) + [off]:
            assert " vs " not in text and ">=" not in text and "same number" not in text, text


def test_sign_by_places_decides_a_difference_sign_from_the_places() -> None:
    rng = random.Random(12)
    pairs = [(706, 343), (197, 454), (3, 3), (2, 3), (410, 8), (8, 410), (55, 57), (999, 990)]
    pairs += [(rng.randint(0, 999), rng.randint(0, 999)) for _ in range(300)]
    with tasks.text_style(tasks.TextStyle(sign_by_places=True)):
        for a, b in pairs:
            reasoning, r, off = tasks._arith_reasoning(a, "-", b)
            assert r == a - b
            big, small = max(a, b), min(a, b)
            if a == b:
                verdict = f"{a} and {b} are the same number."
            elif len(str(a)) != len(str(b)):
                verdict = f"has {('Ones', 'Tens', 'Hundreds')[len(str(big)) - 1]} and {small} does not, so {big} is larger."
            else:
                place, da, db = _larger_by_places(a, b)
                verdict = f"{place}: {da} vs {db}, so {big} is larger."
            sign = f"{a} >= {b}" if a >= b else f"{a} < {b}, so compute {b} - {a} and negate."
            said = {"low": sign, "high": f"{a} >= {b}, so the result is not negative." if a >= b
                    else f"{a} is smaller than {b}, so the result is negative."}
            said["max"] = said["high"]
            for effort, text in reasoning.items():
                lines = text.splitlines()
                v = next(i for i, ln in enumerate(lines) if ln.endswith(verdict))
                assert lines[v + 1].startswith(said[effort]), (effort, text)
            steps = off.split("\n\n")[1].splitlines()
            v = next(i for i, ln in enumerate(steps) if ln.endswith(verdict))
            assert steps[v + 1].startswith("- " + sign), off
            assert off.endswith(f"= **{a - b}**.")


def test_a_moved_task_mix_changes_which_tasks_are_drawn() -> None:
    def tasks_drawn(style: tasks.TextStyle) -> set[str]:
        rng = random.Random(8)
        with tasks.text_style(style):
            return {t.task for _ in range(1500) for t in tasks.training_conversation(rng).turns}
    assert "repeat" in tasks_drawn(tasks.TextStyle())
    moved = tasks_drawn(tasks.TextStyle(weights=(("repeat", 0.0), ("reverse", 0.0))))
    assert "repeat" not in moved and "reverse" not in moved and "count" in moved
    assert tasks.current_style() == tasks.TextStyle()     # the block restored the default


def test_off_share_sets_how_often_thinking_is_off() -> None:
    """--off-share F draws thinking off for a share F of the training conversations and the
    three efforts alike for the rest; without it each of the four modes is a quarter."""
    def modes_drawn(style: tasks.TextStyle) -> list[str]:
        rng = random.Random(9)
        with tasks.text_style(style):
            return [tasks.training_conversation(rng).mode for _ in range(2000)]
    default = modes_drawn(tasks.TextStyle())
    assert all(abs(default.count(m) / 2000 - 0.25) < 0.04 for m in ("low", "high", "max", "off")), default
    half = modes_drawn(tasks.TextStyle(off_share=0.5))
    assert abs(half.count("off") / 2000 - 0.5) < 0.04
    assert all(abs(half.count(m) / 2000 - 0.5 / 3) < 0.04 for m in ("low", "high", "max"))


def _count_question(question: str) -> tuple[str, str]:
    """(letter, word) read from a counting question by regex, not by the generator."""
    m = (re.search(r"How many (\w)'s are in (\w+)\?", question)
         or re.search(r"letter (\w) appear in (\w+)\?", question))
    if m:
        return m.group(1), m.group(2)
    m = (re.search(r"Count the (\w)'s in (\w+)\.", question) or re.search(r"is (\w) in the word (\w+)\?", question)
         or re.search(r"how many (\w) in (\w+)\?", question))
    if m:
        return m.group(1), m.group(2)
    m = re.search(r"In the word (\w+), how many (\w)'s", question)
    assert m, question
    return m.group(2), m.group(1)


def test_count_decisions_write_a_verdict_on_every_spelled_line() -> None:
    """Every spelled letter is followed by its own decision; the running number of a yes is
    the count of c up to that letter, and the last one is the answer (computed here)."""
    rng = random.Random(21)
    seen_no_match = False
    with tasks.text_style(tasks.TextStyle(count_decisions=True)):
        for _ in range(300):
            _, make = tasks.count_letter(rng)
            t = make()
            c, w = _count_question(t.question)
            want = [f"{ch}: yes ({w[:i + 1].count(c)})" if ch == c else f"{ch}: no" for i, ch in enumerate(w)]
            for effort, text in t.reasoning.items():
                lines = text.splitlines()
                assert lines[0] == f"Spell {w}, count {c}:", text
                assert lines[1:1 + len(w)] == want, (effort, text)
            assert t.off_response.startswith(t.reasoning["low"])
            assert t.reasoning["low"].endswith(f"So {w.count(c)}.")
            seen_no_match |= c not in w
    assert seen_no_match
    # the default text (the shipped model's) writes the bare letter and marks only matches
    assert tasks._letter_lines("beetle", "e") == "b\ne (1)\ne (2)\nt\nl\ne (3)"


def test_count_letter_alone_writes_the_letter_on_its_own_line_as_the_spelled_letters_are() -> None:
    """The counted letter gets a line of its own before the spelling, so its id is the spelled
    letters' (after a newline), not the question's " c"; the spelled block is the default's."""
    rng = random.Random(22)
    with tasks.text_style(tasks.TextStyle(count_letter_alone=True)):
        for _ in range(200):
            _, make = tasks.count_letter(rng)
            t = make()
            c, w = _count_question(t.question)
            want = [f"{ch} ({w[:i + 1].count(c)})" if ch == c else ch for i, ch in enumerate(w)]
            for effort, text in t.reasoning.items():
                lines = text.splitlines()
                assert lines[:3] == ["Count this letter:", c, f"Spell {w}:"], (effort, text)
                assert lines[3:3 + len(w)] == want, (effort, text)
            assert t.reasoning["low"].endswith(f"So {w.count(c)}.")
    with tasks.text_style(tasks.TextStyle()):
        _, make = tasks.count_letter(random.Random(22))
        assert make().reasoning["low"].startswith("Spell ")      # the default header is unchanged


def _document_turns(style: tasks.TextStyle, seed: int, n: int = 200) -> list[tasks.Turn]:
    """n questions about a file, written in ``style`` (the same questions for every style)."""
    rng = random.Random(seed)
    turns = []
    for _ in range(n):
        with tasks.text_style(style):
            _, make = tasks.document(rng)
            turns.append(make())
    return turns


def test_doc_labels_first_names_the_asked_labels_before_quoting_the_file() -> None:
    """With --doc-labels-first a question about a file is answered by first naming the labels
    it asks for (as the question writes them, when it does) and then the file's lines with
    those labels; the question, the answer and the default text are unchanged."""
    named = generic = 0
    for style in (tasks.TextStyle(), tasks.TextStyle(doc_labels_first=True)):
        for t in _document_turns(style, 23):
            q = t.question.rsplit("\n", 1)[-1]         # the question follows the attached file
            for effort, text in t.reasoning.items():
                lines = text.splitlines()
                if not style.doc_labels_first:
                    assert lines[0] == "The lines in the file" and "asks for" not in text, text
                    continue
                assert lines[1] == "The lines in the file", (effort, text)
                quoted = [re.split(r"[,:]", line.removeprefix("- "))[0] for line in lines[2:4]]
                m = re.fullmatch(r"The question asks for (.+) and (.+)\.", lines[0])
                if m:
                    named += 1
                    assert list(m.groups()) == quoted and all(label in q for label in quoted), (q, text)
                else:
                    generic += 1
                    assert lines[0] == "The question asks for the two numbers in the file.", text
                    assert not any(label in q for label in tasks.DOC_LABELS), (q, text)
    assert named and generic


def test_doc_walk_copies_the_file_in_order_and_marks_the_asked_lines() -> None:
    """With --doc-walk a question about a file is worked by copying every figure line of the
    file in the file's order (read here from the question's attachment), marking the line the
    question names first "first" and the other asked one "second" (the file's order when the
    question names none), then "So a op b." with those lines' figures; the default is unchanged."""
    line_re = re.compile(r"(?:- )?([A-Z][a-z]*(?: [AB])?)[,:] ?(\d+)")
    named = generic = 0
    for style in (tasks.TextStyle(), tasks.TextStyle(doc_walk=True)):
        for t in _document_turns(style, 29):
            body = t.question.split("====\n", 1)[1].split("\n==== end of attachment", 1)[0]
            file_lines = [ln for ln in body.splitlines() if line_re.fullmatch(ln)]
            q = t.question.rsplit("\n", 1)[-1]
            asked = sorted((q.find(m.group(1)), m.group(1)) for ln in file_lines
                           if (m := line_re.fullmatch(ln)) and re.search(rf"\b{m.group(1)}\b", q))
            for effort, text in t.reasoning.items():
                if not style.doc_walk:
                    assert text.startswith("The lines in the file\n") and "line by line" not in text, text
                    continue
                head, rest = text.split("\nSo ", 1)
                lines = head.splitlines()
                assert lines[0] == "The file, line by line:", text
                walk = lines[1:]
                assert [ln.split(" is the ")[0] for ln in walk] == file_lines, (body, text)
                first = [ln.split(" is the ")[0] for ln in walk if ln.endswith(" is the first number.")]
                second = [ln.split(" is the ")[0] for ln in walk if ln.endswith(" is the second number.")]
                assert len(first) == len(second) == 1 and len(walk) - 2 == sum(" is the " not in ln for ln in walk)
                (fa,), (fb,) = first, second
                if asked:
                    named += 1
                    assert [label for _, label in asked] == [line_re.fullmatch(fa)[1], line_re.fullmatch(fb)[1]], (q, text)
                else:
                    generic += 1
                    assert (fa, fb) == tuple(file_lines[:2]), (q, text)
                a, b = int(line_re.fullmatch(fa)[2]), int(line_re.fullmatch(fb)[2])
                op = "-" if re.search(r"minus|difference|[Ss]ubtract|more| - ", q) else "+"
                assert rest.startswith(f"{a} {op} {b}."), text
                assert f"= **{a + b if op == '+' else a - b}**" in t.response, (q, t.response)
    assert named and generic


def test_doc_any_order_asks_in_either_order_and_quotes_each_label_with_its_own_figure() -> None:
    """With --doc-any-order a question about a file names its labels in either order, about a
    file of 2 to 4 lines, and the reasoning quotes each asked label with that label's figure as
    the file (read here from the question's attachment) gives it; a question that names no label
    only asks about a 2-line file in its order. A training-side sum is never a held-out sum
    asked the other way round, and the default text keeps the file's order for 2-line sums."""
    line_re = re.compile(r"(?:- )?([A-Z][a-z]*(?: [AB])?)[,:] ?(\d+)")
    seen: dict[bool, collections.Counter[tuple[int, bool]]] = {}
    for style in (tasks.TextStyle(), tasks.TextStyle(doc_any_order=True)):
        counts: collections.Counter[tuple[int, bool]] = collections.Counter()
        for t in _document_turns(style, 31, 400):
            body = t.question.split("====\n", 1)[1].split("\n==== end of attachment", 1)[0]
            figures = {m[1]: int(m[2]) for ln in body.splitlines() if (m := line_re.fullmatch(ln))}
            order = list(figures)
            q = t.question.rsplit("\n", 1)[-1]
            quoted = t.reasoning["low"].splitlines()[1:3]
            (x, a), (y, b) = [(m[1], int(m[2])) for m in map(line_re.fullmatch, quoted) if m]
            assert (a, b) == (figures[x], figures[y]), (body, q, quoted)
            named = x in q and y in q
            if named:
                assert q.find(x) < q.find(y), (q, quoted)       # quoted in the question's order
            else:
                assert len(order) == 2 and (x, y) == tuple(order), (body, q, quoted)
            counts[len(order), order.index(x) < order.index(y)] += 1
            if style.doc_any_order and "+" in t.key.rsplit(":", 1)[1]:
                head = t.key.rsplit(":", 1)[0]
                if not tasks.held_out(t.key):
                    assert not tasks.held_out(f"{head}:{y}+{x}"), t.key
        seen[style.doc_any_order] = counts
    default, any_order = seen[False], seen[True]
    assert not any(n == 4 for n, _ in default) and any_order[4, True] and any_order[4, False]
    # the default names a 2-line file's labels in the file's order three times in four; here half
    assert default[2, True] > 2 * default[2, False]
    assert 0.35 < any_order[2, False] / (any_order[2, False] + any_order[2, True]) < 0.65


def test_document_file_kind_counts_lines_and_whether_the_file_order_answers() -> None:
    """eval-demo's split of questions about a file: worked by hand on keys, then checked against
    the held-out questions themselves, read from the attached file and the expected answer."""
    assert tasks.document_file_kind("document:a.txt:Apples=34:Pears=12:Apples+Pears") == (2, True)
    assert tasks.document_file_kind("document:a.txt:Apples=34:Pears=12:Pears+Apples") == (2, True)
    assert tasks.document_file_kind("document:a.txt:Apples=3:Pears=12:Pears-Apples") == (2, False)
    assert tasks.document_file_kind("document:data.csv:Orders=72:Costs=47:Blue=3:Costs-Blue") == (3, False)
    assert tasks.document_file_kind("document:s.md:Team A=5:Red=9:Blue=4:Red+Team A") == (3, True)
    assert tasks.document_file_kind("document:s.md:Team A=5:Red=9:Blue=4:Red+Blue") == (3, False)
    line_re = re.compile(r"(?:- )?([A-Z][a-z]*(?: [AB])?)[,:] ?(\d+)")
    rng = random.Random(41)
    kinds: collections.Counter[tuple[int, bool]] = collections.Counter()
    for _ in range(300):
        t = tasks.eval_conversation(rng, "document", "low").turns[0]
        body = t.question.split("====\n", 1)[1].split("\n==== end of attachment", 1)[0]
        figures = [int(m[2]) for ln in body.splitlines() if (m := line_re.fullmatch(ln))]
        q = t.question.rsplit("\n", 1)[-1]
        minus = re.search(r"minus|difference|[Ss]ubtract|more| - ", q) is not None
        by_order = figures[0] - figures[1] if minus else figures[0] + figures[1]
        kind = tasks.document_file_kind(t.key)
        assert kind == (len(figures), by_order == t.value), (t.key, body, q)
        kinds[kind] += 1
    assert len(kinds) == 4       # every kind is asked


def test_off_steps_by_place_list_the_reasoning_column_lines_with_thinking_off() -> None:
    """With --off-steps-by-place a thinking-off sum or difference lists, line for line, the
    column lines its high reasoning writes; the result line is unchanged, and so is the
    default text (the compact list)."""
    for a, op, b in ((836, "-", 308), (32, "-", 61), (815, "+", 904), (7, "+", 5), (100, "-", 1)):
        r = a + b if op == "+" else a - b
        reasoning, _, plain = tasks._arith_reasoning(a, op, b)
        assert "Ones:" not in plain, plain
        with tasks.text_style(tasks.TextStyle(off_steps_by_place=True)):
            reasoning2, r2, off = tasks._arith_reasoning(a, op, b)
        assert reasoning2 == reasoning and r2 == r
        listed = [ln[2:] for ln in off.splitlines() if ln.startswith("- ")]
        columns = [ln for ln in reasoning["high"].splitlines() if ln.split(":")[0] in tasks.PLACES]
        assert columns and [ln for ln in listed if ln.split(":")[0] in tasks.PLACES] == columns, off
        assert off.endswith(f"{a} {op} {b} = **{r}**.") and plain.endswith(f"{a} {op} {b} = **{r}**.")


def test_count_decision_positions_are_the_ids_after_each_spelled_letter(demo_tok: Tokenizer) -> None:
    """--count-weight weighs these ids: after each spelled letter of a counting turn, " (" where
    the letter is the one asked for and a newline elsewhere. The letters are read back from
    the ids and checked against the word and letter the question names (regex), not against
    the generator's own lines; conversations without counting have none."""
    tok = demo_tok
    rng = random.Random(31)
    seen_count = seen_other = 0
    while seen_count < 40 or seen_other < 20:
        conv = tasks.training_conversation(rng)
        ids, mask = corpus.encode_conversation(conv, tok)
        pos = corpus.count_decision_positions(conv, tok)
        counting = [t for t in conv.turns if t.task == "count"]
        if not counting:
            assert pos == []
            seen_other += 1
            continue
        seen_count += 1
        asked = [_count_question(t.question.splitlines()[-1]) for t in counting]
        assert [tok.decode([ids[k - 1]]) for k in pos] == list("".join(w for _, w in asked)), conv.mode
        marks = [tok.decode([ids[k]]) for k in pos]
        want = [" (" if ch == c else "\n" for c, w in asked for ch in w]
        assert marks == want, (conv.mode, marks)
        assert all(mask[k] for k in pos)                 # only ids the model is trained to write
