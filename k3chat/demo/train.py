"""Train the built-in demo model and write it as a Kimi K3 checkpoint.

``k3chat train-demo --out DIR`` (needs ``pip install '.[train]'``): generates the training
conversations (``tasks``), renders them with the app's XTML template, learns a BPE tokenizer
on their text, trains the torch implementation of K3 (``k3engine.train.model``) with BF16
and MXFP4 quantization-aware training, writes the checkpoint in the released layout (nested
config, one shard per layer plus a model shard, an index, BF16 trunk, MXFP4 experts, the
tokenizer), then records the greedy answers the trained torch model gives on held-out
prompts (``prompts.jsonl``), which the tests compare with the C engine's.

Everything is seeded; the same command gives the same files on the same machine.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import tiktoken

from k3engine.fixture import (LM, LayerTensors, ModelTensors, Preset, build_config, plan_shards,
                              read_special_ids)
from k3engine.private_files import make_private_dirs, open_private, write_private
from k3engine.tokenizer_files import K3_PAT_STR, piece_counts, write_tokenizer
from k3engine.writer import EXPERT_PARTS, bf16_tensor, f32_tensor, quantize_checked, u8_tensor, write_sharded

from . import corpus, tasks

# The demo's shape: K3's layer kinds at toy widths. Zero-based layers 0, 1, 3, 5 are KDA
# (0 with the dense FFN), 2, 4, 6, 7 gated MLA (a trailing MLA pair as in the release);
# AttnRes blocks of 3 give boundaries 0, 3, 6.
DEMO_PRESET = Preset(
    name="demo",
    hidden_size=256,
    num_hidden_layers=8,
    kda_heads=4,
    kda_head_dim=32,
    conv_kernel=4,
    gate_lower_bound=-5.0,
    full_attn_layers=(3, 5, 7, 8),
    kda_layers=(1, 2, 4, 6),
    mla_heads=4,
    q_lora_rank=128,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    num_experts=8,
    num_experts_per_token=2,
    num_shared_experts=2,
    routed_expert_hidden_size=128,
    moe_intermediate_size=64,
    intermediate_size=512,
    attn_res_block_size=3,
    note="k3chat demo: 8 layers (KDA 0,1,3,5; MLA 2,4,6,7), 8 experts top-2 + 2 shared, trained",
)
N_RANKS = 1024
MIN_PIECE_COUNT = 5
BPE_SAMPLE = 6000
LETTERS = bytes(range(ord("a"), ord("z") + 1)) + bytes(range(ord("A"), ord("Z") + 1))
PROMPT_SEED = 20261201
PROMPTS_PER_TASK_MODE = 1        # 13 tasks x 4 modes = 52 recorded prompts
MAX_NEW = 400


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _is_puzzle_piece(piece: bytes) -> bool:
    """Digits, the words the puzzles are about (the words to spell, count in, reverse or
    repeat) and their reversals, and a letter with its plural ("r's"): these stay one digit
    or letter per token, so the letter asked about is the letter's own id."""
    text = piece.decode("utf-8", errors="replace")
    if any(c.isdigit() for c in text):
        return True
    word = text.strip().lower()
    if re.fullmatch(r"[a-z]'s", word):
        return True
    words = tasks.puzzle_words()
    return word.isalpha() and (word in words or word[::-1] in words)


def _puzzle_forms() -> list[str]:
    """Each puzzle word and its reversal, bare (at a line start) and after a space."""
    return [space + form for w in sorted(tasks.puzzle_words()) for form in (w, w[::-1]) for space in ("", " ")]


def merged_inside_puzzle_words(ranks: dict[bytes, int]) -> set[bytes]:
    """The multi-letter tokens BPE would build inside a puzzle word (" do" in " donkey",
    " to" in " tomato"): such a word would no longer read as its letters."""
    enc = tiktoken.Encoding("k3chat-demo-check", pat_str=K3_PAT_STR, mergeable_ranks=ranks, special_tokens={})
    inside: set[bytes] = set()
    for form in _puzzle_forms():
        for token in enc.decode_tokens_bytes(enc.encode_ordinary(form)):
            if len(token.strip()) > 1:
                inside.add(token)
    return inside


def _ranks_from(freq: Counter[bytes], n_ranks: int, min_count: int, refused: set[bytes]) -> dict[bytes, int]:
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    for letter in LETTERS:             # " x" even if no x is spelled: " xof" is " x", "o", "f"
        ranks[b" " + bytes([letter])] = len(ranks)
    for piece, count in sorted(freq.items(), key=lambda kv: (-kv[1], kv[0])):
        if len(ranks) >= n_ranks:
            break
        if count < min_count:
            break
        if len(piece) > 1 and piece not in ranks and piece not in refused and not _is_puzzle_piece(piece):
            ranks[piece] = len(ranks)
    return ranks


def learn_vocabulary(freq: Counter[bytes], n_ranks: int, min_count: int = MIN_PIECE_COUNT) -> dict[bytes, int]:
    """tiktoken ranks for the demo: the 256 bytes, each letter after a space (" a" to " Z"),
    then the whole pieces of the training text (K3's pre-tokenizer cuts them) seen at least
    ``min_count`` times, most frequent first, at most ``n_ranks`` in all.

    BPE emits a piece that is itself a token directly, so the scaffolding of the reasoning
    ("Write", " carry", "`thinking") costs one id per piece. Puzzle pieces are never ranks,
    nor is any piece BPE would merge inside a puzzle word (the spelled " d" and "o" would
    make the word " do" inside " donkey"): a puzzle word is then always its letters, one id
    each (the first after a space, " d", the others bare, "o"), wherever it is written, so
    spelling, counting in, reversing or repeating it copies those ids; a whole-word id would
    have to be memorised word by word."""
    refused: set[bytes] = set()
    while True:        # refusing one piece frees a rank for the next, which may merge too
        ranks = _ranks_from(freq, n_ranks, min_count, refused)
        inside = merged_inside_puzzle_words(ranks)
        if not inside:
            return ranks
        refused |= inside


# ------------------------------------------------------------------------------ data


