"""Write the tiny fixture and an open spec the C driver (bits.c) reads on any architecture.

usage: open_spec.py FIXTURE_DIR SPEC_OUT PY_LOGITS_OUT

The spec holds what k3engine.Model hands k3_model_open: the config struct and each set of
open options as raw bytes (k3_config and k3_open_opts have the same layout on x86-64 and
AArch64: int32, uint64, float and uint8 fields, little-endian, natural alignment; the
driver checks the sizes), the shard paths and the tensor table, then the ids to feed.
PY_LOGITS_OUT gets the logits k3engine computes here through cffi, for the driver's x86
run to match bit for bit (so the driver opens the model as the Python side does).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np

from k3engine._k3 import ffi
from k3engine.fixture import write_fixture
from k3engine.model import _DTYPES, Model, StreamOptions, engine_config

# Everything resident; then the smallest settings: experts through a small cache with
# lookahead and direct I/O, trunk through a two-slot ring, embedding rows read per token.
OPTIONS = {
    "resident": StreamOptions(),
    "streamed": StreamOptions(expert_cache_bytes=9 * 16384, trunk_stream=True, ring_slots=2,
                              embed_stream=True, lookahead=2, direct_io=True),
}


def main(fixture_dir: str, spec_out: str, logits_out: str) -> int:
    model_dir = write_fixture("tiny", Path(fixture_dir))
    with np.load(model_dir / "oracle.npz") as oracle:
        ids = [int(x) for x in oracle["full_ids"]]
    lines: list[str] = []
    with Model(model_dir) as m:
        lines.append("config " + bytes(ffi.buffer(engine_config(m.config))).hex())
        for label, so in OPTIONS.items():
            lines.append(f"opts {label} " + bytes(ffi.buffer(m._opts(so))).hex())
        shards = m.checkpoint.shards
        index = {s: i for i, s in enumerate(shards)}
        for s in shards:
            path = os.fsdecode(m.checkpoint.path(s))
            if any(c.isspace() for c in path):
                raise SystemExit(f"open_spec: shard path {path!r} has white space; use another directory")
            lines.append(f"shard {path}")
        for t in m.checkpoint.tensors.values():
            shape = list(t.shape) + [0] * (4 - len(t.shape))
            lines.append(f"tensor {t.name} {index[t.shard]} {_DTYPES[t.dtype]} {len(t.shape)} "
                         + " ".join(str(n) for n in shape) + f" {t.start} {t.nbytes}")
        lines.append("ids " + " ".join(str(i) for i in ids))
        logits = m.forward(ids).astype(np.float32)
    Path(spec_out).write_text("\n".join(lines) + "\n")
    Path(logits_out).write_bytes(np.ascontiguousarray(logits).tobytes())
    print(f"open_spec: {len(ids)} ids, vocab {logits.shape[1]}, {len(shards)} shards, "
          f"{len(m.checkpoint.tensors)} tensors")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    sys.exit(main(*sys.argv[1:]))
