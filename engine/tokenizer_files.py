"""Write a small K3-format tokenizer (tiktoken.model + tokenizer_config.json) for fixtures.

The files have the real layout (spec k3-chat.md 3.1/3.2): dense ranks 0..N-1 (the 256
one-byte tokens first, then BPE merges learned from a small embedded corpus), and a
256-slot special block at N..N+255 with K3's 16 named slots at the real offsets from N.

Merges are learned on pieces cut by K3's pre-tokenization pattern (3.3), so the fixture
tokenizer behaves like the real one on the same kind of text. Every merged token of rank r
is reachable: lowest-rank-first BPE of its bytes over ranks < r ends in exactly two tokens,
which merge into it. Output is deterministic (same bytes every run).

This module must not import k3chat or textual (dependencies point one way).
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from pathlib import Path
from typing import Callable, Iterable

import regex  # a dependency of tiktoken; needed for the V1 class intersection `&&`

from .private_files import make_private_dirs, write_private

# K3's pre-tokenization pattern, verbatim from spec 3.3 (eight alternatives joined by `|`).
K3_PAT_STR: str = "|".join(
    [
        r"""[\p{Han}]+""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)

# Offsets from N of K3's 16 named special slots (real N = 163584), spec 3.2.
SPECIAL_SLOT_NAMES: dict[int, str] = {
    0: "[BOS]",
    1: "[EOS]",
    2: "<|end_of_msg|>",
    3: "<|open|>",
    4: "<|close|>",
    5: "<|sep|>",
    6: "[start_header_id]",
    7: "[end_header_id]",
    9: "[EOT]",
    18: "<|media_begin|>",
    19: "<|media_content|>",
    20: "<|media_end|>",
    21: "<|media_pad|>",
    65: "<osagent_mode>",
    254: "[UNK]",
    255: "[PAD]",
}

SPECIAL_BLOCK: int = 256
DEFAULT_N_RANKS: int = 1024

# Training text, written for this fixture: English prose, Chinese, code, and the XTML words
# the chat template renders (so common tags tend to become few ids, as in the real model).
_CORPUS: str = r"""
message role="system" type="thinking-effort"
message role="user"
message role="assistant"
message role="tool" tool="search" index="1"
think response tools call argument json
`thinking_effort` guides on how much to think in your thinking channel (not including the response channel), supported values include `low`, `medium`, `high`, and `max`.
Now the system is invoked with `thinking_effort=max`.
Now the system is invoked with `thinking_effort=low`.
Now the system is invoked with `thinking_effort=high`.
You are helpful. You are a helpful assistant. Hello! Hello, world. Hello there.
What is the capital of France? The capital of France is Paris. Paris is a city in France.
Numbers? I'll remember 215 and 222. The numbers were 473, 921, 235. What were the other two?
The quick brown fox jumps over the lazy dog. She sells sea shells by the sea shore.
It's a small model, but it's ours. We're running it locally, and they've tested it well.
I'd like to read the file, then we'll write the answer back to the terminal.
Private chat on your own machine: nothing leaves it, and the model streams its experts.
The weather today is sunny with a light breeze; tomorrow it will rain in the afternoon.
Please summarise the following paragraph in three short sentences.
Thank you for the question. Let me think about it step by step before I answer.
First, read the input. Second, check the numbers. Third, write the result.
Error: the file could not be opened (permission denied). Try again later.

中文English混合 A中B 你好，世界。今天天气很好，我们去公园散步吧。
我是一个有帮助的助手。请用中文回答下面的问题。
北京是中国的首都，上海是中国最大的城市。人工智能正在改变我们的生活和工作方式。
模型在本地运行，数据不会离开你的电脑。这是一个小型的测试词表。
学习编程需要耐心和练习。每天写一点代码，慢慢就会进步。
春天来了，花开了，鸟儿在树上唱歌。我们一起读书，一起思考问题。

def encode(text: str, *, allow_special: bool = False) -> list[int]:
    '''Encode text into token ids.'''
    ids: list[int] = []
    for piece in split(text):
        if piece in ranks:
            ids.append(ranks[piece])
        else:
            ids.extend(merge(piece))
    return ids

class Sampler:
    def __init__(self, seed: int = 0, temperature: float = 1.0) -> None:
        self.seed = seed
        self.temperature = temperature

    def sample(self, logits):
        return max(range(len(logits)), key=lambda i: logits[i])

for (int i = 0; i < n; i++) {
    if (x[i] > best) { best = x[i]; idx = i; }
}
return idx;

const result = await fetch("/api/v1/items?limit=10");
if (!result.ok) { throw new Error(`status ${result.status}`); }
SELECT name, count(*) FROM users WHERE age >= 18 GROUP BY name ORDER BY name;
x = [1, 2, 3]; y = {"a": 1, "b": 2}; z = (x, y)
path = "/home/user/.config/k3chat/config.toml"
https://example.com/docs/index.html
!
/x
0123456789 10 100 1000 2024 3.14159 42
"""


def _pretokenize(text: str) -> list[str]:
    """Cut text into pieces with K3's pattern (V1 is needed for `&&`)."""
    return regex.findall(K3_PAT_STR, text, flags=regex.V1)


def _bpe(piece: bytes, ranks: dict[bytes, int]) -> list[bytes]:
    """Lowest-rank-first BPE (leftmost on ties), as tiktoken merges a piece."""
    parts = [piece[i : i + 1] for i in range(len(piece))]
    while len(parts) > 1:
        best_rank: int | None = None
        best_i = -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1])
            if rank is not None and (best_rank is None or rank < best_rank):
                best_rank, best_i = rank, i
        if best_rank is None:
            break
        parts[best_i : best_i + 2] = [parts[best_i] + parts[best_i + 1]]
    return parts