def build_tokenizer(out: Path, seed: int) -> Any:
    from k3chat.tokenizer import Tokenizer

    rng = random.Random(seed ^ 0xB9E)
    sample = [tasks.training_conversation(rng) for _ in range(BPE_SAMPLE)]
    freq = piece_counts(t for c in sample for t in corpus.texts_of(c))
    write_tokenizer(out, learn_vocabulary(freq, N_RANKS))
    return Tokenizer.from_dir(out)


def make_batches(seqs: list[tuple[list[int], list[bool]]], budget: int, rng: random.Random) -> list[list[int]]:
    """Indices grouped by length so that padding stays small; at most ``budget`` padded tokens."""
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i][0]), i))
    batches, cur, cur_max = [], [], 0
    for i in order:
        n = len(seqs[i][0])
        if cur and max(cur_max, n) * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, cur_max = [], 0
        cur.append(i)
        cur_max = max(cur_max, n)
    if cur:
        batches.append(cur)
    rng.shuffle(batches)
    return batches


def collate(torch: Any, seqs: list[tuple[list[int], list[bool]]], idx: list[int], pad: int) -> tuple[Any, Any]:
    t = max(len(seqs[i][0]) for i in idx)
    ids = torch.full((len(idx), t), pad, dtype=torch.long)
    target = torch.full((len(idx), t), -100, dtype=torch.long)
    for r, i in enumerate(idx):
        s, m = seqs[i]
        ids[r, : len(s)] = torch.tensor(s)
        tgt = [x if keep else -100 for x, keep in zip(s, m)]
        target[r, : len(s) - 1] = torch.tensor(tgt[1:])     # position j predicts id j+1
    return ids, target


def decision_weights(torch: Any, seqs: list[tuple[list[int], list[bool]]], idx: list[int],
                     positions: list[list[int]], weight: float) -> Any:
    """Per-target loss weights for a batch laid out as ``collate`` lays it: ``weight`` where
    the target is a counting decision (an id index in ``positions``), 1 elsewhere."""
    t = max(len(seqs[i][0]) for i in idx)
    w = torch.ones((len(idx), t), dtype=torch.float32)
    for r, i in enumerate(idx):
        for k in positions[i]:
            w[r, k - 1] = weight                            # id k is predicted at position k-1
    return w


COPY_WARMUP_SEQS = 48          # sequences per warm-up step


def copy_pool(tok: Any) -> list[int]:
    """The ids a warm-up sequence is drawn from: every rank that is a word, a letter or a
    digit, with or without a space before it (" fox", "Tuesday", "r", " r", "7"), the kinds
    of id the tasks copy."""
    enc = tok.encoding
    pool = []
    for i in range(tok.n_ranks):
        piece = enc.decode_single_token_bytes(i)
        bare = piece[1:] if piece[:1] == b" " else piece
        if bare.isascii() and bare.isalnum():
            pool.append(i)
    return pool


def copy_warmup_batch(torch: Any, rng: random.Random, pool: Sequence[int], bos: int, sep: int,
                      pad: int, n_seqs: int = COPY_WARMUP_SEQS) -> tuple[Any, Any]:
    """A batch of "[BOS] w1..wn <|sep|> w1..wn" with 3 to 12 random ids, trained on the copy.

    An experiment for issue 7, off by default. The tasks all copy (a sentence, the letters of
    a word, a line of a file), and the demo trained on them copies by kind: it writes "a
    noun" where a noun goes, which blends a sentence's two nouns into a frequent third (0% of
    repeats). With lengths that vary no fixed offset finds the word to copy, so these can
    only be learnt by the general mechanism (find the current id earlier, write the id after
    it). Session 22 measured: the demo-shaped model learns them (97% of copied ids right) in
    about 500 steps on a pool of 246 ids; on the 597 of the demo vocabulary the loss was
    still falling at 600 steps; and the demo trained 600 such steps and then 1,250 task steps
    (with two small changes to the text, see issue 7) came out far worse on every task:
    2-digit sums 32%, repeats 0%, final loss 0.198 against the shipped 0.037."""
    rows = []
    for _ in range(n_seqs):
        w = [rng.choice(pool) for _ in range(rng.randint(3, 12))]
        rows.append(([bos] + w + [sep] + w, 1 + len(w)))
    t = max(len(r) for r, _ in rows)
    ids = torch.full((n_seqs, t), pad, dtype=torch.long)
    target = torch.full((n_seqs, t), -100, dtype=torch.long)
    for r, (row, sep_at) in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        n = len(row) - 1 - sep_at
        target[r, sep_at: sep_at + n] = torch.tensor(row[sep_at + 1:])    # from <|sep|> on
    return ids, target


def task_copy_pool(tok: Any, letters: bool = True) -> list[int]:
    """The single ids the tasks copy, for --copy-mix: the words of the sentences to repeat,
    the document labels' words and the letters, each bare, capitalised and after a space
    (" fox", "Tuesday", "r", " r"). Digits are left out: they are copied by position inside
    the column lines already, and a mix that drew them cost the addition table precision
    (session 23: 2-digit sums 72.5% with digits in a pool of 32 rows a step)."""
    # letters=False leaves the single letters out (--copy-words-only): copying demands that
    # "r" and " r" stay apart, counting that they be the same letter
    words = set(tasks.sentence_words()) | (set(tasks.LETTERS) if letters else set())
    for label in tasks.DOC_LABELS:
        words.update(label.split())
    pool: set[int] = set()
    for w in words:
        for form in {w, w.capitalize()}:
            for text in (form, " " + form):
                ids = tok.encoding.encode_ordinary(text)
                if len(ids) == 1:
                    pool.add(ids[0])
    return sorted(pool)


