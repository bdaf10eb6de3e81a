"""What the built-in demo model was trained to do, and how its answers are checked.

One generator serves the training text (``engine/train``), the held-out evaluation
(``k3chat eval-demo``) and the shipped prompt file, so the three can never drift apart.

Tasks: addition and subtraction of 1- to 3-digit numbers, comparing two numbers, counting a
letter in a word, reversing a word, repeating a sentence back, follow-up arithmetic on the
previous answer ("and add 7 to that"), questions about the model itself, and anything else
(answered with a polite statement of what it can do). Each turn carries step-by-step
reasoning for every thinking effort (low short, high longer, max longest) and one response.

Held-out split: every question has a key (the numbers of a sum, the word and letter of a
count, the sentence to repeat...). ``held_out(key)`` is a fixed hash test; training draws only
keys outside it and evaluation only keys inside it, so every evaluated question is one the
model never saw in training (for multi-turn, the follow-up's key is held out).

No torch and no Textual here: the chat core may import this module.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import random
import re
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

from k3chat.attachments import Attachment, kind_for, render_user_message

EFFORTS: tuple[str, ...] = ("low", "high", "max")
MODES: tuple[str, ...] = EFFORTS + ("off",)   # "off": thinking off
PLACES = ("Ones", "Tens", "Hundreds", "Thousands", "Ten thousands")
HELD_OUT_MOD = 10


@dataclass(frozen=True)
class TextStyle:
    """How the training text is written. The default is the text of the shipped demo's first
    run, bit for bit (its later runs add options: README's retrain command); the options are
    experiments of ``train-demo`` (they change the reasoning
    and the task mix, never an accepted answer; evaluation draws its questions in the default
    style, so it asks the same questions of every model)."""

    # subtraction first compares a and b place by place, in the very lines `compare` writes,
    # and states its sign from that verdict ("706 >= 343."), instead of a bare claim
    sign_by_places: bool = False
    # (task, weight) pairs that replace SINGLE_TASKS' weights for single-task conversations
    weights: tuple[tuple[str, float], ...] = ()
    # counting writes a decision on every spelled line ("c: no", "r: yes (2)"), so marking a
    # letter is never an optional insertion into a run that copies the word letter by letter
    count_decisions: bool = False
    # counting first writes the letter alone on its line ("Count this letter:\na\n"), the very
    # id the spelled lines use, so marking it is matching one id, not " a" against "a"
    # (measured: it did not help, counting 11%; README's train-demo row)
    count_letter_alone: bool = False
    # a question about a file first says which labels it asks for, copied from the question
    # (the demo shipped until 2026-12-06 quoted a wrong label, mostly "Team A", in all its wrong
    # answers about a file; the one after it mostly names the right labels and takes the wrong
    # figure), and only then quotes the file's lines with those labels
    doc_labels_first: bool = False
    # a question about a file is worked by reading the file's lines in the file's order, each
    # copied whole, the two asked for marked where they stand ("Red,1 is the second number."):
    # the wrong answers of the shipped model take a figure from the line at the quoted line's
    # place in file order, so a walk in file order is the order they already follow
    doc_walk: bool = False
    # a question about a file names its two labels in either order and its file has 2 to 4
    # lines: the default text names them in the file's order for three quarters of its 2-line
    # files (a sum always, a difference when the first figure is the larger), and the model
    # shipped until 2026-12-08 answered 91% of held-out 2-line questions where taking the figures
    # by the file's order gives the right answer, 49% of the others and 20% of 3-line files
    doc_any_order: bool = False
    # a thinking-off answer lists the thinking-on column lines ("Tens: 3 - 5 is below zero, so
    # borrow 10: 13 - 5 = 8. Write 8."): the digits come before the borrow, where the compact
    # list ("13 - 5 = 8, borrow 1.") makes that decision with its very first id
    off_steps_by_place: bool = False
    # the share of training conversations with thinking off (0: the default draw, one mode in
    # four, each mode alike); the weakest answers are thinking-off differences
    off_share: float = 0.0


_STYLE: ContextVar[TextStyle] = ContextVar("k3chat_demo_text_style", default=TextStyle())


def current_style() -> TextStyle:
    return _STYLE.get()


@contextlib.contextmanager
def text_style(style: TextStyle) -> Iterator[None]:
    """Generate training text in ``style`` inside the block."""
    token = _STYLE.set(style)
    try:
        yield
    finally:
        _STYLE.reset(token)


def held_out(key: str) -> bool:
    """True for the keys kept out of training (about one in ten), fixed forever."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "little") % HELD_OUT_MOD == 0


@dataclass(frozen=True)
class Turn:
    """One question and what the model should answer, for every thinking mode."""

    task: str
    key: str
    question: str
    reasoning: dict[str, str]       # effort -> reasoning text
    response: str                   # the answer text (also with thinking off)
    accept: tuple[str, ...]         # acceptable extracted answers
    extract: str = "bold"           # "bold": the first **...** of the response; "whole": all of it
    value: int | None = None        # the numeric result, for follow-up questions
    # With thinking off the answer itself shows the steps (a short list, then the result):
    # a model this small cannot carry digits in its head from one id to the next.
    off_response: str | None = None

    def response_for(self, mode: str) -> str:
        return self.off_response if mode == "off" and self.off_response is not None else self.response


def extract_answer(turn: Turn, response: str) -> str:
    if turn.extract == "whole":
        return response.strip()
    m = re.search(r"\*\*(.+?)\*\*", response)
    return m.group(1).strip() if m else ""


def is_correct(turn: Turn, response: str) -> bool:
    return extract_answer(turn, response) in turn.accept


# ----------------------------------------------------------------------------- words

WORDS: tuple[str, ...] = tuple("""
apple banana cherry grape lemon mango melon orange peach pear plum berry strawberry
planet rocket comet star moon sun galaxy orbit earth mars venus
house garden window door table chair kitchen pillow blanket carpet mirror
river ocean island forest meadow valley mountain desert canyon lake pond
tiger lion zebra horse rabbit monkey turtle parrot eagle falcon dolphin whale shark
spider beetle butterfly kitten puppy donkey camel giraffe penguin squirrel
pencil paper button bottle basket bucket candle hammer ladder needle rubber
yellow purple silver golden orange violet
music guitar piano violin trumpet drum flute rhythm melody
winter summer spring autumn morning evening midnight tomorrow yesterday
bread butter cheese cookie pepper carrot potato tomato onion garlic noodle pizza
doctor farmer teacher pilot sailor painter baker driver singer writer
happy simple quiet gentle clever brave strong little bright
coffee cotton copper pocket rocket jacket ticket bubble puzzle riddle
school market office station library museum theater hospital castle bridge
computer keyboard printer network signal battery cable engine wheel
mississippi banana committee balloon coffee bookkeeper assessment parallel
bottle tomorrow success address illness recess occurrence
""".split())
WORDS = tuple(dict.fromkeys(WORDS))  # unique, in a fixed order
LETTERS = "abcdefghijklmnopqrstuvwxyz"

# The words of the sentences to repeat: none is a word that is spelled, counted in or reversed
# (WORDS, or a reversal of one), so the tokenizer gives each its own whole-word id and a
# sentence is a short run of ids to copy, not 30 letters.
_ADJ = ("quick", "brown", "lazy", "small", "dark", "sweet", "old", "new", "red", "blue",
        "green", "tiny", "big", "cold", "warm", "soft", "loud", "calm", "wild", "proud")
_NOUN = ("fox", "dog", "cat", "bird", "boat", "tree", "hat", "car", "book", "child", "friend",
         "king", "ship", "train", "cloud", "box", "city", "road", "song", "cup", "lamp")
_VERB = ("jumps over", "runs past", "looks at", "sings to", "waits for", "walks by", "finds",
         "follows", "sees", "likes", "paints", "reads", "carries", "watches", "hears")
_ADV = ("today", "again", "slowly", "at night", "after lunch", "every day", "quietly", "now")


def puzzle_words() -> frozenset[str]:
    """Every word a puzzle spells: counted in or reversed. These stay one letter per id."""
    return frozenset(WORDS)


def sentence_words() -> frozenset[str]:
    """The words of the sentences to repeat (whole ids; disjoint from the puzzle words)."""
    words: set[str] = set()
    for group in (_ADJ, _NOUN, _VERB, _ADV):
        for phrase in group:
            words.update(phrase.split())
    return frozenset(words)


def _sentence(rng: random.Random) -> str:
    pick = {"A": _ADJ, "N": _NOUN, "V": _VERB, "D": _ADV}
    pattern = ("the A N V the A N", "a N V the N D", "my N is A and A", "the N V my A N D")[rng.randrange(4)]
    s = " ".join(rng.choice(pick[w]) if w in pick else w for w in pattern.split())
    if rng.random() < 0.5:
        s = s[0].upper() + s[1:]
    return s + rng.choice((".", ".", "!", "?", ""))


# ----------------------------------------------------------------------- arithmetic


def _digits(n: int) -> list[int]:
    return [int(c) for c in reversed(str(n))]


def _add_lines(a: int, b: int) -> tuple[list[str], list[str], int]:
    """(high lines, low pieces, result) of a column addition from the ones up."""
    da, db = _digits(a), _digits(b)
    carry, high, low = 0, [], []
    for i in range(max(len(da), len(db))):
        x = da[i] if i < len(da) else 0
        y = db[i] if i < len(db) else 0
        s = x + y + carry
        expr = f"{x} + {y}" + (" + 1" if carry else "")
        if s >= 10:
            high.append(f"{PLACES[i]}: {expr} = {s}. Write {s - 10}, carry 1.")
            low.append(f"{expr} = {s}, carry 1.")
            carry = 1
        else:
            high.append(f"{PLACES[i]}: {expr} = {s}. Write {s}.")
            low.append(f"{expr} = {s}.")
            carry = 0
    if carry:
        i = max(len(da), len(db))
        high.append(f"{PLACES[i]}: the carry 1. Write 1.")
        low.append("carry 1.")
    return high, low, a + b


def _sub_lines(a: int, b: int) -> tuple[list[str], list[str], int]:
    """Column subtraction a - b for a >= b, from the ones up, with borrows."""
    da, db = _digits(a), _digits(b)
    borrow, high, low, written = 0, [], [], []
    for i in range(len(da)):
        x, y = da[i], (db[i] if i < len(db) else 0)
        expr = f"{x} - {y}" + (" - 1" if borrow else "")
        d = x - y - borrow
        if d < 0:
            d += 10
            big = f"{x + 10} - {y}" + (" - 1" if borrow else "")
            high.append(f"{PLACES[i]}: {expr} is below zero, so borrow 10: {big} = {d}. Write {d}.")
            low.append(f"{big} = {d}, borrow 1.")
            borrow = 1
        else:
            high.append(f"{PLACES[i]}: {expr} = {d}. Write {d}.")
            low.append(f"{expr} = {d}.")
            borrow = 0
        written.append(d)
    if len(written) > 1 and written[-1] == 0:
        high.append("Drop the leading zeros.")
    return high, low, a - b


def _place_verdict(x: int, y: int) -> list[str]:
    """Which of x and y is larger, decided place by place from the highest: the lines
    `compare` writes, and (with TextStyle.sign_by_places) the lines a difference's sign rests on."""
    big, small = max(x, y), min(x, y)
    sx, sy = str(x), str(y)
    if x == y:
        return [f"{x} and {y} are the same number."]
    if len(sx) != len(sy):
        return [f"{big} has {PLACES[len(str(big)) - 1]} and {small} does not, so {big} is larger."]
    lines = [f"Both go up to {PLACES[len(sx) - 1]}."]
    for i, (cx, cy) in enumerate(zip(sx, sy)):
        place = PLACES[len(sx) - 1 - i]
        if cx == cy:
            lines.append(f"{place}: {cx} and {cy} are the same.")
        else:
            lines.append(f"{place}: {cx} vs {cy}, so {big} is larger.")
            break
    return lines


def _arith_reasoning(a: int, op: str, b: int, *, lead: str = "") -> tuple[dict[str, str], int, str]:
    """Reasoning for a op b (a, b >= 0) at each effort, the result, and the answer with
    thinking off (the low steps as a list, then the bold result)."""
    if op == "+":
        high, low, r = _add_lines(a, b)
        intro_high = f"Add {a} and {b} column by column, from the ones."
        intro_max = (f"The task is {a} + {b}. I will add the two numbers column by column, starting "
                     f"with the ones and carrying when a column reaches 10.")
        tail = f"So {a} + {b} = {r}."
        neg_high = neg_low = ""
    else:
        if a >= b:
            high, low, r = _sub_lines(a, b)
            neg_high = neg_low = ""
            tail = f"So {a} - {b} = {r}."
        else:
            high, low, m = _sub_lines(b, a)
            r = -m
            neg_high = f"{a} is smaller than {b}, so the result is negative. Work out {b} - {a} instead."
            neg_low = f"{a} < {b}, so compute {b} - {a} and negate."
            tail = f"So {b} - {a} = {m}, and {a} - {b} = {r}."
        top, bottom = max(a, b), min(a, b)
        intro_high = f"Subtract {bottom} from {top} column by column, from the ones."
        intro_max = (f"The task is {a} - {b}. I will subtract column by column, starting with the "
                     f"ones and borrowing 10 when a column would go below zero.")
        if _STYLE.get().sign_by_places:
            # the sign follows from a place-by-place verdict, stated at every effort
            verdict = _place_verdict(a, b)
            neg_low = "\n".join(verdict + [neg_low or f"{a} >= {b}."])
            neg_high = "\n".join(verdict + [neg_high or f"{a} >= {b}, so the result is not negative."])
    read = f"Reading the written digits from the highest place down gives {abs(r)}."
    lead_sp = lead + "\n" if lead else ""
    reasoning = {
        # low writes the same column lines as high (a line per column, each digit written
        # down), without the plan and the restated sum: shorter, and one mechanism to learn
        "low": lead_sp + "\n".join(p for p in [neg_low] + high + [f"So {r}."] if p),
        "high": lead_sp + "\n".join(p for p in [neg_high, intro_high] + high + [tail] if p),
        "max": lead_sp + "\n".join(p for p in [intro_max, neg_high] + high + [read, tail] if p),
    }
    expr = f"{a} {op} {b}"
    steps = [p for p in neg_low.split("\n") + (high if _STYLE.get().off_steps_by_place else low) if p]
    return reasoning, r, _steps_answer(f"{expr} by columns:", steps, f"{expr} = **{r}**.")


def _steps_answer(head: str, steps: list[str], result: str) -> str:
    """A thinking-off answer: what it works out, its steps as a short Markdown list, the result."""
    return head + "\n\n" + "\n".join(f"- {p}" for p in steps) + "\n\n" + result


def _arith_response(a: int, op: str, b: int, r: int, rng: random.Random) -> str:
    style = rng.random()
    expr = f"{a} {op} {b}"
    if style < 0.6:
        return f"{expr} = **{r}**."
    if style < 0.8:
        return f"The answer is **{r}**."
    if style < 0.92 and op == "+":
        return f"**{r}**\n\n| | |\n|---|---|\n| first number | {a} |\n| second number | {b} |\n| sum | {r} |"
    return f"**{r}**\n\n- {expr}\n- result: {r}"


_ADD_Q = ("What is {a} + {b}?", "What's {a} plus {b}?", "Calculate {a} + {b}.", "{a} + {b} = ?",
          "Add {a} and {b}.", "How much is {a} + {b}?", "what is {a}+{b}", "Compute {a} + {b}.",
          "What is the sum of {a} and {b}?", "{a} plus {b}?")
_SUB_Q = ("What is {a} - {b}?", "What's {a} minus {b}?", "Subtract {b} from {a}.", "{a} - {b} = ?",
          "Calculate {a} - {b}.", "How much is {a} - {b}?", "what is {a}-{b}", "Compute {a} - {b}.",
          "What is {a} take away {b}?", "{a} minus {b}?")


def _rand_n(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)


def arithmetic(rng: random.Random, op: str, digits: int) -> tuple[str, Callable[[], Turn]]:
    a, b = _rand_n(rng, digits), _rand_n(rng, digits)
    if rng.random() < 0.3 and digits > 1:    # mixed widths: 47 + 8, 305 - 26
        b = _rand_n(rng, rng.randint(1, digits - 1))
        if rng.random() < 0.5 and op == "+":
            a, b = b, a
    if op == "-" and a < b and rng.random() < 0.75:
        a, b = b, a                          # mostly non-negative results
    name = ("add_" if op == "+" else "sub_") + f"{digits}d"
    key = f"{name}:{a}:{b}"

    def make() -> Turn:
        q = rng.choice(_ADD_Q if op == "+" else _SUB_Q).format(a=a, b=b)
        reasoning, r, off = _arith_reasoning(a, op, b)
        return Turn(name, key, q, reasoning, _arith_response(a, op, b, r, rng), (str(r),), value=r,
                    off_response=off)

    return key, make


# ----------------------------------------------------------------------------- compare

_CMP_Q = {
    "larger": ("Which is larger, {x} or {y}?", "Which number is bigger: {x} or {y}?",
               "Is {x} or {y} larger?", "Which is greater, {x} or {y}?", "Which is more, {x} or {y}?"),
    "smaller": ("Which is smaller, {x} or {y}?", "Which number is less: {x} or {y}?",
                "Is {x} or {y} smaller?"),
}


def compare(rng: random.Random) -> tuple[str, Callable[[], Turn]]:
    dx, dy = rng.randint(1, 3), rng.randint(1, 3)
    x = _rand_n(rng, dx)
    if rng.random() < 0.5:
        dy = dx
    y = _rand_n(rng, dy)
    if rng.random() < 0.25 and dx == dy and dx > 1:    # share the leading digit(s)
        y = int(str(x)[:-1] + str(rng.randint(0, 9)))
    if rng.random() < 0.03:
        y = x
    kind = "larger" if rng.random() < 0.65 else "smaller"
    key = f"compare:{x}:{y}:{kind}"

    def make() -> Turn:
        q = rng.choice(_CMP_Q[kind]).format(x=x, y=y)
        big, small = max(x, y), min(x, y)
        ans = big if kind == "larger" else small
        # Each number is written by its places from the ones up, as the column sums read
        # them ("Ones 5, Tens 6"): the longer number is the one with a place the other lacks,
        # so no digit is counted, and the first sentence says which one is asked for.
        head = f"The {kind} of {x} and {y}."
        spelled = [f"{n}: " + ", ".join(f"{PLACES[i]} {d}" for i, d in enumerate(_digits(n))) + "."
                   for n in (x, y)]
        verdict = _place_verdict(x, y)
        if x != y and kind == "smaller":
            verdict.append(f"So {small} is smaller.")
        reasoning = {
            "low": "\n".join([head] + spelled + verdict),
            "high": "\n".join([head] + spelled + ["Compare the highest places first."] + verdict
                              + [f"So the answer is {ans}."]),
            "max": "\n".join([head, "I will write each number by its places from the ones up, then compare "
                                    "them from the highest place down."] + spelled + verdict
                             + [f"So the answer is {ans}."]),
        }
        if x == y:
            resp = f"They are equal: both are **{x}**."
        else:
            resp = rng.choice((f"**{ans}** is {kind}.", f"The {kind} number is **{ans}**.",
                               f"**{ans}** is {kind} than {small if kind == 'larger' else big}."))
        return Turn("compare", key, q, reasoning, resp, (str(ans),), value=ans,
                    off_response=f"{reasoning['low']}\n\n{resp}")

    return key, make


# ------------------------------------------------------------------------------ words

_COUNT_Q = ("How many {c}'s are in {w}?", "How many times does the letter {c} appear in {w}?",
            "Count the {c}'s in {w}.", "How many times is {c} in the word {w}?",
            "In the word {w}, how many {c}'s are there?", "how many {c} in {w}?")


def _letter_lines(w: str, c: str) -> str:
    """The word one letter per line, each letter the very id it has inside the word (after a
    newline a letter is bare, as inside a word; after a space it would be another id, " r").
    Each letter c gets its running count: "r (2)". With TextStyle.count_decisions every line
    says whether its letter is c: "a: no", "r: yes (2)"."""
    decide = _STYLE.get().count_decisions
    lines, n = [], 0
    for ch in w:
        if ch == c:
            n += 1
            lines.append(f"{ch}: yes ({n})" if decide else f"{ch} ({n})")
        else:
            lines.append(f"{ch}: no" if decide else ch)
    return "\n".join(lines)


def count_letter(rng: random.Random) -> tuple[str, Callable[[], Turn]]:
    w = rng.choice(WORDS)
    c = rng.choice(w) if rng.random() < 0.8 else rng.choice(LETTERS)
    key = f"count:{w}:{c}"

    def make() -> Turn:
        q = rng.choice(_COUNT_Q).format(c=c, w=w)
        n = w.count(c)
        times = f"{n} time{'s' if n != 1 else ''}"
        # " {w}" and " {c}" are written as the question writes them (after a space): same ids
        spelled = _letter_lines(w, c)
        # Every effort starts with the same header and spelled block, so all four modes train
        # the one mechanism; the efforts differ in how much they say after it.
        core = (f"Count this letter:\n{c}\nSpell {w}:\n{spelled}\n" if _STYLE.get().count_letter_alone
                else f"Spell {w}, count {c}:\n{spelled}\n")
        reasoning = {
            "low": core + f"So {n}.",
            "high": core + f"The letter {c} appears {times}.",
            "max": core + ((f"Each {c} got the next number as it came, and the last number is {n}.\n" if n
                            else f"No letter is {c}, so no line got a number.\n")
                           + f"So the letter {c} appears {times} in {w}."),
        }
        label = f"{c}'s" if n != 1 else c
        resp = rng.choice((f"There {'is' if n == 1 else 'are'} **{n}** {label} in {w}.",
                           f"The word {w} has **{n}** {label}.",
                           f"**{n}**: the letter {c} appears {times} in {w}."))
        return Turn("count", key, q, reasoning, resp, (str(n),), value=n,
                    off_response=f"{reasoning['low']}\n\n{resp}")

    return key, make


_REV_Q = ("Reverse the word {w}.", "Spell {w} backwards.", "What is {w} reversed?", "Write {w} backwards.",
          "Can you reverse {w}?", "reverse {w}", "What is {w} spelled backwards?")


def reverse_word(rng: random.Random) -> tuple[str, Callable[[], Turn]]:
    w = rng.choice(WORDS)
    qi = rng.randrange(len(_REV_Q))
    key = f"reverse:{w}:{qi}"

    def make() -> Turn:
        rev = w[::-1]
        # Numbered letters, "1p 2l 3a": a digit keeps the letter after it bare, the id it has
        # inside the word, and reading back is a look-up of the number n-1, not a count of
        # positions. The reversed word is written at a line start (bare, as after "**").
        numbered = [f"{i}{c}" for i, c in enumerate(w, 1)]
        fwd, bwd = " ".join(numbered), " ".join(reversed(numbered))
        body = (f"Spell {w} and number the letters: {fwd}\nRead them from {len(w)} down to 1: {bwd}\n"
                f"Joined together:\n{rev}")
        low = f"Spell {w}: {fwd}\nBackwards: {bwd}\n{rev}"
        reasoning = {
            "low": low,
            "high": body,
            "max": (f"The task is to write the word {w} backwards. I will number its letters, read them "
                    f"from the last number down to 1 and join them.\n{body}"),
        }
        resp = rng.choice((f"The word {w} reversed is **{rev}**.", f"**{rev}**",
                           f"Backwards, {w} is **{rev}**."))
        return Turn("reverse", key, _REV_Q[qi].format(w=w), reasoning, resp, (rev,),
                    off_response=f"{low}\n\n{resp}")

    return key, make


_REPEAT_Q = ("Repeat after me: {s}", "Say this back to me exactly: {s}", "Please repeat: {s}",
             "Repeat this sentence: {s}", "Echo this: {s}", "repeat after me: {s}")


def repeat_sentence(rng: random.Random) -> tuple[str, Callable[[], Turn]]:
    s = _sentence(rng)
    key = f"repeat:{s}"

    def make() -> Turn:
        # The reasoning copies the sentence once, after ": " as the question has it and last (a
        # newline after it would join its final "?" into another id), so every id is the
        # question's; the answer then copies it from nearby, its first word bare.
        # (Copying in pieces would start each piece on a new line: another id for its word.)
        reasoning = {
            "low": f"Copy it exactly: {s}",
            "high": f"The user wants the sentence back exactly, word for word: {s}",
            "max": ("The user asks me to repeat a sentence. I should copy it exactly as given, keeping "
                    f"every word, the capital letters and the punctuation, and add nothing else. That is "
                    f"the whole answer: {s}"),
        }
        return Turn("repeat", key, rng.choice(_REPEAT_Q).format(s=s), reasoning, s, (s,), extract="whole")

    return key, make


# ------------------------------------------------------------------ about and other

ABOUT_ANSWERS: dict[str, str] = {
    "greeting": ("Hello! I'm the k3chat demo model: a tiny model in the Kimi K3 architecture, trained "
                 "on this computer. I can add and subtract numbers, compare two numbers, count a letter "
                 "in a word, reverse a word and repeat a sentence back. What would you like to try?"),
    "who": ("I'm the k3chat demo model, a tiny model in the Kimi K3 architecture (a few million "
            "parameters) trained on arithmetic and word puzzles. I am not the real Kimi K3: point "
            "k3chat at a Kimi K3 checkpoint directory for that."),
    "can": ("I'm a tiny demo, so I can only do a few things:\n\n"
            "- add and subtract numbers up to three digits, like **36 + 47**\n"
            "- say which of two numbers is larger\n"
            "- count a letter in a word\n"
            "- reverse a word\n"
            "- repeat a sentence back exactly\n\n"
            "I can also build on my last answer, as in \"and add 7 to that\"."),
    "other": ("Sorry, I can't help with that: I'm a tiny demo model that only knows arithmetic and a "
              "few word puzzles. Try \"What is 36 + 47?\", \"How many r's are in strawberry?\" or "
              "\"Reverse the word planet.\""),
}
_ABOUT_Q = {
    "greeting": ("Hello", "Hi", "Hey", "Hello there", "Good morning", "Good evening", "Hi there",
                 "Hello, how are you?", "hey there", "Greetings", "Howdy", "Good afternoon",
                 "Hi!", "Hello k3chat", "Hey, how's it going?", "Good day", "Hiya", "Morning",
                 "Hello, nice to meet you", "Hi, anyone there?"),
    "who": ("Who are you?", "What are you?", "Are you Kimi K3?", "Tell me about yourself.",
            "What model are you?", "who are you", "Introduce yourself.", "What is your name?",
            "Are you the real Kimi K3?", "Which model is this?", "Who am I talking to?",
            "Are you an AI?", "Who made you?", "What kind of model are you?", "Are you ChatGPT?",
            "What are you called?", "Describe yourself.", "Is this the real model?",
            "How big are you?", "Who are you exactly?"),
    "can": ("What can you do?", "What are you able to do?", "Help", "What can I ask you?",
            "what can you do", "What do you know?", "How can you help me?", "What tasks can you do?",
            "Show me what you can do.", "What are your skills?", "What can you help with?",
            "What should I ask?", "What are you good at?", "What do you do?", "List your abilities.",
            "How do I use you?", "What kinds of questions can you answer?", "What can I try?",
            "Give me some examples.", "What are you for?"),
}
_REASON_ABOUT = {
    "greeting": ("A greeting. Greet back and say what I can do.",
                 "The user is greeting me. I should greet them back and say briefly what I can do.",
                 "The user is greeting me. I am the k3chat demo model, so I should greet them back, "
                 "say honestly what I am, and list the few things I can do."),
    "who": ("Say honestly what I am.",
            "The user asks who I am. I should say honestly that I am a tiny demo model, not Kimi K3.",
            "The user asks who I am. I am a tiny demo model in the Kimi K3 architecture, trained on "
            "arithmetic and word puzzles. I should say so honestly and explain how to use the real model."),
    "can": ("List what I can do.",
            "The user asks what I can do. I should list the tasks I was trained on.",
            "The user asks what I can do. I was trained on a few tasks only: arithmetic, comparing "
            "numbers, counting letters, reversing words and repeating sentences. I should list them."),
    "other": ("Outside what I can do. Say so politely.",
              "This is outside what I was trained for. I should say so politely and suggest what I can do.",
              "This question is about something I was not trained on. I am a tiny demo model, so I "
              "should not guess. I should say so politely and suggest a few things I can do."),
}
_TOPICS = ("the moon", "Paris", "dogs", "the ocean", "history", "music", "love", "cooking", "football",
           "physics", "the weather", "computers", "Python", "my cat", "the stock market", "coffee")
_OTHER_Q = ("What is the capital of France?", "Tell me a joke.", "Write a poem about {t}.",
            "Explain {t} to me.", "What's the weather like today?", "Translate {w} into French.",
            "Who won the world cup?", "What is {a} times {b}?", "What is {a} divided by {b}?",
            "Write a story about {t}.", "Can you help me with my homework on {t}?",
            "What do you think about {t}?", "Summarize this article about {t}.", "What time is it?",
            "Recommend a book about {t}.", "What is the meaning of life?", "How do I cook {w}?",
            "Tell me about {t}.", "Write some code to sort a list.", "What is the square root of {a}?",
            "Who wrote Hamlet?", "Why is the sky blue?", "What is a {w}?", "Define {w}.",
            "Give me a recipe for {w}.", "How do I learn {t}?", "Write an email about {t}.",
            "What year is it?", "Tell me the news.", "Play a game with me.", "What is {a} squared?",
            "Is {a} a prime number?", "Convert {a} miles to kilometers.", "Help me plan a trip to {t}.",
            "What should I eat today?", "Sing me a song about {t}.", "How tall is Mount Everest?",
            "Can you search the web for {t}?", "What is {a} to the power of {b}?", "Fix my code.")
# A question is sometimes led in by a word or two, as people type
_LEADS = ("So, ", "Okay, ", "Tell me, ", "Quick question: ", "Um, ", "Hey, ", "Please: ")


def about(rng: random.Random) -> tuple[str, Callable[[], Turn]]:
    kind = rng.choice(("greeting", "who", "can"))
    q = rng.choice(_ABOUT_Q[kind])
    if kind != "greeting" and rng.random() < 0.25:
        q = rng.choice(_LEADS) + q[0].lower() + q[1:]
    if rng.random() < 0.3:
        q = q.rstrip("?.!") + rng.choice(("!", "?", ".", ""))
    if rng.random() < 0.2:
        q = q.lower()
    key = f"about:{q}"
    return key, lambda: _canned("about", key, q, kind)


def other(rng: random.Random) -> tuple[str, Callable[[], Turn]]:
    q = rng.choice(_OTHER_Q).format(t=rng.choice(_TOPICS), w=rng.choice(WORDS),
                                    a=rng.randint(2, 99), b=rng.randint(2, 20))
    if rng.random() < 0.25:
        q = rng.choice(_LEADS) + q[0].lower() + q[1:]
    if rng.random() < 0.15:
        q = q.lower() if rng.random() < 0.5 else q.rstrip("?.!")
    if rng.random() < 0.15:      # a file it cannot summarise: the same honest answer
        q = render_user_message(rng.choice(_DOC_OTHER_Q), [_attachment(rng, _notes_text(rng))])
    key = f"other:{q}"
    return key, lambda: _canned("other", key, q, "other")


def _canned(task: str, key: str, q: str, kind: str) -> Turn:
    low, high, mx = _REASON_ABOUT[kind]
    answer = ABOUT_ANSWERS[kind]
    return Turn(task, key, q, {"low": low, "high": high, "max": mx}, answer, (answer,), extract="whole")


# ------------------------------------------------------------------------ documents
# Messages with a file attached, rendered exactly as the app renders them
# (k3chat.attachments): arithmetic on two numbers the file gives by label, so asking the demo
# about a document shows a true answer read from it.

_DOC_NAMES = ("report.txt", "notes.txt", "numbers.txt", "sales.md", "budget.txt", "data.csv",
              "week.txt", "scores.md", "stock.csv", "visits.txt")
DOC_LABELS = ("Apples", "Pears", "Monday", "Tuesday", "Friday", "Revenue", "Costs", "Team A",
              "Team B", "North", "South", "Visitors", "Orders", "Red", "Blue", "Boxes", "Chairs")
_DOC_Q = {
    "+": ("Add the two numbers in the file.", "What is the total of the numbers in {name}?",
          "What do the numbers in the attached file add up to?", "Sum the numbers in the file.",
          "What is {x} plus {y}?", "Add {x} and {y} from the file.", "What is {x} + {y} in {name}?"),
    "-": ("What is the difference between the two numbers in the file?",
          "Subtract the second number in {name} from the first.", "What is {x} minus {y}?",
          "How much more is {x} than {y}?", "What is {x} - {y} in the file?"),
}
_DOC_OTHER_Q = ("Summarize the attached file.", "What is this file about?", "Summarize this.",
                "Translate the file into French.", "Explain this document.")


def _attachment(rng: random.Random, text: str, name: str | None = None) -> Attachment:
    name = name or rng.choice(_DOC_NAMES)
    if rng.random() < 0.7:
        text += "\n"            # as most files end, and as the app reads them (unchanged)
    data = text.encode("utf-8")
    return Attachment(name=name, path=None, size=len(data), sha256=hashlib.sha256(data).hexdigest(),
                      kind=kind_for(Path(name)), text=text)


def _notes_text(rng: random.Random) -> str:
    """A few lines of words and numbers: a file the question is not about."""
    return "\n".join(f"{rng.choice(DOC_LABELS)}: {rng.randint(0, 99)}" if rng.random() < 0.5
                     else _sentence(rng) for _ in range(rng.randint(1, 3)))


def _doc_line_parts(name: str, label: str, value: int) -> tuple[str, str]:
    """One figure's line as the file writes it, cut after its label: (label part, figure part)."""
    if name.endswith(".csv"):
        return label, f",{value}"
    if name.endswith(".md"):
        return f"- {label}", f": {value}"
    return label, f": {value}"


def _doc_line(name: str, label: str, value: int) -> str:
    """One figure's line as the file writes it."""
    return "".join(_doc_line_parts(name, label, value))


def _doc_text(name: str, rows: list[tuple[str, int]]) -> str:
    lines = "\n".join(_doc_line(name, label, value) for label, value in rows)
    if name.endswith(".csv"):
        return "item,count\n" + lines
    if name.endswith(".md"):
        return "# Figures\n\n" + lines
    return lines


def document(rng: random.Random) -> tuple[str, Callable[[], Turn]]:
    """Arithmetic on two figures of an attached file, named by their labels."""
    op = rng.choice("+-")
    any_order = _STYLE.get().doc_any_order
    name = rng.choice(_DOC_NAMES)
    labels = rng.sample(DOC_LABELS, rng.choice((2, 3, 3, 4) if any_order else (2, 2, 3)))
    values = [_rand_n(rng, rng.choice((1, 2, 2))) for _ in labels]
    i, j = rng.sample(range(len(labels)), 2) if any_order or len(labels) > 2 else (0, 1)
    if op == "-" and values[i] < values[j]:
        i, j = j, i
    x, y, a, b = labels[i], labels[j], values[i], values[j]
    rows = list(zip(labels, values))
    head = f"document:{name}:" + ":".join(f"{label}={value}" for label, value in rows)
    key = f"{head}:{x}{op}{y}"
    if any_order and op == "+" and held_out(f"{head}:{y}+{x}"):
        key = f"{head}:{y}+{x}"   # the same sum asked the other way round: on the held-out side too

    def make() -> Turn:
        # "the two numbers" only when there are two; "the first" only when it is the first
        generic = len(rows) == 2 and ((op == "+" and not any_order) or (i, j) == (0, 1))
        template = rng.choice([q for q in _DOC_Q[op] if generic or "{x}" in q])
        q = template.format(name=name, x=x, y=y)
        # The two lines are quoted as the file has them, each after a newline of its own (as
        # in the file): the same ids, label and number, in the reasoning and in the answer.
        quoted = f"{_doc_line(name, x, a)}\n{_doc_line(name, y, b)}"
        lead = f"The lines in the file\n{quoted}\nSo {a} {op} {b}."
        if _STYLE.get().doc_walk:
            marks = {i: " is the first number.", j: " is the second number."}
            walk = "\n".join(_doc_line(name, label, value) + marks.get(k, "")
                             for k, (label, value) in enumerate(rows))
            lead = f"The file, line by line:\n{walk}\nSo {a} {op} {b}."
        if _STYLE.get().doc_labels_first:
            asks = f"{x} and {y}" if "{x}" in template else "the two numbers in the file"
            lead = f"The question asks for {asks}.\n{lead}"
        reasoning, r, off = _arith_reasoning(a, op, b, lead=lead)
        block = f"```text\n{quoted}\n```"     # "```text": the first line's newline is an id of its own
        resp = f"{block}\n\n{a} {op} {b} = **{r}**."
        message = render_user_message(q, [_attachment(rng, _doc_text(name, rows), name)])
        return Turn("document", key, message, reasoning, resp, (str(r),), value=r,
                    off_response=f"{block}\n\n{off}")

    return key, make


def document_file_kind(key: str) -> tuple[int, bool]:
    """For a question about a file, from its key: how many figure lines the file has, and
    whether its first two figures, taken in the file's order, give the asked result. A model
    that takes figures by their place in the file rather than by label is right on those alone
    (EXPERIMENTS.md: the shipped model's misses are of that kind)."""
    head, asked = key.rsplit(":", 1)
    rows = [part.split("=", 1) for part in head.split(":")[2:]]
    figures = {label: int(value) for label, value in rows}
    op = "+" if "+" in asked else "-"
    x, y = asked.split(op)
    first, second = int(rows[0][1]), int(rows[1][1])
    if op == "+":
        return len(rows), first + second == figures[x] + figures[y]
    return len(rows), first - second == figures[x] - figures[y]


def _file_of_held_out_question(name: str, rows: list[tuple[str, int]]) -> bool:
    """True if some held-out document question could be about this very file (any two of its
    lines, either order, either operation): such a file is never trained on."""
    if len(rows) > 3:             # the document task's files have 2 or 3 lines
        return False
    head = f"document:{name}:" + ":".join(f"{label}={value}" for label, value in rows)
    return any(held_out(f"{head}:{x}{op}{y}") for x, _ in rows for y, _ in rows if x != y for op in "+-")


def recall_row(rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    """For train-demo --recall-mix: a file of 2 to 6 labelled figures, and some of its lines in
    another order, each cut after its label, (label part, figure part + newline), to be
    trained on the figure part only. The document task's misses name the right label and
    write another line's figure: after "Boxes: " the id to fetch follows " ", which every
    line has, so the lookup must key on the label two ids back. These rows ask for that
    lookup alone, with more lines than a task's file, in each of the file kinds."""
    while True:
        name = rng.choice(_DOC_NAMES)
        labels = rng.sample(DOC_LABELS, rng.randint(2, 6))
        rows = [(label, _rand_n(rng, rng.choice((1, 2, 2, 3)))) for label in labels]
        if not _file_of_held_out_question(name, rows):
            break
    asked = rng.sample(rows, rng.randint(1, len(rows)))
    lines = []
    for label, value in asked:
        head, tail = _doc_line_parts(name, label, value)
        lines.append((head, tail + "\n"))
    return _doc_text(name, rows), lines


def with_unrelated_file(rng: random.Random, turn: Turn) -> Turn:
    """The same question with a file attached that it is not about: answered the same way."""
    return dataclasses.replace(turn, question=render_user_message(turn.question, [_attachment(rng, _notes_text(rng))]))


# ---------------------------------------------------------------------- follow-ups

_FOLLOW_Q = {"+": ("And add {n} to that.", "Now add {n}.", "Add {n} to the result.", "and plus {n}?",
                   "What is that plus {n}?", "Now add {n} to it."),
             "-": ("Now subtract {n} from it.", "And take away {n}.", "What is that minus {n}?",
                   "Subtract {n} from the result.", "and minus {n}?", "Now subtract {n}.")}


def follow_up(rng: random.Random, previous: int, first_key: str) -> tuple[str, Callable[[], Turn]]:
    op = rng.choice("+-")
    n = _rand_n(rng, rng.choice((1, 1, 2, 2, 3)))
    key = f"multi:{first_key}:{op}:{n}"

    def make() -> Turn:
        q = rng.choice(_FOLLOW_Q[op]).format(n=n)
        lead = f"The previous answer was {previous}. Now {previous} {op} {n}."
        reasoning, r, off = _arith_reasoning(previous, op, n, lead=lead)
        resp = f"{previous} {op} {n} = **{r}**." if rng.random() < 0.7 else f"That gives **{r}**."
        return Turn("multi_turn", key, q, reasoning, resp, (str(r),), value=r, off_response=off)

    return key, make


# ------------------------------------------------------------------- conversations

Maker = Callable[[random.Random], tuple[str, Callable[[], Turn]]]
SINGLE_TASKS: dict[str, tuple[float, Maker]] = {
    "add_1d": (0.02, lambda r: arithmetic(r, "+", 1)),
    "add_2d": (0.10, lambda r: arithmetic(r, "+", 2)),
    "add_3d": (0.08, lambda r: arithmetic(r, "+", 3)),
    "sub_1d": (0.03, lambda r: arithmetic(r, "-", 1)),
    "sub_2d": (0.13, lambda r: arithmetic(r, "-", 2)),
    "sub_3d": (0.10, lambda r: arithmetic(r, "-", 3)),
    "compare": (0.11, compare),
    "count": (0.11, count_letter),
    "reverse": (0.08, reverse_word),
    "repeat": (0.07, repeat_sentence),
    "about": (0.05, about),
    "other": (0.05, other),
    "document": (0.07, document),
}
EVAL_TASKS: tuple[str, ...] = tuple(SINGLE_TASKS) + ("multi_turn",)
SYSTEM_PROMPTS = ("You are a helpful assistant.", "Answer briefly.", "You are helpful.",
                  "Be concise and accurate.", "You are a careful assistant that shows its work.")


@dataclass
class Conversation:
    """Turns plus the thinking mode they are rendered with ("low"/"high"/"max"/"off")."""

    mode: str
    turns: list[Turn]
    system: str | None = None
    scored: list[int] = field(default_factory=list)  # which turns an evaluation scores


def _draw(rng: random.Random, maker: Maker, want_held_out: bool, tries: int = 400) -> Turn:
    for _ in range(tries):
        key, make = maker(rng)
        if held_out(key) == want_held_out:
            return make()
    raise RuntimeError("could not draw a question on the requested side of the split")


def _pick_task(rng: random.Random) -> str:
    names = list(SINGLE_TASKS)
    moved = dict(_STYLE.get().weights)
    return rng.choices(names, weights=[moved.get(n, SINGLE_TASKS[n][0]) for n in names])[0]


def training_conversation(rng: random.Random) -> Conversation:
    """One training conversation: a single question (most), a follow-up chain, or two
    unrelated questions in a row; every key on the training side of the split."""
    off_share = _STYLE.get().off_share
    if off_share:       # a draw of its own, so the default's draws stay the same
        mode = "off" if rng.random() < off_share else rng.choice(EFFORTS)
    else:
        mode = rng.choice(MODES)
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.1 else None
    kind = rng.random()
    turns: list[Turn] = []
    if kind < 0.2:
        first = _draw(rng, SINGLE_TASKS[rng.choice(("add_1d", "add_2d", "add_3d", "sub_2d", "sub_3d"))][1], False)
        while first.value is None or first.value < 0:
            first = _draw(rng, SINGLE_TASKS["add_2d"][1], False)
        turns.append(first)
        for _ in range(rng.choice((1, 1, 2))):
            prev = turns[-1]
            if prev.value is None or prev.value < 0:
                break
            turns.append(_draw(rng, lambda r, p=prev: follow_up(r, int(p.value or 0), p.key), False))
    elif kind < 0.3:
        turns = [_draw(rng, SINGLE_TASKS[_pick_task(rng)][1], False) for _ in range(2)]
    else:
        turns = [_draw(rng, SINGLE_TASKS[_pick_task(rng)][1], False)]
        if turns[0].task not in ("document", "other") and rng.random() < 0.04:
            turns[0] = with_unrelated_file(rng, turns[0])
    return Conversation(mode, turns, system)


def eval_conversation(rng: random.Random, task: str, mode: str) -> Conversation:
    """A held-out conversation for one task; the last turn is the one scored."""
    if task == "multi_turn":
        first = _draw(rng, SINGLE_TASKS[rng.choice(("add_2d", "add_2d", "sub_2d"))][1], False)
        while first.value is None or first.value < 0:
            first = _draw(rng, SINGLE_TASKS["add_2d"][1], False)
        second = _draw(rng, lambda r: follow_up(r, int(first.value or 0), first.key), True)
        return Conversation(mode, [first, second], scored=[1])
    return Conversation(mode, [_draw(rng, SINGLE_TASKS[task][1], True)], scored=[0])


def messages_for(conv: Conversation, upto: int | None = None, *, answered: bool = True) -> list[dict[str, str]]:
    """History records (role, content, reasoning_content) of the first ``upto`` turns, as the
    template renders them; with ``answered=False`` the last turn is only its question."""
    turns = conv.turns if upto is None else conv.turns[:upto]
    out: list[dict[str, str]] = []
    if conv.system:
        out.append({"role": "system", "content": conv.system})
    for i, t in enumerate(turns):
        out.append({"role": "user", "content": t.question})
        if answered or i < len(turns) - 1:
            rec = {"role": "assistant", "content": t.response_for(conv.mode)}
            if conv.mode != "off":
                rec["reasoning_content"] = t.reasoning[conv.mode]
            out.append(rec)
    return out


def thinking_of(mode: str) -> tuple[bool, str | None]:
    """(thinking on?, effort) for a mode."""
    return (False, None) if mode == "off" else (True, mode)


def sample_prompts(seed: int, per_task: int) -> list[tuple[str, str, Conversation]]:
    """Held-out (task, mode, conversation) triples in a fixed order, for files and tests."""
    rng = random.Random(seed)
    out = []
    for task in EVAL_TASKS:
        for mode in MODES:
            for _ in range(per_task):
                out.append((task, mode, eval_conversation(rng, task, mode)))
    return out


def task_names() -> Sequence[str]:
    return EVAL_TASKS