def _pairs(parts: list[bytes]) -> list[tuple[bytes, bytes]]:
    return list(zip(parts, parts[1:]))


def _pick_pair(counts: Counter[tuple[bytes, bytes]], rejected: set[tuple[bytes, bytes]]) -> tuple[bytes, bytes] | None:
    """Most frequent pair; ties go to the lexicographically smallest (deterministic)."""
    live = [(c, p) for p, c in counts.items() if c > 0 and p not in rejected]
    if not live:
        return None
    top = max(c for c, _ in live)
    return min(p for c, p in live if c == top)


def learn_ranks(n_ranks: int = DEFAULT_N_RANKS) -> dict[bytes, int]:
    """Learn `n_ranks` dense ranks: bytes 0..255, then merges from the embedded corpus."""
    return learn_ranks_from(Counter(p.encode("utf-8") for p in _pretokenize(_CORPUS)), n_ranks)


def piece_counts(texts: Iterable[str]) -> Counter[bytes]:
    """How often each pre-tokenized piece occurs in the texts (each text cut alone)."""
    freq: Counter[bytes] = Counter()
    for text in texts:
        freq.update(p.encode("utf-8") for p in _pretokenize(text))
    return freq


def learn_ranks_from(freq: Counter[bytes], n_ranks: int, *,
                     allow: Callable[[bytes], bool] | None = None) -> dict[bytes, int]:
    """Learn `n_ranks` dense ranks from piece counts: bytes 0..255, then the most frequent
    merges. ``allow(token)`` may refuse a merged token (the demo keeps every digit alone)."""
    if n_ranks < 256:
        raise ValueError(f"n_ranks must be >= 256 (all one-byte tokens), got {n_ranks}")
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    words: dict[bytes, list[bytes]] = {w: _bpe(w, ranks) for w in freq}
    counts: Counter[tuple[bytes, bytes]] = Counter()
    for w, parts in words.items():
        for pair in _pairs(parts):
            counts[pair] += freq[w]
    rejected: set[tuple[bytes, bytes]] = set()
    while len(ranks) < n_ranks:
        pair = _pick_pair(counts, rejected)
        if pair is None:
            raise ValueError(f"the corpus supports at most {len(ranks)} ranks, asked for {n_ranks}")
        token = pair[0] + pair[1]
        # Keep only tokens that BPE can build from lower ranks in one final merge.
        if len(_bpe(token, ranks)) != 2 or (allow is not None and not allow(token)):
            rejected.add(pair)
            continue
        ranks[token] = len(ranks)
        _reencode(words, freq, counts, ranks, token)
    return ranks


def _reencode(
    words: dict[bytes, list[bytes]],
    freq: Counter[bytes],
    counts: Counter[tuple[bytes, bytes]],
    ranks: dict[bytes, int],
    token: bytes,
) -> None:
    """Re-run BPE on the words a new token can change (those containing its bytes)."""
    for w, old in words.items():
        if token not in w:
            continue
        new = _bpe(w, ranks)
        if new == old:
            continue
        for pair in _pairs(old):
            counts[pair] -= freq[w]
            if counts[pair] <= 0:
                del counts[pair]
        for pair in _pairs(new):
            counts[pair] += freq[w]
        words[w] = new


def tiktoken_model_bytes(ranks: dict[bytes, int]) -> bytes:
    """Serialise ranks as `base64(bytes) rank` lines in rank order, LF-terminated."""
    lines = [
        base64.b64encode(tok).decode("ascii") + " " + str(rank)
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    ]
    return ("\n".join(lines) + "\n").encode("ascii")


def tokenizer_config(n_ranks: int) -> dict[str, object]:
    """The tokenizer_config.json content: 16 named slots at the real offsets from N."""
    decoder: dict[str, dict[str, object]] = {}
    for offset, name in sorted(SPECIAL_SLOT_NAMES.items()):
        decoder[str(n_ranks + offset)] = {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|end_of_msg|>", "<|open|>", "<|close|>", "<|sep|>"],
        "bos_token": "[BOS]",
        "clean_up_tokenization_spaces": False,
        "eos_token": "[EOS]",
        "model_max_length": 1048576,
        "pad_token": "[PAD]",
        "tokenizer_class": "TikTokenTokenizer",
        "unk_token": "[UNK]",
    }


def write_fixture_tokenizer(out_dir: str | Path, *, n_ranks: int | None = None) -> int:
    """Write tiktoken.model and tokenizer_config.json into out_dir; return N + 256."""
    n = DEFAULT_N_RANKS if n_ranks is None else int(n_ranks)
    return write_tokenizer(out_dir, learn_ranks(n))


def write_tokenizer(out_dir: str | Path, ranks: dict[bytes, int]) -> int:
    """Write tiktoken.model and tokenizer_config.json for learned ranks; return N + 256."""
    n = len(ranks)
    out = make_private_dirs(out_dir)
    write_private(out / "tiktoken.model", tiktoken_model_bytes(ranks))
    config_text = json.dumps(tokenizer_config(n), indent=2, ensure_ascii=False) + "\n"
    write_private(out / "tokenizer_config.json", config_text.encode("utf-8"))
    return n + SPECIAL_BLOCK