def recall_batch(torch: Any, rng: random.Random, tok: Any, bos: int, sep: int, pad: int,
                 n_seqs: int) -> tuple[Any, Any, Any]:
    """A batch of "[BOS] file <|sep|> line line ..." (tasks.recall_row), trained only on the
    figure part of each line after <|sep|>: the label is given, its figure must be found.
    For --recall-mix, an experiment for issue 7's document task, off by default. Also returns
    where the lookup itself is: True at each position that predicts a figure's first digit
    (the id no separator before it gives away; recall_probe scores these)."""
    enc = tok.encoding.encode_ordinary
    rows = []
    for _ in range(n_seqs):
        text, lines = tasks.recall_row(rng)
        row, trained, lookups = [bos] + enc(text) + [sep], [], []
        for head, tail in lines:
            row += enc(head)
            ids = enc(tail)
            trained += range(len(row), len(row) + len(ids))
            before = enc(tail[: next(i for i, ch in enumerate(tail) if ch.isdigit())])  # ": " or ","
            lookups.append(len(row) + len(before))
            row += ids
        rows.append((row, trained, lookups))
    t = max(len(r) for r, _, _ in rows)
    ids = torch.full((n_seqs, t), pad, dtype=torch.long)
    target = torch.full((n_seqs, t), -100, dtype=torch.long)
    lookup = torch.zeros((n_seqs, t), dtype=torch.bool)
    for r, (row, trained, firsts) in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        for k in trained:                    # id k is predicted at position k-1
            target[r, k - 1] = row[k]
        for k in firsts:
            lookup[r, k - 1] = True
    return ids, target, lookup


# --------------------------------------------------------------------------- training


def cosine_factor(frac: float, final_lr: float) -> float:
    """The schedule's share of the peak lr at ``frac`` (0..1) of the task steps: 1 down to ``final_lr``."""
    return final_lr + (1 - final_lr) * 0.5 * (1 + math.cos(math.pi * frac))


STATE_EVERY = 100   # steps between saves of train_state.pt (what --resume continues from)


class ResumeRefused(ValueError):
    """``--resume`` cannot continue this run: no state, an unreadable one, or another recipe."""


class InitRefused(ValueError):
    """``--init-from`` cannot start from that directory: not a checkpoint train-demo wrote."""


# recipe keys newer than some saved states, with the value every run before them had
RECIPE_KEYS_ADDED_LATER: dict[str, Any] = {"doc_labels_first": False, "off_steps_by_place": False,
                                           "doc_walk": False, "off_share": 0.0, "doc_any_order": False,
                                           "recall_mix": 0, "recall_mix_until": 0, "compile": False,
                                           "ffn_lr": 1.0, "init_from": None}

# what a continued run (--init-from) records of the run it starts from: its whole recipe (the
# training text's options too: a chain of runs is retrained from this record) and its time
INIT_SOURCE_KEYS = ("seed", "steps", "conversations", "batch_tokens", "lr", "final_lr", "tie_embeddings",
                    "copy_warmup", "copy_mix", "copy_mix_from", "copy_mix_until", "copy_words_only",
                    "count_weight", "recall_mix", "recall_mix_until", "compile", "ffn_lr", "sign_by_places",
                    "mix", "count_decisions", "count_letter_alone", "doc_labels_first", "off_steps_by_place",
                    "doc_walk", "doc_any_order", "off_share", "threads", "train_seconds", "train_seconds_total", "init_from")


def read_init_source(src: Path, out: Path) -> dict[str, Any]:
    """What ``--init-from SRC`` starts from, checked before any data is made: a directory that
    train-demo wrote (its training.json, config, tokenizer and shards), not the output itself."""
    if not src.is_dir():
        raise InitRefused(f"--init-from: {src} is not a directory; give a checkpoint directory that "
                          "train-demo wrote (as k3chat/demo/k3chat-demo)")
    if out.exists() and src.resolve() == out.resolve():
        raise InitRefused(f"--init-from: {src} is also --out; the run would overwrite the weights it "
                          "starts from; give another --out")
    missing = [n for n in ("training.json", "config.json", "tiktoken.model", "tokenizer_config.json",
                           "model.safetensors.index.json") if not (src / n).is_file()]
    if missing:
        raise InitRefused(f"--init-from: {src} has no {', '.join(missing)}: it is not a checkpoint "
                          "train-demo wrote")
    try:
        meta = json.loads((src / "training.json").read_text())
        if not isinstance(meta, dict) or not isinstance(meta.get("train_seconds"), (int, float)):
            raise ValueError("no train_seconds")
    except (OSError, ValueError) as exc:
        raise InitRefused(f"--init-from: {src / 'training.json'} cannot be read ({exc}); it is damaged "
                          "or not train-demo's") from exc
    meta = {**RECIPE_KEYS_ADDED_LATER, **meta}     # an older run's training.json lacks what it left at default
    source = {k: meta.get(k) for k in INIT_SOURCE_KEYS}
    source["train_seconds_total"] = meta.get("train_seconds_total") or meta["train_seconds"]
    return source


def is_ffn_weight(name: str) -> bool:
    """The feed-forward weights --ffn-lr scales: layer 0's dense MLP and every MoE layer's
    router, shared and routed experts (not the AttnRes mix in front of them)."""
    return ".mlp." in name or ".block_sparse_moe." in name


def param_groups(model: Any, ffn_lr: float = 1.0) -> list[dict[str, Any]]:
    """AdamW's groups: matrices decay, vectors and convolutions do not; with ``ffn_lr`` other
    than 1 the feed-forward weights get groups of their own at that share of the rate. At 1
    the groups are the two every run before --ffn-lr had, so such a run is unchanged."""
    groups: dict[tuple[bool, float], list[Any]] = {}
    seen: set[int] = set()
    for name, p in model.named_weights():
        if id(p) in seen:                    # the tied lm_head is the embedding's parameter
            continue
        seen.add(id(p))
        if name.endswith("e_score_correction_bias"):
            p.requires_grad_(False)          # moved by load balancing, not by gradients
            continue
        scale = ffn_lr if is_ffn_weight(name) else 1.0
        groups.setdefault((p.ndim >= 2 and "conv1d" not in name, scale), []).append(p)
    order = sorted(groups, key=lambda k: (k[1] != 1.0, not k[0]))   # decay, plain; then the scaled ones
    return [{"params": groups[k], "weight_decay": 0.01 if k[0] else 0.0, "lr_scale": k[1]} for k in order]


