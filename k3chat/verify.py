"""`k3chat verify MODEL_DIR`: check a downloaded checkpoint before trusting it.

Every shard's size (the one its own header describes) and SHA-256 are checked against a
manifest, and every safetensors header, the index and the config are checked with the
validators the model loader uses (engine/safetensors_io.py, engine/catalog.py). Where the
expected hashes come from, first that applies:

1. `--manifest FILE`: a `sha256sum`-format file (`<64 hex>  <name>`), names relative to
   MODEL_DIR; with `--write-manifest` FILE is written instead (it must not exist yet).
2. A Hugging Face cache snapshot (`.../models--ORG--NAME/snapshots/REV/`): each file is a
   symlink to `../../blobs/<sha256>`, and for LFS files the blob name IS the SHA-256.
3. The manifest this command wrote for MODEL_DIR on its first run (0600, in the state
   directory); on that first run the hashes are recorded, not checked.

Hashing reads each file in 16 MiB blocks on a reader thread while another hashes (hashlib
releases the GIL), at most three blocks per file in memory, `--jobs` files at once (one
core's SHA-256 is slower than a fast SSD). Progress with an ETA
goes to stderr. Verified shards are recorded (size, mtime, SHA-256) in a progress file after
each one, so a run stopped by Ctrl-C (exit 5) resumes where it stopped; a run that completes
removes that record, so the next run reads everything again. Exit 0 only when
everything is well; 2 when a shard is missing or damaged (the report names it and what to
download again); 1 when a file could not be read.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import queue
import re
import shlex
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from k3engine.exit_codes import EXIT_INTERRUPTED, EXIT_OK, EXIT_RUNTIME, EXIT_USAGE
from k3engine.errors import CheckpointError

from .paths import atomic_write, ensure_private_dir, state_dir
from .runtime import Failure

__all__ = ["main_verify", "add_arguments", "hash_file", "read_manifest", "hf_snapshot",
           "READ_BLOCK"]

READ_BLOCK = 16 * 1024 * 1024  # large sequential reads run at disk speed
BLOCKS_IN_FLIGHT = 2  # read ahead of the hasher; with the one being hashed, 3 in memory
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MANIFEST_LINE = re.compile(r"([0-9a-fA-F]{64}) [ *](.+)")

# What a shard can be found to be (the report's "status").
OK, MISSING, WRONG_SIZE, WRONG_HASH, BAD_HEADER, UNREADABLE, NO_HASH, BAD_INDEX = (
    "ok", "missing", "wrong size", "wrong hash", "bad header", "unreadable",
    "not in the manifest", "bad index or config")


@dataclass
class FileReport:
    name: str
    status: str = OK
    detail: str = ""
    size: int | None = None
    sha256: str | None = None  # computed (None: not hashed)
    expected_sha256: str | None = None
    skipped: bool = False  # verified by an earlier run (same size and mtime)
    redownload: str = ""


@dataclass(frozen=True)
class HFSnapshot:
    """Where a Hugging Face cache snapshot came from (`models--ORG--NAME/snapshots/REV`)."""

    repo: str | None
    revision: str
    cache_dir: Path  # the hub cache holding `models--ORG--NAME`


def hf_snapshot(model_dir: Path) -> HFSnapshot | None:
    """The snapshot MODEL_DIR is in the Hugging Face cache layout, or None."""
    resolved = model_dir.resolve()
    if resolved.parent.name != "snapshots" or not (resolved.parent.parent / "blobs").is_dir():
        return None
    parts = resolved.parent.parent.name.split("--")
    repo = "/".join(parts[1:]) if len(parts) >= 3 and parts[0] == "models" else None
    return HFSnapshot(repo, resolved.name, resolved.parent.parent.parent)


def hf_blob_sha256(path: Path) -> str | None:
    """The SHA-256 a snapshot file's blob name gives (LFS files), or None (git blobs are
    named by their SHA-1, and a copied file has no blob)."""
    if not path.is_symlink():
        return None
    target = Path(os.readlink(path))
    blob = target.name
    if target.parent.name != "blobs" or not _SHA256.fullmatch(blob):
        return None
    return blob


def read_manifest(path: Path) -> dict[str, str]:
    """A `sha256sum`-format file as name -> lower-case hex; a bad line is a usage error."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise Failure(f"cannot read the manifest {path}: {exc}. What to do: give a "
                      f"sha256sum-format file (`<sha256>  <file name>` per line)", EXIT_USAGE)
    out: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        match = _MANIFEST_LINE.fullmatch(line.rstrip("\r"))
        if not match:
            raise Failure(f"{path}, line {number}: not a sha256sum line (`<64 hex>  <file "
                          f"name>`): {line[:80]!r}", EXIT_USAGE)
        out[match.group(2)] = match.group(1).lower()
    return out


