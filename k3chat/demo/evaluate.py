"""``k3chat eval-demo``: held-out questions through the C engine, scored by exact match.

Every question comes from the held-out side of ``tasks.held_out`` (never in the training
text). Each conversation runs as the app runs it: the template renders the history with
the generation prompt, the engine session feeds only what extends what it already holds,
decoding is greedy until an end id, and the turn is parsed with the strict grammar. A
follow-up question is asked after the model's *own* first answer, so a wrong first answer
makes the follow-up wrong too.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from k3chat import template
from k3chat.tokenizer import Tokenizer
from k3engine.limits import positive_arg

from . import model_dir as demo_model_dir
from .tasks import (EVAL_TASKS, MODES, Conversation, document_file_kind, eval_conversation, extract_answer,
                    is_correct, thinking_of)

EVAL_SEED = 7_000_001
MAX_NEW = 600
CONTEXT = 4096


@dataclass
class TurnOutcome:
    ids: list[int]
    well_formed: bool
    reasoning: str | None
    content: str


@dataclass
class Tally:
    right: int = 0
    n: int = 0
    by_mode: dict[str, list[int]] = field(default_factory=dict)  # mode -> [right, n]

    def add(self, mode: str, ok: bool) -> None:
        self.right += ok
        self.n += 1
        slot = self.by_mode.setdefault(mode, [0, 0])
        slot[0] += ok
        slot[1] += 1


class DemoRunner:
    """Greedy turns on an open engine model, with prefix reuse inside one conversation."""

    def __init__(self, model: Any, tokenizer: Tokenizer, *, max_new: int = MAX_NEW) -> None:
        self.model = model
        self.tok = tokenizer
        self.grammar = template.Grammar(tokenizer)
        self.session = model.session(CONTEXT)
        self.max_new = max_new

    def turn(self, messages: list[dict[str, str]], mode: str) -> TurnOutcome:
        thinking, effort = thinking_of(mode)
        prompt = template.encode(template.render(messages, thinking=thinking, effort=effort,
                                                 add_generation_prompt=True), self.tok)
        return self.turn_ids(prompt, thinking)

    def turn_ids(self, prompt: list[int], thinking: bool) -> TurnOutcome:
        held = self.session.ids
        if len(held) < len(prompt) and prompt[: len(held)] == held and not self.session.tainted:
            logits = self.session.feed(prompt[len(held):])
        else:
            self.session.reset()
            logits = self.session.feed(prompt)
        out: list[int] = []
        for _ in range(self.max_new):
            nxt = int(np.argmax(logits))
            out.append(nxt)
            if nxt in self.tok.end_ids:
                break                      # an end id is never fed (spec 1.7)
            logits = self.session.feed([nxt])
        try:
            parsed = self.grammar.parse_strict(out, thinking)
            return TurnOutcome(out, True, parsed.reasoning, parsed.content)
        except template.MalformedTurn:
            parsed = self.grammar.parse_lenient(out, thinking)
            return TurnOutcome(out, False, parsed.reasoning, parsed.content)

    def conversation(self, conv: Conversation) -> list[TurnOutcome]:
        messages: list[dict[str, str]] = [{"role": "system", "content": conv.system}] if conv.system else []
        outcomes = []
        for t in conv.turns:
            messages.append({"role": "user", "content": t.question})
            o = self.turn(messages, conv.mode)
            outcomes.append(o)
            rec = {"role": "assistant", "content": o.content}
            if o.reasoning is not None:
                rec["reasoning_content"] = o.reasoning
            messages.append(rec)
        return outcomes


def wilson_interval(right: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% by default) of a share right/n: how far a measured
    accuracy can sit from the model's true one by the luck of which questions were drawn
    (40 questions at 65% right: 50% to 78%)."""
    if n <= 0:
        return 0.0, 1.0
    p = right / n
    z2 = z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def evaluate(model: Any, tokenizer: Tokenizer, *, per_task: int, modes: Sequence[str] = MODES,
             tasks: Sequence[str] = EVAL_TASKS, seed: int = EVAL_SEED,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Accuracy per task (and per mode) and the share of well-formed turns."""
    runner = DemoRunner(model, tokenizer)
    rng = random.Random(seed)
    tallies = {t: Tally() for t in tasks}
    failures: list[dict[str, Any]] = []
    by_file: dict[tuple[int, bool], list[int]] = {}   # questions about a file: (lines, order answers) -> [right, n]
    formed = [0, 0]
    generated = 0
    t0 = time.perf_counter()
    for task in tasks:
        for mode in modes:
            for _ in range(per_task):
                conv = eval_conversation(rng, task, mode)
                outcomes = runner.conversation(conv)
                for o in outcomes:
                    formed[0] += o.well_formed
                    formed[1] += 1
                    generated += len(o.ids)
                for i in conv.scored:
                    o, t = outcomes[i], conv.turns[i]
                    ok = o.well_formed and is_correct(t, o.content)
                    tallies[task].add(mode, ok)
                    if t.task == "document":
                        slot = by_file.setdefault(document_file_kind(t.key), [0, 0])
                        slot[0] += ok
                        slot[1] += 1
                    if not ok:
                        failures.append({"task": task, "mode": mode, "question": t.question,
                                         "expected": t.accept[0], "got": extract_answer(t, o.content),
                                         "well_formed": o.well_formed, "reasoning": o.reasoning,
                                         "answer": o.content})
            if progress:
                tl = tallies[task].by_mode[mode]
                progress(f"{task:10s} {mode:4s} {tl[0]:3d}/{tl[1]:<3d}")
    seconds = time.perf_counter() - t0
    return {
        "tasks": {t: {"accuracy": tl.right / tl.n if tl.n else 0.0, "n": tl.n,
                      "ci95": list(wilson_interval(tl.right, tl.n)),
                      "by_mode": {m: {"accuracy": r / n, "n": n} for m, (r, n) in tl.by_mode.items()}}
                  for t, tl in tallies.items()},
        "well_formed": formed[0] / formed[1] if formed[1] else 0.0,
        "failures": failures,
        "document_by_file": [{"lines": lines, "file_order_answers": order, "accuracy": r / n, "n": n}
                             for (lines, order), (r, n) in sorted(by_file.items())],
        "well_formed_ci95": list(wilson_interval(formed[0], formed[1])),
        "turns": formed[1],
        "generated_tokens": generated,
        "seconds": round(seconds, 2),
        "seed": seed,
        "per_task_and_mode": per_task,
        "modes": list(modes),
    }


def format_table(result: dict[str, Any]) -> str:
    modes = result["modes"]
    lines = [f"{'task':12s}" + "".join(f"{m:>8s}" for m in modes) + f"{'all':>8s}{'n':>6s}{'95% CI':>10s}"]
    for task, r in result["tasks"].items():
        cells = "".join(f"{100 * r['by_mode'][m]['accuracy']:7.1f}%" if m in r["by_mode"] else f"{'-':>8s}"
                        for m in modes)
        lo, hi = r["ci95"]
        lines.append(f"{task:12s}{cells}{100 * r['accuracy']:7.1f}%{r['n']:6d}{f'{100 * lo:.0f}-{100 * hi:.0f}%':>10s}")
    lo, hi = result["well_formed_ci95"]
    lines.append(f"well-formed turns: {100 * result['well_formed']:.1f}% of {result['turns']} "
                 f"(95% CI {100 * lo:.1f}-{100 * hi:.1f}%); "
                 f"{result['generated_tokens']:,} tokens in {result['seconds']:.0f} s")
    lines.append("95% CI: the Wilson interval of each share, from the number of questions alone")
    if result.get("document_by_file"):
        lines.append("questions about a file, by file (\"in order\": the file's first two figures, taken in "
                     "its order, give the answer,")
        lines.append("  so a model that takes figures by their place rather than their label is right on those alone):")
        for row in result["document_by_file"]:
            kind = f"{row['lines']} lines, {'in order' if row['file_order_answers'] else 'other'}"
            right = round(row["accuracy"] * row["n"])
            lines.append(f"  {kind:20s}{right:5d}/{row['n']:<5d}{100 * row['accuracy']:6.1f}%")
    return "\n".join(lines)


def _shown(text: str | None, limit: int) -> str:
    """Model text on one line, quoted, with newlines and control characters escaped (printed,
    never obeyed by the terminal), cut after ``limit`` characters of text."""
    if text is None:
        return "-"
    return json.dumps(text if len(text) <= limit else text[:limit] + "...", ensure_ascii=False)


def format_failures(result: dict[str, Any]) -> str:
    """Each wrong answer: what was asked (its last line: after any attached file), what was
    right, what the model's answer said, and how its reasoning ended."""
    lines = [f"{len(result['failures'])} wrong:"]
    for f in result["failures"]:
        asked = f["question"].rstrip("\n").rsplit("\n", 1)[-1]
        lines.append(f"{f['task']}/{f['mode']}: {_shown(asked, 90)} expected {_shown(f['expected'], 60)}, "
                     f"got {_shown(f['got'], 60)}" + ("" if f["well_formed"] else " (malformed turn)"))
        lines.append(f"    answer {_shown(f['answer'], 150)}")
        tail = f["reasoning"][-150:] if f["reasoning"] is not None else None
        lines.append(f"    reasoning ends {_shown(tail, 150)}")
    return "\n".join(lines)


def load_previous(path: Path) -> dict[str, Any]:
    """A result written by ``eval-demo --json``, checked enough to compare against; ValueError
    names what is wrong."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path} is not JSON ({exc}); give a file written by eval-demo --json") from exc
    tasks = data.get("tasks") if isinstance(data, dict) else None
    ok = isinstance(tasks, dict) and isinstance(data.get("well_formed"), (int, float)) and all(
        isinstance(r, dict) and isinstance(r.get("accuracy"), (int, float)) and isinstance(r.get("n"), int)
        for r in tasks.values())
    if not ok:
        raise ValueError(f"{path} is not an eval-demo result (it needs \"tasks\" with accuracy and n per "
                         "task, and \"well_formed\"); give a file written by eval-demo --json")
    return data


def format_comparison(previous: dict[str, Any], result: dict[str, Any], label: str) -> str:
    """Each task's accuracy in a previous result beside this one's, the change in points, and
    the sum over the tasks both scored: the figures to decide whether a retrained demo is
    better. A change smaller than the intervals is luck as likely as not; the line under the
    table says when the two were not asked the same questions."""
    lines = [f"compared with {label}", f"{'task':12s}{'before':>9s}{'now':>9s}{'change':>9s}"]
    sums = [0.0, 0.0]
    for task, r in result["tasks"].items():
        old = previous["tasks"].get(task)
        if old is None:
            lines.append(f"{task:12s}{'-':>9s}{100 * r['accuracy']:8.1f}%{'':>9s}")
            continue
        # changes and sums are of the figures as shown, so the table adds up as printed
        a, b = round(100 * old["accuracy"], 1), round(100 * r["accuracy"], 1)
        sums[0] += a
        sums[1] += b
        lines.append(f"{task:12s}{a:8.1f}%{b:8.1f}%{b - a:+9.1f}")
    lines.append(f"{'sum':12s}{sums[0]:9.1f}{sums[1]:9.1f}{sums[1] - sums[0]:+9.1f}")
    wa, wb = round(100 * previous["well_formed"], 1), round(100 * result["well_formed"], 1)
    lines.append(f"{'well-formed':12s}{wa:8.1f}%{wb:8.1f}%{wb - wa:+9.1f}")
    same = [previous.get(k) == result.get(k) for k in ("seed", "per_task_and_mode", "modes")]
    if not all(same):
        lines.append("(not the same questions: the two ran with a different --seed, --n or --modes)")
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    from k3engine.model import Model

    ap = argparse.ArgumentParser(prog="k3chat eval-demo",
                                 description="Score the demo model on held-out questions, through the C engine.")
    ap.add_argument("model_dir", nargs="?", default=None, help="default: the built-in demo model")
    ap.add_argument("--n", type=int, default=20, metavar="N", help="questions per task and thinking mode (default 20)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, from {','.join(MODES)}")
    ap.add_argument("--tasks", default=",".join(EVAL_TASKS), help="comma-separated task names")
    ap.add_argument("--seed", type=int, default=EVAL_SEED)
    ap.add_argument("--threads", type=positive_arg, default=None,
                    help="engine threads (default: 1 for a model this small, else every core)")
    ap.add_argument("--json", dest="json_out", help="write the result as JSON to this file "
                                                    "(every wrong answer in full under \"failures\")")
    ap.add_argument("--failures", action="store_true",
                    help="after the table, list each wrong answer: question, expected, what it said")
    ap.add_argument("--compare", metavar="PREVIOUS_JSON",
                    help="after the table, each task's accuracy beside a result written earlier with "
                         "--json (another model, or this one before retraining), the change and the sum")
    try:
        args = ap.parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    modes = [m for m in args.modes.split(",") if m]
    names = [t for t in args.tasks.split(",") if t]
    bad = [m for m in modes if m not in MODES] + [t for t in names if t not in EVAL_TASKS]
    if bad or args.n < 1:
        print(f"k3chat eval-demo: unknown mode or task {', '.join(bad)} (modes: {','.join(MODES)}; tasks: "
              f"{','.join(EVAL_TASKS)})" if bad else "k3chat eval-demo: --n must be >= 1", file=sys.stderr)
        return 2
    from k3chat.chat_cli import json_path_problem

    problem = json_path_problem(args.json_out)
    if problem is not None:
        print(f"k3chat eval-demo: {problem}", file=sys.stderr)
        return 2
    previous = None
    if args.compare:            # checked before the questions run, not after
        try:
            previous = load_previous(Path(args.compare))
        except ValueError as exc:
            print(f"k3chat eval-demo: --compare: {exc}", file=sys.stderr)
            return 2
    path = Path(args.model_dir) if args.model_dir else demo_model_dir()
    if not (path / "config.json").is_file():
        print(f"k3chat eval-demo: {path} is not a model directory (no config.json)", file=sys.stderr)
        return 2
    from k3chat.runtime import default_threads

    model = Model(path, threads=1)
    # as `run --demo` and the app: one thread for a model this small unless --threads says
    # otherwise (two threads decode the demo about 7x slower here)
    threads = default_threads(model.config.hidden, args.threads)
    if threads != 1:
        model.set_threads(threads)
    tok = Tokenizer.from_dir(path)
    result = evaluate(model, tok, per_task=args.n, modes=modes, tasks=names, seed=args.seed,
                      progress=lambda s: print(s, file=sys.stderr, flush=True))
    print(format_table(result))
    if args.failures:
        print()
        print(format_failures(result))
    if previous is not None:
        print()
        print(format_comparison(previous, result, args.compare))
    if args.json_out:
        from k3chat import paths  # private (0600) and atomic, like run --json

        try:
            paths.atomic_write(Path(args.json_out), (json.dumps(result, indent=2) + "\n").encode("utf-8"))
        except OSError as exc:
            print(f"k3chat eval-demo: cannot write {args.json_out}: {exc}", file=sys.stderr)
            return 1
    return 0