def run_recipe(*, steps: int, seed: int, conversations: int, batch_tokens: int, lr: float, final_lr: float,
               tie_embeddings: bool, copy_warmup: int, copy_mix: int, copy_mix_from: int, copy_mix_until: int,
               copy_words_only: bool, count_weight: float, recall_mix: int = 0,
               recall_mix_until: int = 0, compiled: bool = False, ffn_lr: float = 1.0,
               init_from: dict[str, Any] | None = None) -> dict[str, Any]:
    """Everything that shapes a run's data, schedule and loss, with the training text's
    options (TextStyle). Not ``--threads``, which only changes the rounding; ``--compile``
    does too, but in every step's every norm, so a run is not resumed across it."""
    style = tasks.current_style()
    return {"seed": seed, "steps": steps, "conversations": conversations, "batch_tokens": batch_tokens,
            "lr": lr, "final_lr": final_lr, "tie_embeddings": tie_embeddings, "copy_warmup": copy_warmup,
            "copy_mix": copy_mix, "copy_mix_from": copy_mix_from, "copy_mix_until": copy_mix_until,
            "copy_words_only": copy_words_only, "count_weight": count_weight,
            "recall_mix": recall_mix, "recall_mix_until": recall_mix_until, "compile": compiled,
            "ffn_lr": ffn_lr, "init_from": init_from,
            "sign_by_places": style.sign_by_places, "mix": dict(style.weights),
            "count_decisions": style.count_decisions, "count_letter_alone": style.count_letter_alone,
            "doc_labels_first": style.doc_labels_first, "off_steps_by_place": style.off_steps_by_place,
            "doc_walk": style.doc_walk, "doc_any_order": style.doc_any_order, "off_share": style.off_share}


def load_resume_state(torch: Any, state_path: Path, recipe: dict[str, Any]) -> dict[str, Any]:
    """The saved state to continue from, refused when it cannot give the run asked for: a run
    resumed with other options would silently become a mix of two recipes."""
    if not state_path.exists():
        raise ResumeRefused(f"--resume: there is no {state_path.name} in {state_path.parent} to continue "
                            "from (an interrupted run leaves one; run without --resume to start afresh)")
    try:
        st = torch.load(state_path, weights_only=False)
    except Exception as exc:  # torch.load raises many kinds on a damaged or foreign file
        raise ResumeRefused(f"--resume: {state_path} cannot be read ({type(exc).__name__}: {exc}); "
                            "run without --resume to start afresh") from exc
    missing = [k for k in ("model", "opt", "step", "history", "recipe")
               if not isinstance(st, dict) or k not in st]
    if missing:
        raise ResumeRefused(f"--resume: {state_path} has no {', '.join(missing)}: it was written by an "
                            "older k3chat or is not a training state; run without --resume to start afresh")
    saved, step = st["recipe"] if isinstance(st["recipe"], dict) else {}, st["step"]
    # a state saved before an option existed was saved without it, that is, with it off
    saved = {**RECIPE_KEYS_ADDED_LATER, **saved}
    differ = [f"{k} {saved.get(k)!r} -> {recipe[k]!r}" for k in recipe if saved.get(k) != recipe[k]]
    if differ:
        raise ResumeRefused(f"--resume: {state_path} was saved at step {step} of a run with other options "
                            f"({'; '.join(differ)}); give the interrupted run's options, or start afresh "
                            "in another --out")
    return st