def manifest_text(hashes: dict[str, str]) -> str:
    """`sha256sum -c` can check what we write, from MODEL_DIR."""
    return "".join(f"{sha}  {name}\n" for name, sha in sorted(hashes.items()))


# ---------------------------------------------------------------------------------------
# Hashing at disk speed in bounded memory
# ---------------------------------------------------------------------------------------


def hash_file(path: Path, on_bytes: Callable[[int], None] = lambda n: None,
              block: int = READ_BLOCK, cancel: threading.Event | None = None) -> str:
    """SHA-256 of `path`, read on a reader thread in `block`-byte reads ahead of the hasher;
    KeyboardInterrupt between blocks once `cancel` is set."""
    full: queue.Queue[tuple[bytearray, int] | BaseException | None] = queue.Queue()
    free: queue.Queue[bytearray] = queue.Queue()
    for _ in range(BLOCKS_IN_FLIGHT + 1):
        free.put(bytearray(block))
    stop = threading.Event()

    def reader() -> None:
        try:
            with open(path, "rb", buffering=0) as fh:
                if hasattr(os, "posix_fadvise"):  # read once, in order: say so to the kernel
                    os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
                while not stop.is_set():
                    buf = free.get()
                    n = fh.readinto(buf)
                    if not n:
                        break
                    full.put((buf, n))
            full.put(None)
        except BaseException as exc:  # handed to the hasher, which raises it
            full.put(exc)

    thread = threading.Thread(target=reader, name="k3chat-verify-reader", daemon=True)
    thread.start()
    digest = hashlib.sha256()
    try:
        while True:
            item = full.get()
            if item is None:
                return digest.hexdigest()
            if isinstance(item, BaseException):
                raise item
            buf, n = item
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt
            digest.update(memoryview(buf)[:n])
            free.put(buf)
            on_bytes(n)
    finally:
        stop.set()
        free.put(bytearray(0))  # wake a reader waiting for a buffer; it sees `stop`


