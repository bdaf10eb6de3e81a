"""`k3chat verify` (issue 13 item 4) on copies of the tiny fixture.

Expected hashes are computed here with hashlib over the files as written, never taken from
the code under test; damage is made on purpose (a flipped byte, a truncated or missing
shard, a broken header) and a Hugging Face cache layout is built in tmp.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from k3chat import verify as vf
from k3chat.cli import main as cli_main

SHARD = "model-00003-of-000014.safetensors"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def shards(model: Path) -> list[Path]:
    return sorted(model.glob("model-*.safetensors"))


@pytest.fixture()
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("K3CHAT_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture()
def model(tiny_dir: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_dir, dst)
    return dst


def run(model: Path, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    if out.exists():
        out.unlink()
    code = cli_main(["verify", str(model), "--json", str(out), *extra])
    return code, json.loads(out.read_text()) if out.exists() else {}


def bad(report: dict) -> dict[str, dict]:
    return {f["name"]: f for f in report["files"] if f["status"] != "ok"}


def sha256sum_file(model: Path, path: Path) -> Path:
    path.write_text("".join(f"{sha256(p)}  {p.name}\n" for p in shards(model)))
    return path


def test_first_run_writes_a_private_manifest_and_the_second_checks_it(
        model: Path, tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, rep = run(model, tmp_path)
    assert code == 0 and rep["ok"], capsys.readouterr()
    written = Path(rep["manifest_written"])
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    assert stat.S_IMODE(written.parent.stat().st_mode) == 0o700
    lines = written.read_text().splitlines()
    assert sorted(lines) == sorted(f"{sha256(p)}  {p.name}" for p in shards(model))
    assert rep["bytes_read"] == sum(p.stat().st_size for p in shards(model))
    code, rep = run(model, tmp_path)
    assert code == 0 and rep["ok"] and "written by an earlier run" in rep["manifest"]
    assert rep["bytes_read"] == sum(p.stat().st_size for p in shards(model))  # read again
    assert "all well" in capsys.readouterr().out


def test_flipped_byte_is_a_wrong_hash_naming_the_shard(model: Path, tmp_path: Path,
                                                       home: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    manifest = sha256sum_file(model, tmp_path / "SHA256SUMS")
    path = model / SHARD
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x10  # tensor data, not the header: only the hash can tell
    path.write_bytes(bytes(data))
    for jobs in ("1", "3"):  # files hashed one at a time or three at once: one finding
        code, rep = run(model, tmp_path, "--manifest", str(manifest), "--jobs", jobs)
        assert code == 2 and not rep["ok"]
        assert len(rep["files"]) == 14 and list(bad(rep)) == [SHARD]
    found = bad(rep)
    assert list(found) == [SHARD] and found[SHARD]["status"] == "wrong hash"
    assert found[SHARD]["sha256"] == hashlib.sha256(bytes(data)).hexdigest()
    out = capsys.readouterr().out
    assert f"BAD {SHARD}: wrong hash" in out and f"download {SHARD} again" in out


def test_truncated_missing_and_bad_header_are_each_named(model: Path, tmp_path: Path,
                                                         home: Path) -> None:
    manifest = sha256sum_file(model, tmp_path / "SHA256SUMS")
    files = shards(model)
    truncated, missing, broken = files[1], files[4], files[7]
    size = truncated.stat().st_size
    os.truncate(truncated, size - 100)
    missing.unlink()
    raw = bytearray(broken.read_bytes())
    raw[8] = ord("[")  # the header JSON must be an object
    broken.write_bytes(bytes(raw))
    code, rep = run(model, tmp_path, "--manifest", str(manifest))
    assert code == 2
    found = bad(rep)
    assert set(found) == {truncated.name, missing.name, broken.name}
    assert found[truncated.name]["status"] == "wrong size"
    assert f"{size - 100:,} bytes on disk, its header describes {size:,}" in \
        found[truncated.name]["detail"]
    assert found[missing.name]["status"] == "missing"
    assert found[broken.name]["status"] == "bad header"
    assert all(f["redownload"] for f in found.values())


def test_sha256sum_manifest_missing_a_shard_is_not_all_well(model: Path, tmp_path: Path,
                                                            home: Path) -> None:
    manifest = sha256sum_file(model, tmp_path / "SHA256SUMS")
    lines = manifest.read_text().splitlines()
    manifest.write_text("\n".join(lines[1:]) + "\n")
    code, rep = run(model, tmp_path, "--manifest", str(manifest))
    assert code == 2 and list(bad(rep)) == [shards(model)[0].name]
    assert bad(rep)[shards(model)[0].name]["status"] == "not in the manifest"


def test_bad_manifest_line_and_missing_manifest_are_usage_errors(
        model: Path, tmp_path: Path, home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = tmp_path / "SUMS"
    manifest.write_text("not a hash  file\n")
    assert cli_main(["verify", str(model), "--manifest", str(manifest)]) == 2
    assert "line 1: not a sha256sum line" in capsys.readouterr().err
    assert cli_main(["verify", str(model), "--manifest", str(tmp_path / "none")]) == 2
    assert "--write-manifest" in capsys.readouterr().err


def test_write_manifest_to_a_given_file(model: Path, tmp_path: Path, home: Path) -> None:
    target = tmp_path / "out.sha256"
    code, rep = run(model, tmp_path, "--manifest", str(target), "--write-manifest")
    assert code == 0 and rep["manifest_written"] == str(target)
    assert stat.S_IMODE(target.stat().st_mode) == 0o600
    assert vf.read_manifest(target) == {p.name: sha256(p) for p in shards(model)}
    # it is a sha256sum file: the system tool agrees, when there is one
    if shutil.which("sha256sum"):
        done = subprocess.run(["sha256sum", "-c", str(target)], cwd=model, capture_output=True)
        assert done.returncode == 0, done.stdout
    assert cli_main(["verify", str(model), "--manifest", str(target), "--write-manifest"]) == 2


def hf_cache(src: Path, root: Path, repo: str = "moonshotai/Kimi-K3-tiny",
             rev: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """The Hugging Face hub cache layout: LFS blobs named by SHA-256, git blobs by SHA-1."""
    base = root / ("models--" + repo.replace("/", "--"))
    blobs, snap = base / "blobs", base / "snapshots" / rev
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        lfs = f.suffix == ".safetensors"
        name = sha256(f) if lfs else hashlib.sha1(f.read_bytes()).hexdigest()
        shutil.copyfile(f, blobs / name)
        (snap / f.name).symlink_to(Path("..", "..", "blobs", name))
    return snap


def test_hf_cache_snapshot_is_checked_by_blob_names(tiny_dir: Path, tmp_path: Path,
                                                    home: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    snap = hf_cache(tiny_dir, tmp_path / "hub")
    code, rep = run(snap, tmp_path)
    assert code == 0 and rep["ok"] and "Hugging Face" in rep["manifest"]
    assert rep["hf_repo"] == "moonshotai/Kimi-K3-tiny" and rep["manifest_written"] is None
    assert all(f["expected_sha256"] == sha256(snap / f["name"]) for f in rep["files"])
    blob = (snap / SHARD).resolve()
    data = bytearray(blob.read_bytes())
    data[-1] ^= 1
    blob.write_bytes(bytes(data))
    code, rep = run(snap, tmp_path)
    assert code == 2 and list(bad(rep)) == [SHARD]
    line = (f"huggingface-cli download moonshotai/Kimi-K3-tiny {SHARD} --revision "
            f"0123456789abcdef0123456789abcdef01234567 --cache-dir "
            f"{(tmp_path / 'hub').resolve()} --force-download")
    assert bad(rep)[SHARD]["redownload"] == line and line in capsys.readouterr().out
    blob.unlink()  # a blob never downloaded: the link dangles
    code, rep = run(snap, tmp_path)
    assert code == 2 and bad(rep)[SHARD]["status"] == "missing"


def test_interrupted_run_resumes_without_rereading_verified_shards(
        model: Path, tmp_path: Path, home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    manifest = sha256sum_file(model, tmp_path / "SHA256SUMS")
    reads: list[str] = []
    real = vf.hash_file
    stop_at = [5]

    def counting(path: Path, *a, **k):  # type: ignore[no-untyped-def]
        reads.append(path.name)
        if len(reads) == stop_at[0]:
            stop_at[0] = 0
            raise KeyboardInterrupt  # Ctrl-C while the fifth shard is read
        return real(path, *a, **k)

    monkeypatch.setattr(vf, "hash_file", counting)
    one = ["--jobs", "1"]  # reads in shard order
    assert cli_main(["verify", str(model), "--manifest", str(manifest), *one]) == 5
    names = [p.name for p in shards(model)]
    assert reads[:5] == names[:5] and len(reads) <= 6  # a 6th may start, then stops
    reads.clear()
    code, rep = run(model, tmp_path, "--manifest", str(manifest), *one)
    assert code == 0 and rep["ok"]
    assert reads == names[4:]  # the four verified shards were not read again
    assert [f["name"] for f in rep["files"] if f["skipped"]] == names[:4]
    assert rep["bytes_read"] == sum((model / n).stat().st_size for n in names[4:])
    assert not Path(rep["progress_file"]).exists()  # a completed run leaves no record


@pytest.mark.parametrize("inherited", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "ignored"])
def test_ctrl_c_exits_5_and_keeps_the_progress(model: Path, tmp_path: Path, home: Path,
                                               inherited: signal.Handlers) -> None:
    """Beside the shards the manifest lists a 64 GiB sparse file, hashed last and for long
    (SHA-256 is CPU-bound): SIGINT while it is hashed exits 5 with the shards recorded. Also
    when verify starts with SIGINT ignored, as a job a shell starts in the background does
    (Python keeps an inherited "ignore"; a CI run that started so timed out here)."""
    manifest = sha256sum_file(model, tmp_path / "SHA256SUMS")
    big = model / "zz-large.bin"
    with open(big, "wb") as fh:
        fh.truncate(64 << 30)
    with open(manifest, "a") as fh:
        fh.write(f"{'0' * 64}  {big.name}\n")
    env = {**os.environ, "K3CHAT_HOME": str(home)}
    proc = subprocess.Popen([sys.executable, "-m", "k3chat.cli", "verify", str(model),
                             "--manifest", str(manifest), "--jobs", "1"],
                            stderr=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=tmp_path, preexec_fn=lambda: signal.signal(signal.SIGINT, inherited))
    progress: Path | None = None
    deadline = time.monotonic() + 120
    verify_dir = home / "state" / "verify"
    try:
        while time.monotonic() < deadline:  # wait until the 14 shards are recorded
            files = list(verify_dir.glob("*.progress.json")) if verify_dir.exists() else []
            if files and len(json.loads(files[0].read_text()).get("verified", {})) == 14:
                progress = files[0]
                break
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        assert progress is not None, "verify never reached the large file"
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 5, (out, err)
    assert "interrupted" in err and "run the same command again to resume" in err
    assert "Traceback" not in err
    kept = json.loads(progress.read_text())["verified"]
    assert sorted(kept) == [p.name for p in shards(model)]
    assert stat.S_IMODE(progress.stat().st_mode) == 0o600


def test_hash_file_matches_hashlib_across_block_edges(tmp_path: Path) -> None:
    path = tmp_path / "blob"
    data = os.urandom(3 * 4096 + 17)
    path.write_bytes(data)
    seen: list[int] = []
    assert vf.hash_file(path, seen.append, block=4096) == hashlib.sha256(data).hexdigest()
    assert seen == [4096, 4096, 4096, 17]


def test_a_missing_or_file_model_dir_is_named_with_what_to_give(tmp_path: Path) -> None:
    from k3chat.runtime import Failure
    from k3chat.verify import verify

    with pytest.raises(Failure, match="does not exist: give the directory") as missing:
        verify(tmp_path / "nope")
    shard = tmp_path / "model-00001.safetensors"
    shard.write_bytes(b"x")
    with pytest.raises(Failure, match="is a file, not a directory") as a_file:
        verify(shard)
    assert missing.value.code == a_file.value.code == 2