def train(out: Path, *, steps: int, seed: int, conversations: int, batch_tokens: int, lr: float,
          threads: int, resume: bool, tie_embeddings: bool = False, copy_warmup: int = 0,
          copy_mix: int = 0, copy_mix_from: int = 0, copy_mix_until: int = 0, copy_words_only: bool = False,
          final_lr: float = 0.1, count_weight: float = 1.0, recall_mix: int = 0,
          recall_mix_until: int = 0, compiled: bool = False, ffn_lr: float = 1.0,
          init_from: Path | None = None) -> dict[str, Any]:
    from k3engine.train import require_torch
    from k3engine.train.model import K3Torch

    torch = require_torch()
    recipe = run_recipe(steps=steps, seed=seed, conversations=conversations, batch_tokens=batch_tokens,
                        lr=lr, final_lr=final_lr, tie_embeddings=tie_embeddings, copy_warmup=copy_warmup,
                        copy_mix=copy_mix, copy_mix_from=copy_mix_from, copy_mix_until=copy_mix_until,
                        copy_words_only=copy_words_only, count_weight=count_weight,
                        recall_mix=recall_mix, recall_mix_until=recall_mix_until, compiled=compiled,
                        ffn_lr=ffn_lr, init_from=read_init_source(init_from, out) if init_from else None)
    state_path = out / "train_state.pt"
    resumed = load_resume_state(torch, state_path, recipe) if resume else None
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    make_private_dirs(out)
    t0 = time.time()
    if init_from:        # the weights' own tokenizer: one learnt anew could number the pieces otherwise
        from k3chat.tokenizer import Tokenizer

        for name in ("tiktoken.model", "tokenizer_config.json"):
            write_private(out / name, (init_from / name).read_bytes())
        tok = Tokenizer.from_dir(out)
        _log(f"tokenizer: {init_from}'s, {tok.n_ranks} ranks + 256 specials")
    else:
        tok = build_tokenizer(out, seed)
        _log(f"tokenizer: {tok.n_ranks} ranks + 256 specials ({time.time() - t0:.1f} s)")
    vocab = tok.vocab_size

    rng = random.Random(seed)
    convs = [tasks.training_conversation(rng) for _ in range(conversations)]
    seqs = [corpus.encode_conversation(c, tok) for c in convs]
    n_tok = sum(len(s) for s, _ in seqs)
    n_trained = sum(sum(m) for _, m in seqs)
    _log(f"data: {len(seqs):,} conversations, {n_tok:,} tokens ({n_trained:,} trained) "
         f"({time.time() - t0:.1f} s)")
    pad = tok.special_id("[PAD]")
    decisions: list[list[int]] = []
    if count_weight != 1.0:      # (at 1 the loss is the plain mean, the shipped run's bit for bit)
        decisions = [corpus.count_decision_positions(c, tok) for c in convs]
        _log(f"count weight {count_weight}: {sum(map(len, decisions)):,} counting decisions weighted")

    model = K3Torch(DEMO_PRESET, vocab, seed=seed, tie_embeddings=tie_embeddings, compiled=compiled)
    if init_from:        # the stored values (BF16 trunk, decoded MXFP4 experts) as the master weights
        try:
            model.load_checkpoint(init_from)
        except Exception as exc:  # noqa: BLE001 (a damaged shard or another shape, in many kinds)
            raise InitRefused(f"--init-from: {init_from}'s weights cannot be loaded into the demo's shape "
                              f"({type(exc).__name__}: {exc})") from exc
        _log(f"weights: from {init_from} (trained {recipe['init_from']['train_seconds_total']:.0f} s)")
    if compiled:
        _log("compiled pieces (torch.compile): the first steps of each new shape compile, then run faster")
    opt = torch.optim.AdamW(param_groups(model, ffn_lr), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    start_step, history = 0, []
    if resumed is not None:
        model.load_state_dict(resumed["model"])
        opt.load_state_dict(resumed["opt"])
        start_step, history = resumed["step"], resumed["history"]
        _log(f"resumed at step {start_step}")

    batch_rng = random.Random(seed + 1)
    batches: list[list[int]] = []
    while len(batches) < steps:
        batches += make_batches(seqs, batch_tokens, batch_rng)
    total = copy_warmup + steps
    warmup = max(1, min(100, steps // 10))
    bias_names = model.router_bias_names()
    if copy_warmup:      # (resuming inside the warm-up draws new rows: its rng is not saved)
        pool, warm_rng = copy_pool(tok), random.Random(seed ^ 0xC0B7)
        bos, sep = tok.special_id("[BOS]"), tok.special_id("<|sep|>")
        _log(f"copy warm-up: {copy_warmup} steps of {COPY_WARMUP_SEQS} runs of 3-12 ids from {len(pool)}")
    if copy_mix:         # (a resume draws new copy rows: this rng is not saved)
        mix_pool, mix_rng = task_copy_pool(tok, letters=not copy_words_only), random.Random(seed ^ 0x313C)
        bos, sep = tok.special_id("[BOS]"), tok.special_id("<|sep|>")
        _log(f"copy mix: {copy_mix} rows of 3-12 ids from {len(mix_pool)} in every task step"
             + (f" from task step {copy_mix_from}" if copy_mix_from else "")
             + (f" until task step {copy_mix_until}" if copy_mix_until else ""))
    if recall_mix:       # (a resume draws new rows: this rng is not saved)
        recall_rng = random.Random(seed ^ 0x4EC1)
        bos, sep = tok.special_id("[BOS]"), tok.special_id("<|sep|>")
        _log(f"recall mix: {recall_mix} rows of a file's lines looked up by label in every task step"
             + (f" until task step {recall_mix_until}" if recall_mix_until else ""))
    copy_history: list[float] = []
    recall_history: list[float] = []
    t_train = time.time()
    for step in range(start_step, total):
        if step < copy_warmup:            # warm up the learning rate, then hold it
            cur_lr = lr * min(1.0, (step + 1) / 50)
            ids, target = copy_warmup_batch(torch, warm_rng, pool, bos, sep, pad)
        else:                             # cosine from lr to lr * final_lr over the task steps
            j = step - copy_warmup
            frac = j / max(1, steps - 1)
            ramp = 1.0 if copy_warmup else min(1.0, (j + 1) / warmup)
            cur_lr = lr * ramp * cosine_factor(frac, final_lr)
            ids, target = collate(torch, seqs, batches[j], pad)
        for g in opt.param_groups:
            g["lr"] = cur_lr * g.get("lr_scale", 1.0)   # (a state saved before --ffn-lr has none)
        loads: list[Any] = []
        scored = target != -100
        logits = model(ids, loads, rows=scored)
        if decisions and step >= copy_warmup:
            # each decision weighs count_weight ids; the mean is still over the ids, so the
            # rest of the text keeps the gradient it has without the weight
            per_id = torch.nn.functional.cross_entropy(logits.float(), target[scored], reduction="none")
            w = decision_weights(torch, seqs, batches[step - copy_warmup], decisions, count_weight)[scored]
            loss = (per_id * w).sum() / per_id.numel()
            task_loss = float(per_id.detach().mean())
        else:
            loss = torch.nn.functional.cross_entropy(logits.float(), target[scored])
            task_loss = float(loss.detach())
        if copy_mix and copy_mix_from <= step - copy_warmup < (copy_mix_until or steps):
            # a separate forward: routing loads (and so the router biases) follow the task batch;
            # before copy_mix_from the run is the plain run's, bit for bit (its own rng)
            cids, ctarget = copy_warmup_batch(torch, mix_rng, mix_pool, bos, sep, pad, n_seqs=copy_mix)
            cscored = ctarget != -100
            clogits = model(cids, [], rows=cscored)
            closs = torch.nn.functional.cross_entropy(clogits.float(), ctarget[cscored])
            copy_history.append(float(closs.detach()))
            loss = loss + closs
        if recall_mix and step >= copy_warmup and step - copy_warmup < (recall_mix_until or steps):
            rids, rtarget, _ = recall_batch(torch, recall_rng, tok, bos, sep, pad, recall_mix)
            rscored = rtarget != -100
            rloss = torch.nn.functional.cross_entropy(model(rids, [], rows=rscored).float(), rtarget[rscored])
            recall_history.append(float(rloss.detach()))
            loss = loss + rloss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():                # auxiliary-loss-free balancing (noaux_tc)
            for name, load in zip(bias_names, loads):
                f = load.float() / load.sum()
                model.w(name).add_(1e-3 * torch.sign(f.mean() - f))
        history.append(task_loss)
        if step % 20 == 0 or step == total - 1:
            el = time.time() - t_train
            recent = sum(history[-20:]) / len(history[-20:])
            copy_note = f" copy {sum(copy_history[-20:]) / len(copy_history[-20:]):.4f}" if copy_history else ""
            if recall_history:
                copy_note += f" recall {sum(recall_history[-20:]) / len(recall_history[-20:]):.4f}"
            _log(f"step {step:5d}/{total} loss {recent:.4f}{copy_note} lr {cur_lr:.2e} {el:7.0f} s "
                 f"({(step + 1 - start_step) / max(el, 1e-9):.2f} step/s)")
        if (step + 1) % STATE_EVERY == 0 or step == total - 1:
            with open_private(state_path) as fh:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                            "step": step + 1, "history": history, "recipe": recipe}, fh)
    train_seconds = time.time() - t_train
    export(model, out, seed)
    meta = {
        **recipe, "threads": threads, "resumed_at": start_step if resumed is not None else None,
        "copy_steps": len(copy_history),
        "copy_loss_every_50": [round(sum(copy_history[i:i + 50]) / len(copy_history[i:i + 50]), 4)
                               for i in range(0, len(copy_history), 50)],
        "recall_steps": len(recall_history),
        "recall_loss_every_50": [round(sum(recall_history[i:i + 50]) / len(recall_history[i:i + 50]), 4)
                                 for i in range(0, len(recall_history), 50)],
        "train_seconds": round(train_seconds, 1),
        # with --init-from, the time of every run the weights went through, this one included
        "train_seconds_total": round(train_seconds + (recipe["init_from"] or {}).get("train_seconds_total", 0), 1),
        "total_seconds": round(time.time() - t0, 1), "tokens": n_tok, "trained_tokens": n_trained,
        "final_loss": sum(history[-50:]) / max(1, len(history[-50:])),
        "loss_every_50": [round(sum(history[i:i + 50]) / len(history[i:i + 50]), 4)
                          for i in range(0, len(history), 50)],
        "preset": DEMO_PRESET.note, "torch": torch.__version__,
        "parameters": sum(int(x.numel()) for x in model.parameters()),
    }
    write_private(out / "training.json", json.dumps(meta, indent=2) + "\n")
    state_path.unlink(missing_ok=True)   # only for resuming an interrupted run; never shipped
    return meta


# ----------------------------------------------------------------------------- export


def export(model: Any, out: Path, seed: int) -> None:
    """Write the trained weights as a K3 checkpoint: BF16/F32 trunk as stored, MXFP4 experts."""
    import torch

    p = model.p
    vocab = model.vocab_size
    values = {name: model.weight(name).detach().to(torch.float32).numpy() for name in model.names}

    def tensor(name: str) -> Any:
        v = values[name]
        return bf16_tensor(name, v) if model.storage[name] == "bf16" else f32_tensor(name, v)

    model_level = [tensor(LM + "embed_tokens.weight"), tensor("language_model.lm_head.weight"),
                   tensor(LM + "norm.weight"), tensor(LM + "output_attn_res_norm.weight"),
                   tensor(LM + "output_attn_res_proj.weight")]
    layers = []
    for layer in range(p.num_hidden_layers):
        base = f"{LM}layers.{layer}."
        trunk = [tensor(n) for n in model.names if n.startswith(base) and model.storage[n] != "mxfp4"]
        lt = LayerTensors(trunk)
        if p.is_moe(layer):
            stacked = {part: model.w(f"{base}block_sparse_moe.experts.{part}").detach().double().numpy()
                       for part in ("w1", "w2", "w3")}
            for e in range(p.num_experts):
                prefix = f"{base}block_sparse_moe.experts.{e}"
                parts = {}
                for part in ("w1", "w2", "w3"):
                    packed, scales = quantize_checked(f"{prefix}.{part}", stacked[part][e])
                    parts[f"{part}.weight_packed"] = u8_tensor(f"{prefix}.{part}.weight_packed", packed)
                    parts[f"{part}.weight_scale"] = u8_tensor(f"{prefix}.{part}.weight_scale", scales)
                lt.experts[e] = [parts[k] for k in EXPERT_PARTS]
        layers.append(lt)
    for old in out.glob("model-*.safetensors"):
        old.unlink()
    write_sharded(out, plan_shards(ModelTensors(layers, model_level), seed, scrambled=False), {"format": "pt"})
    write_private(out / "config.json", json.dumps(build_config(p, vocab, read_special_ids(out)), indent=2) + "\n")


# --------------------------------------------------------------------------- recording


def torch_greedy(model: Any, prompt: list[int], end_ids: frozenset[int], max_new: int = MAX_NEW) -> list[int]:
    """Greedy continuation with the model's cache (the prompt in one call, then one token per
    call), stopping after an end id, which is never fed."""
    import torch

    out: list[int] = []
    cache: dict = {}
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt)]), cache=cache)[0, -1]
        for _ in range(max_new):
            nxt = int(torch.argmax(logits))
            out.append(nxt)
            if nxt in end_ids:
                break
            logits = model(torch.tensor([[nxt]]), cache=cache)[0, -1]
    return out