class Meter:
    """Progress with an ETA on stderr: a line rewritten in place on a terminal, else a line
    every 10 s."""

    def __init__(self, total: int, stream: Any = None) -> None:
        self.total, self.done, self.start = total, 0, time.monotonic()
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = 1.0 if self.tty else 10.0
        self.last = 0.0
        self.name = ""
        self._lock = threading.Lock()  # several files are hashed at once

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self.last >= self.every:
                self.last = now
                self.show(now)

    def show(self, now: float | None = None) -> None:
        elapsed = (now or time.monotonic()) - self.start
        speed = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / speed if speed > 0 else 0.0
        pct = 100.0 * self.done / self.total if self.total else 100.0
        text = (f"k3chat verify: {self.done / 1e9:,.1f} of {self.total / 1e9:,.1f} GB "
                f"({pct:.1f}%), {speed / 1e9:.2f} GB/s, ETA {_duration(eta)}: {self.name}")
        self.stream.write(("\r" + text + "\x1b[K") if self.tty else text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty and self.last:
            self.stream.write("\n")


def _duration(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}h{s // 60 % 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


# ---------------------------------------------------------------------------------------
# Resuming: shards verified by an earlier run
# ---------------------------------------------------------------------------------------


def _dir_key(model_dir: Path) -> str:
    return hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:20]


class Progress:
    """Shards already verified for one MODEL_DIR: name -> size, mtime_ns, sha256 (0600 JSON
    in the state directory, rewritten atomically after each shard)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.done: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            self.done = {k: v for k, v in data.get("verified", {}).items() if isinstance(v, dict)}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, AttributeError):
            print(f"k3chat verify: the progress file {path} is damaged; verifying every shard "
                  f"again", file=sys.stderr)

    def verified(self, name: str, st: os.stat_result, expected: str | None) -> str | None:
        """The recorded SHA-256 if `name` was verified with this size and mtime (and against
        this expected hash, when there is one), else None."""
        rec = self.done.get(name)
        if not rec or rec.get("size") != st.st_size or rec.get("mtime_ns") != st.st_mtime_ns:
            return None
        sha = rec.get("sha256")
        if not isinstance(sha, str) or (expected is not None and sha != expected):
            return None
        return sha

    def finish(self) -> None:
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass

    def record(self, name: str, st: os.stat_result, sha: str) -> None:
        with self._lock:
            self.done[name] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha}
            ensure_private_dir(self.path.parent)
            atomic_write(self.path, (json.dumps({"verified": self.done}, indent=1)
                                     + "\n").encode())


# ---------------------------------------------------------------------------------------
# The checks
# ---------------------------------------------------------------------------------------


def _shard_names(model_dir: Path) -> tuple[list[str], FileReport | None]:
    """The shards the checkpoint consists of, and a report if its index is unusable."""
    from k3engine.safetensors_io import INDEX_NAME, SINGLE_NAME, index_shards

    if (model_dir / INDEX_NAME).exists():
        try:
            return index_shards(model_dir / INDEX_NAME), None
        except CheckpointError as exc:
            return [], FileReport(INDEX_NAME, BAD_INDEX, str(exc))
    if (model_dir / SINGLE_NAME).exists():
        return [SINGLE_NAME], None
    raise Failure(f"{model_dir}: no checkpoint found (expected {INDEX_NAME} with its shards, "
                  f"or {SINGLE_NAME}); point k3chat verify at the downloaded release",
                  EXIT_USAGE)


def _check_header(path: Path, rep: FileReport) -> None:
    """Size against the header's own description, then the full header rules."""
    from k3engine.safetensors_io import header_file_size, read_shard_header

    try:
        want = header_file_size(path)
    except CheckpointError as exc:
        rep.status, rep.detail = BAD_HEADER, str(exc)
        return
    if rep.size != want:
        rep.status = WRONG_SIZE
        rep.detail = (f"{rep.size:,} bytes on disk, its header describes {want:,} "
                      f"({'truncated' if (rep.size or 0) < want else 'bytes appended'})")
        return
    try:
        read_shard_header(path)
    except CheckpointError as exc:
        rep.status, rep.detail = BAD_HEADER, str(exc)


def _check_checkpoint(model_dir: Path) -> FileReport | None:
    """Index against the shard headers and every tensor against config.json (the loader's
    own checks), once every shard is present and sound."""
    from k3engine.catalog import bind
    from k3engine.config import load_config
    from k3engine.safetensors_io import INDEX_NAME, open_checkpoint

    try:
        bind(load_config(model_dir), open_checkpoint(model_dir))
    except CheckpointError as exc:
        return FileReport(INDEX_NAME, BAD_INDEX, str(exc))
    return None


@dataclass(frozen=True)
class _Manifest:
    expected: dict[str, str]  # name -> sha256 to check against
    source: str  # what the hashes come from, for the report
    write_to: Path | None  # record the hashes here instead of checking (first run)
    hf: HFSnapshot | None


def _manifest(model_dir: Path, names: list[str], given: Path | None, write: bool,
              default: Path) -> _Manifest:
    hf = hf_snapshot(model_dir)
    if given is not None:
        if write:
            if given.exists():
                raise Failure(f"--write-manifest: {given} exists already; check against it "
                              f"(drop --write-manifest) or remove it first", EXIT_USAGE)
            return _Manifest({}, f"written to {given}", given, hf)
        if not given.exists():
            raise Failure(f"--manifest {given}: no such file. What to do: give the release's "
                          f"sha256sum file, or add --write-manifest to write one", EXIT_USAGE)
        return _Manifest(read_manifest(given), f"manifest {given}", None, hf)
    if hf is not None and not write:
        expected = {n: sha for n in names if (sha := hf_blob_sha256(model_dir / n))}
        return _Manifest(expected, "Hugging Face cache blob names (LFS SHA-256)", None, hf)
    if default.exists() and not write:
        return _Manifest(read_manifest(default), f"manifest {default} (written by an earlier "
                         f"run)", None, hf)
    return _Manifest({}, f"none yet: hashes recorded in {default}", default, hf)


def _redownload(model_dir: Path, name: str, hf: HFSnapshot | None) -> str:
    if hf is not None and hf.repo:
        # the damaged blob is in the cache already: without --force-download it is kept
        return (f"huggingface-cli download {hf.repo} {name} --revision {hf.revision} "
                f"--cache-dir {shlex.quote(str(hf.cache_dir))} --force-download")
    return f"download {name} again from the release into {model_dir}"


def _precheck(model_dir: Path, name: str, is_shard: bool, man: _Manifest,
              progress: Progress) -> tuple[FileReport, os.stat_result | None]:
    """Presence, size and header, and whether an earlier run verified the file; the stat
    is returned when the file still has to be hashed."""
    path = model_dir / name
    expected = man.expected.get(name)
    rep = FileReport(name, expected_sha256=expected)
    try:
        st = path.stat()
    except FileNotFoundError:
        rep.status = MISSING
        rep.detail = ("not on disk" + (" (its link into the cache's blobs dangles)"
                                       if path.is_symlink() else ""))
        return rep, None
    rep.size = st.st_size
    if is_shard:
        _check_header(path, rep)
        if rep.status != OK:
            return rep, None
    if expected is None and man.write_to is None:
        rep.status = NO_HASH
        rep.detail = f"no SHA-256 for it in the {man.source}"
        return rep, None
    recorded = progress.verified(name, st, expected)
    if recorded is not None:
        rep.sha256, rep.skipped = recorded, True
        return rep, None
    return rep, st


def _hash_and_compare(path: Path, rep: FileReport, st: os.stat_result, progress: Progress,
                      meter: Meter, cancel: threading.Event) -> None:
    if cancel.is_set():  # interrupted while this file waited for a worker
        raise KeyboardInterrupt
    meter.name = rep.name
    try:
        rep.sha256 = hash_file(path, meter.add, cancel=cancel)
    except OSError as exc:
        rep.status, rep.detail = UNREADABLE, f"read failed: {exc.strerror or exc}"
        return
    if rep.expected_sha256 is not None and rep.sha256 != rep.expected_sha256:
        rep.status = WRONG_HASH
        rep.detail = f"SHA-256 {rep.sha256}, expected {rep.expected_sha256}"
        return
    progress.record(rep.name, st, rep.sha256)


def _hash_all(model_dir: Path, work: list[tuple[FileReport, os.stat_result]],
              progress: Progress, meter: Meter, jobs: int) -> None:
    """Hash `jobs` files at a time (one core hashes slower than a fast SSD reads)."""
    cancel = threading.Event()
    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="k3chat-verify")
    try:
        futures = [pool.submit(_hash_and_compare, model_dir / rep.name, rep, st, progress,
                               meter, cancel) for rep, st in work]
        for future in futures:
            future.result()
    except BaseException:
        cancel.set()  # running hashes stop at their next block; queued ones never start
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


@contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    """SIGINT and SIGTERM stop the run with KeyboardInterrupt: progress kept, exit 5. SIGINT
    is set explicitly too: Python keeps an inherited "ignore" (a job started in the
    background by a shell without job control), and then Ctrl-C or kill -INT did nothing."""
    old: dict[int, Any] = {}
    try:
        for sig in (signal.SIGINT, signal.SIGTERM):
            old[sig] = signal.signal(sig, signal.default_int_handler)
    except ValueError:  # not the main thread: leave signals alone
        pass
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def verify(model_dir: Path, manifest: Path | None = None, write_manifest: bool = False,
           stream: Any = None, jobs: int = 1) -> dict[str, Any]:
    """Check MODEL_DIR; the report as data (see main_verify for the exit codes)."""
    if not model_dir.exists():
        raise Failure(f"{model_dir} does not exist: give the directory that holds the shards and "
                      "model.safetensors.index.json", EXIT_USAGE)
    if not model_dir.is_dir():
        raise Failure(f"{model_dir} is a file, not a directory: give the directory that holds it", EXIT_USAGE)
    names, index_problem = _shard_names(model_dir)
    key = _dir_key(model_dir)
    home = state_dir() / "verify"
    man = _manifest(model_dir, names, manifest, write_manifest, home / f"{key}.sha256")
    progress = Progress(home / f"{key}.progress.json")
    extra = sorted(n for n in man.expected if n not in names)  # other files the manifest lists
    todo = [(n, True) for n in names] + [(n, False) for n in extra]
    total = 0
    for n, _ in todo:
        try:
            st = (model_dir / n).stat()
        except OSError:
            continue
        if progress.verified(n, st, man.expected.get(n)) is None:
            total += st.st_size
    meter = Meter(total, stream)
    start = time.monotonic()
    reports: list[FileReport] = []
    work: list[tuple[FileReport, os.stat_result]] = []
    for n, is_shard in todo:
        rep, st = _precheck(model_dir, n, is_shard, man, progress)
        reports.append(rep)
        if st is not None:
            work.append((rep, st))
    try:
        _hash_all(model_dir, work, progress, meter, jobs)
    finally:
        meter.close()
    seconds = time.monotonic() - start
    progress.finish()  # the run completed: the next one checks every shard again
    if index_problem is not None:
        reports.insert(0, index_problem)
    elif all(r.status == OK for r in reports):
        problem = _check_checkpoint(model_dir)
        if problem is not None:
            reports.insert(0, problem)
    bad = [r for r in reports if r.status != OK]
    for r in bad:
        if r.name in names or r.name in man.expected:
            r.redownload = _redownload(model_dir, r.name, man.hf)
    written = None
    if man.write_to is not None and not bad:
        if man.write_to.parent == home:
            ensure_private_dir(home)
        atomic_write(man.write_to, manifest_text({r.name: r.sha256 for r in reports
                                                  if r.sha256}).encode())
        written = str(man.write_to)
    return {"ok": not bad, "model_dir": str(model_dir), "manifest": man.source,
            "manifest_written": written, "hf_repo": man.hf.repo if man.hf else None,
            "hf_revision": man.hf.revision if man.hf else None,
            "bytes_read": meter.done, "seconds": seconds,
            "gb_per_s": meter.done / seconds / 1e9 if seconds > 0 else 0.0,
            "progress_file": str(progress.path),
            "files": [asdict(r) for r in reports]}