def record_prompts(model_dir: Path, *, seed: int = PROMPT_SEED, per: int = PROMPTS_PER_TASK_MODE,
                   limit: int | None = None) -> int:
    """Greedy answers of the exported checkpoint, computed by torch (float32, as the engine)."""
    from k3engine.train import require_torch
    from k3engine.train.model import K3Torch
    from k3chat.template import Grammar, MalformedTurn
    from k3chat.tokenizer import Tokenizer

    torch = require_torch()
    torch.set_num_threads(1)              # one token at a time: small ops, no thread fan-out
    tok = Tokenizer.from_dir(model_dir)
    model = K3Torch(DEMO_PRESET, tok.vocab_size)
    model.quantize = False
    model.load_checkpoint(model_dir)
    grammar = Grammar(tok)
    rows = []
    for task, mode, conv in tasks.sample_prompts(seed, per)[:limit]:
        turn = conv.scored[-1]
        prompt = corpus.prompt_ids(conv, turn, tok)
        gen = torch_greedy(model, prompt, tok.end_ids)
        thinking, _ = tasks.thinking_of(mode)
        try:
            parsed = grammar.parse_strict(gen, thinking)
            reasoning, answer, ok = parsed.reasoning, parsed.content, True
        except MalformedTurn:
            reasoning, answer, ok = None, tok.decode([i for i in gen if not tok.is_special(i)]), False
        t = conv.turns[turn]
        rows.append({"task": task, "mode": mode,
                     "messages": tasks.messages_for(conv, turn + 1, answered=False),
                     "prompt_ids": prompt, "greedy_ids": gen, "well_formed": ok,
                     "reasoning": reasoning, "answer": answer, "accept": list(t.accept),
                     "extract": t.extract, "correct": ok and tasks.is_correct(t, answer)})
        _log(f"recorded {task}/{mode}: {'ok' if rows[-1]['correct'] else 'WRONG'} {answer[:60]!r}")
    with open_private(model_dir / "prompts.jsonl") as f:
        for r in rows:
            f.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
    return len(rows)


# ------------------------------------------------------------------------------- CLI


def parse_mix(text: str) -> tuple[tuple[tuple[str, float], ...], list[str]]:
    """``--mix add_3d=0.12,count=0.14`` -> ((task, weight), ...) and what is wrong with it."""
    pairs: list[tuple[str, float]] = []
    bad: list[str] = []
    for item in filter(None, (x.strip() for x in text.split(","))):
        name, eq, value = item.partition("=")
        try:
            weight = float(value) if eq else -1.0
        except ValueError:
            weight = -1.0
        if name not in tasks.SINGLE_TASKS:
            bad.append(f"--mix: unknown task {name!r} (tasks: {', '.join(tasks.SINGLE_TASKS)})")
        elif not (weight >= 0 and math.isfinite(weight)):
            bad.append(f"--mix: {item!r} needs TASK=WEIGHT with a weight >= 0, as in add_3d=0.12")
        elif name in dict(pairs):
            bad.append(f"--mix: {name} is given twice")
        else:
            pairs.append((name, weight))
    if pairs and not bad:
        moved = dict(pairs)
        if sum(moved.get(n, w) for n, (w, _) in tasks.SINGLE_TASKS.items()) <= 0:
            bad.append("--mix: the weights add up to 0, so no task could be drawn")
    return tuple(pairs), bad


# The training text's on/off experiments: TextStyle's field, and what --FIELD does (its help)
TEXT_SWITCHES: dict[str, str] = {
    "sign_by_places": "a difference decides its sign with the place-by-place verdict `compare` "
                      "writes, at every effort (an experiment)",
    "count_decisions": "counting says on every spelled line whether its letter is the one counted "
                       "(\"a: no\", \"r: yes (2)\"), an experiment",
    "count_letter_alone": "counting first writes the letter to count alone on its line, the same id "
                          "as the spelled letters (an experiment)",
    "doc_labels_first": "a question about a file first says which labels it asks for, copied from "
                        "the question, then quotes the file's lines (an experiment)",
    "doc_walk": "a question about a file is worked by copying the file's lines in order, marking the "
                "two it asks for where they stand, then the arithmetic (an experiment)",
    "doc_any_order": "a question about a file names its two labels in either order, about a file "
                     "of 2 to 4 lines, so that taking the figures in the file's order is no longer "
                     "right for most of them (an experiment)",
    "off_steps_by_place": "a thinking-off sum or difference lists the column lines the reasoning "
                          "writes (place, digits, then the borrow), an experiment",
}


def compile_unavailable() -> str:
    """Why torch.compile cannot build a kernel on this machine ("" when it can): tried on a
    tiny function before any data is made, rather than failing at the first step."""
    from k3engine.train import require_torch

    torch = require_torch()
    try:
        torch.compile(lambda x: x * 2.0 + 1.0)(torch.ones(4))
    except Exception as exc:  # noqa: BLE001 (any failure to build means no --compile)
        return f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
    return ""