def _print_report(rep: dict[str, Any]) -> None:
    files = rep["files"]
    good = [f for f in files if f["status"] == OK]
    skipped = sum(1 for f in good if f["skipped"])
    print(f"model: {rep['model_dir']}")
    print(f"hashes from: {rep['manifest']}")
    print(f"read {rep['bytes_read']:,} B in {rep['seconds']:.1f} s "
          f"({rep['gb_per_s']:.2f} GB/s); {len(good)} of {len(files)} file(s) good"
          + (f", {skipped} verified by an earlier run (same size and mtime)" if skipped else ""))
    for f in files:
        if f["status"] != OK:
            print(f"BAD {f['name']}: {f['status']}: {f['detail']}")
            if f["redownload"]:
                print(f"    what to do: {f['redownload']}")
    if rep["manifest_written"]:
        print(f"manifest written: {rep['manifest_written']} (later runs check against it)")
    print("all well" if rep["ok"] else "verify FAILED: do not use this checkpoint until the "
          "files above are downloaded again")


MAX_DEFAULT_JOBS = 4


def default_jobs() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_DEFAULT_JOBS, cores or 1))


def _jobs_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of files, got {text!r}") from None
    if not 1 <= value <= 64:
        raise argparse.ArgumentTypeError(f"--jobs must be 1..64, got {value}")
    return value


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_dir", metavar="MODEL_DIR", help="the downloaded checkpoint")
    p.add_argument("--manifest", type=Path, default=None, metavar="FILE",
                   help="a sha256sum-format file to check against (names relative to "
                        "MODEL_DIR); default: the Hugging Face cache's blob names, else the "
                        "manifest this command wrote on its first run")
    p.add_argument("--write-manifest", action="store_true",
                   help="record the hashes (in --manifest FILE, which must not exist, or in "
                        "the state directory) instead of checking them")
    p.add_argument("--jobs", type=_jobs_arg, default=default_jobs(), metavar="N",
                   help=f"files hashed at once (default {default_jobs()}: the cores, at most "
                        f"{MAX_DEFAULT_JOBS}; each file's SHA-256 runs on one core)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT",
                   help="also write the report as JSON (0600)")


def main_verify(args: argparse.Namespace) -> int:
    """0 all well; 2 usage, or a shard missing or damaged; 1 a read failed; 5 interrupted."""
    try:
        with _signals_as_interrupt():
            rep = verify(Path(args.model_dir), args.manifest, args.write_manifest,
                         jobs=args.jobs)
    except KeyboardInterrupt:
        print("\nk3chat verify: interrupted; the shards verified so far are recorded: run "
              "the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Failure as exc:
        print(f"k3chat verify: {exc.message}", file=sys.stderr)
        return exc.code
    except OSError as exc:  # the manifest or progress file could not be written
        print(f"k3chat verify: {exc}", file=sys.stderr)
        return EXIT_RUNTIME
    _print_report(rep)
    if args.json_out:
        from k3engine.private_files import write_private
        write_private(args.json_out, json.dumps(rep, indent=2) + "\n")
    if rep["ok"]:
        return EXIT_OK
    bad = {f["status"] for f in rep["files"]} - {OK}
    return EXIT_RUNTIME if bad == {UNREADABLE} else EXIT_USAGE  # damage is the checkpoint's