def main(argv: Sequence[str]) -> int:
    ap = argparse.ArgumentParser(prog="k3chat train-demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--steps", type=int, default=2500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=60000)
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--final-lr", type=float, default=0.1, metavar="FRACTION",
                    help="the cosine schedule ends at --lr times FRACTION (default 0.1, as the "
                         "shipped demo was trained; a lower one is an experiment)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tie-embeddings", action="store_true",
                    help="train the embedding and lm_head as one matrix, exported as K3's two tensors "
                         "(an experiment, not how the shipped demo was trained: measured worse, "
                         "reverse 7.5%% and count 46%% against 56%% and 71%% untied)")
    ap.add_argument("--copy-warmup", type=int, default=0, metavar="STEPS",
                    help="first train STEPS steps on copying runs of random ids (an experiment: 600 "
                         "steps before 1,250 task steps measured far worse on every task)")
    ap.add_argument("--copy-mix", type=int, default=0, metavar="ROWS",
                    help="add ROWS rows of copying a run of 3-12 task words and letters to every "
                         "task step, with their own loss (0: off; the shipped demo was trained with 32 "
                         "until step 250, words only: README; 16 rows for the whole run measured far "
                         "worse on reversing and counting)")
    ap.add_argument("--copy-mix-from", type=int, default=0, metavar="STEP",
                    help="with --copy-mix: add the copy rows only from task step STEP on, so the "
                         "steps before it are the plain run's")
    ap.add_argument("--copy-mix-until", type=int, default=0, metavar="STEP",
                    help="with --copy-mix: stop adding the copy rows at task step STEP (0: never), "
                         "so the rest of the run trains on the tasks alone")
    ap.add_argument("--copy-words-only", action="store_true",
                    help="with --copy-mix: draw the copy rows from the tasks' words only, no single "
                         "letters (as the shipped demo was trained)")
    ap.add_argument("--recall-mix", type=int, default=0, metavar="ROWS",
                    help="add ROWS rows of looking up a file's figures by their labels to every task "
                         "step, with their own loss (0: off; an experiment for questions about a file)")
    ap.add_argument("--recall-mix-until", type=int, default=0, metavar="STEP",
                    help="with --recall-mix: stop adding those rows at task step STEP (0: never)")
    for field, why in TEXT_SWITCHES.items():
        ap.add_argument(f"--{field.replace('_', '-')}", action="store_true", help=f"training text: {why}")
    ap.add_argument("--mix", default="", metavar="TASK=WEIGHT,...",
                    help="training text: these weights replace the named tasks' default weights "
                         "among single-task conversations (an experiment; others keep theirs)")
    ap.add_argument("--off-share", type=float, default=0.0, metavar="FRACTION",
                    help="training text: this share of the conversations has thinking off, the rest "
                         "the three efforts alike (default 0: every mode alike, a quarter each; an "
                         "experiment)")
    ap.add_argument("--count-weight", type=float, default=1.0, metavar="W",
                    help="the loss on each counting decision (the id after a spelled letter: its "
                         "mark or its newline) weighs W ids (default 1; an experiment)")
    ap.add_argument("--ffn-lr", type=float, default=1.0, metavar="FRACTION",
                    help="the feed-forward weights (dense MLP, router, shared and routed experts) "
                         "learn at FRACTION of the rate (default 1; an experiment: python -m "
                         "k3chat.demo.recall_probe --ffn-lr)")
    ap.add_argument("--compile", action="store_true",
                    help="run the forward pass's norms, Block AttnRes and gated units through "
                         "torch.compile (needs a C++ compiler) and MLA through torch's fused "
                         "attention: steps about 1.25 times as fast on 2 cores (python -m "
                         "k3chat.demo.step_bench); the same model up to rounding, so another model "
                         "than the same run without it")
    ap.add_argument("--init-from", default=None, metavar="SRC",
                    help="start from the weights and tokenizer of the checkpoint train-demo wrote in "
                         "SRC rather than from random ones (the schedule and text are this run's; "
                         "training.json records SRC's recipe and counts both runs' time)")
    ap.add_argument("--resume", action="store_true", help="continue from DIR/train_state.pt")
    ap.add_argument("--record-only", action="store_true", help="only (re)write prompts.jsonl")
    try:
        args = ap.parse_args(list(argv))
    except SystemExit as exc:
        return int(exc.code or 0)
    bad = [f"--{k.replace('_', '-')} must be >= 1" for k in ("steps", "conversations", "batch_tokens", "threads")
           if getattr(args, k) < 1]
    bad += [f"--{k.replace('_', '-')} must be >= 0" for k in ("copy_warmup", "copy_mix", "copy_mix_from", "copy_mix_until")
            if getattr(args, k) < 0]
    given = [f"--{k}" for k in ("copy-mix-from", "copy-mix-until", "copy-words-only") if getattr(args, k.replace("-", "_"))]
    if given and not args.copy_mix:
        bad.append(f"{' and '.join(given)} {'needs' if len(given) == 1 else 'need'} --copy-mix ROWS")
    elif args.copy_mix_from >= args.steps >= 1:
        bad.append(f"--copy-mix-from must be below --steps ({args.steps}): no step would add copy rows")
    elif args.copy_mix_until and not args.copy_mix_from < args.copy_mix_until <= args.steps:
        bad.append(f"--copy-mix-until must be above --copy-mix-from ({args.copy_mix_from}) and at most "
                   f"--steps ({args.steps})")
    bad += [f"--{k.replace('_', '-')} must be >= 0" for k in ("recall_mix", "recall_mix_until")
            if getattr(args, k) < 0]
    if args.recall_mix_until and not args.recall_mix:
        bad.append("--recall-mix-until needs --recall-mix ROWS")
    elif args.recall_mix_until > args.steps >= 1:
        bad.append(f"--recall-mix-until must be at most --steps ({args.steps})")
    weights, why = parse_mix(args.mix)
    bad += why
    if not 0 <= args.final_lr <= 1:
        bad.append(f"--final-lr must be a fraction of --lr from 0 to 1, not {args.final_lr}")
    if not 0 < args.ffn_lr <= 1:
        bad.append(f"--ffn-lr must be a fraction of --lr above 0 and at most 1, not {args.ffn_lr}")
    if not 0 <= args.off_share < 1:
        bad.append(f"--off-share must be a fraction from 0 to below 1, not {args.off_share}")
    if not 1 <= args.count_weight <= 1000:
        bad.append(f"--count-weight must be from 1 to 1000, not {args.count_weight}")
    if bad or not args.lr > 0:
        print(f"k3chat train-demo: {'; '.join(bad) or '--lr must be > 0'}", file=sys.stderr)
        return 2
    if args.compile and not args.record_only:
        broken = compile_unavailable()
        if broken:
            print(f"k3chat train-demo: --compile: torch.compile does not work here ({broken}); install a "
                  "C++ compiler (g++), or train without --compile", file=sys.stderr)
            return 2
    out = Path(args.out)
    init_from = Path(args.init_from) if args.init_from else None
    if init_from and not args.record_only:     # refused before torch is needed or any data made
        try:
            read_init_source(init_from, out)
        except InitRefused as exc:
            print(f"k3chat train-demo: {exc}", file=sys.stderr)
            return 2
    style = tasks.TextStyle(weights=weights, off_share=args.off_share,
                            **{field: getattr(args, field) for field in TEXT_SWITCHES})
    if not args.record_only:
        try:
            with tasks.text_style(style):
                meta = train(out, steps=args.steps, seed=args.seed, conversations=args.conversations,
                             batch_tokens=args.batch_tokens, lr=args.lr, threads=args.threads,
                             resume=args.resume, tie_embeddings=args.tie_embeddings,
                             copy_warmup=args.copy_warmup, copy_mix=args.copy_mix,
                             copy_mix_from=args.copy_mix_from, copy_words_only=args.copy_words_only,
                             copy_mix_until=args.copy_mix_until, final_lr=args.final_lr,
                             count_weight=args.count_weight, recall_mix=args.recall_mix,
                             recall_mix_until=args.recall_mix_until, compiled=args.compile,
                             ffn_lr=args.ffn_lr, init_from=init_from)
        except (ResumeRefused, InitRefused) as exc:
            print(f"k3chat train-demo: {exc}", file=sys.stderr)
            return 2
        _log(f"trained in {meta['train_seconds']:.0f} s, final loss {meta['final_loss']:.4f}")
    n = record_prompts(out)
    _log(f"recorded {n} prompts in {out / 'prompts.jsonl'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
