"""`k3chat doctor`: report fields, the read probe (direct and buffered), temp-file cleanup."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from k3engine import doctor as dr

PROBE = ["--size-mb", "40", "--seconds", "0.1"]  # 40 MiB holds two 17.5 MB expert reads


def run(tmp_path: Path, probe_dir: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / "report.json"
    code = dr.main_doctor(["--dir", str(probe_dir), "--json", str(out), *PROBE, *extra])
    return code, json.loads(out.read_text())


def test_doctor_without_a_model(tmp_path: Path, capsys) -> None:
    probe_dir = tmp_path / "disk"
    probe_dir.mkdir()
    code, rep = run(tmp_path, probe_dir)
    assert code == 0
    cpu, mem, disk, probe = rep["cpu"], rep["memory"], rep["disk"], rep["probe"]
    assert cpu["logical_cores"] > 0 and cpu["usable_cores"] > 0 and cpu["model"]
    assert {type(cpu[k]) for k in ("avx2", "fma", "avx512f", "neon")} == {bool}
    assert rep["engine"]["simd"] in ("avx2", "neon", "none")
    assert rep["engine"]["direct_io"] in ("O_DIRECT", "F_NOCACHE", "none")
    assert mem["total_bytes"] > 0 and mem["available_bytes"] > 0 and mem["usable_bytes"] > 0
    assert "cgroup_limit_bytes" in mem
    assert disk["free_bytes"] > 0 and disk["total_bytes"] >= disk["free_bytes"]
    assert probe["read_bytes"] == 17_547_264 and probe["read_bytes"] % 4096 == 0
    assert probe["file_bytes"] == 40 * 2**20
    assert probe["mode"] in ("O_DIRECT", "buffered + posix_fadvise(DONTNEED)")
    assert probe["direct_io"] == (probe["mode"] == "O_DIRECT")
    assert [p["queue_depth"] for p in probe["phases"]] == [1, 4, 8, 16]
    for p in probe["phases"]:
        assert p["reads"] >= dr.MIN_READS and p["bytes"] == p["reads"] * 17_547_264
        assert p["gb_per_s"] > 0
    assert probe["qd1_gb_per_s"] > 0 and probe["qd8_gb_per_s"] > 0
    assert probe["best_gb_per_s"] == max(p["gb_per_s"] for p in probe["phases"])
    assert probe[f"qd{probe['best_queue_depth']}_gb_per_s"] == probe["best_gb_per_s"]
    assert rep["recommended_budget_bytes"] > 0 and rep["model"] is None
    assert list(probe_dir.iterdir()) == []  # the probe file is gone
    text = capsys.readouterr().out
    assert "queue depth 1:" in text and "queue depth 16:" in text and "--memory auto" in text
    assert f"best: queue depth {probe['best_queue_depth']}," in text


def test_buffered_fallback_when_o_direct_is_refused(tmp_path: Path, monkeypatch) -> None:
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    result = dr.probe_disk(tmp_path, 40 * 2**20, seconds=0.05)
    assert not result.direct_io and result.mode.startswith("buffered")
    assert "refused at open" in result.note
    assert all(p.gb_per_s > 0 for p in result.phases)
    assert list(tmp_path.iterdir()) == []


def test_probe_file_removed_on_ctrl_c(tmp_path: Path, monkeypatch) -> None:
    seen: list[str] = []

    def interrupted(*args, **kwargs):
        assert Path(seen[0]).exists()  # the file existed while the probe ran
        raise KeyboardInterrupt

    monkeypatch.setattr(dr, "_phase", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dr.probe_disk(tmp_path, 40 * 2**20, seconds=0.05, on_path=seen.append)
    assert seen and not Path(seen[0]).exists()
    assert list(tmp_path.iterdir()) == []


def test_doctor_with_a_model_reports_the_plan(tmp_path: Path) -> None:
    from k3engine.fixture import write_fixture

    model = write_fixture("tiny", tmp_path / "tiny", with_oracle=False)
    before = sorted(p.name for p in model.iterdir())
    code, rep = run(tmp_path, model)
    assert code == 0
    plan = rep["model"]["plan"]
    assert plan["budget"] == rep["recommended_budget_bytes"]
    assert plan["total"] <= plan["budget"]
    assert sorted(p.name for p in model.iterdir()) == before


def test_doctor_json_is_written_0600_like_run_json(tmp_path: Path) -> None:
    import stat
    probe_dir = tmp_path / "disk"
    probe_dir.mkdir()
    out = tmp_path / "report.json"
    out.write_text("an older, looser report")
    os.chmod(out, 0o644)
    old = os.umask(0o022)
    try:
        code, rep = run(tmp_path, probe_dir)
    finally:
        os.umask(old)
    assert code == 0 and rep["probe"]["read_bytes"] == 17_547_264
    assert stat.S_IMODE(out.stat().st_mode) == 0o600


def test_doctor_usage_errors(tmp_path: Path, capsys) -> None:
    assert dr.main_doctor(["--dir", str(tmp_path / "missing")]) == 2
    assert dr.main_doctor(["--dir", str(tmp_path), "--size-mb", "10"]) == 2
    assert "too small" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_cpu_flags_parsed(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    block = ("processor\t: {n}\nmodel name\t: Test CPU 9000\nphysical id\t: 0\n"
             "core id\t\t: {c}\nflags\t\t: fpu sse2 avx avx2 fma bmi2\n\n")
    info.write_text("".join(block.format(n=n, c=n // 2) for n in range(4)))
    cpu = dr.cpu_info(info)
    assert cpu.model == "Test CPU 9000" and cpu.physical_cores == 2
    assert cpu.avx2 and cpu.fma and not cpu.avx512f


def test_arm64_cpuinfo_reports_neon(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("".join(f"processor\t: {n}\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd evtstrm aes crc32\n"
                            f"CPU part\t: 0xd0c\n\n" for n in range(2)))
    cpu = dr.cpu_info(info, system="linux")
    assert cpu.neon and not (cpu.avx2 or cpu.fma or cpu.avx512f)
    assert cpu.model == "0xd0c"


def _fake_sysctl(values: dict[str, int | str]):
    def read(name: str) -> bytes | None:
        v = values.get(name)
        if v is None:
            return None
        if isinstance(v, str):
            return v.encode() + b"\0"
        return v.to_bytes(8 if v >= 2**31 or name == "hw.memsize" else 4, "little")
    return read


MAC = {"hw.memsize": 64 * 2**30, "hw.ncpu": 12, "hw.logicalcpu": 12, "hw.physicalcpu": 12,
       "machdep.cpu.brand_string": "Apple M2 Max", "hw.optional.neon": 1, "hw.pagesize": 16384,
       "vm.page_free_count": 1000}
VM_STAT = """Mach Virtual Memory Statistics: (page size of 16384 bytes)
Pages free:                               20000.
Pages active:                            900000.
Pages inactive:                          800000.
Pages speculative:                         5000.
Pages throttled:                              0.
Pages wired down:                        300000.
Pages purgeable:                          12000.
"Translation faults":                 123456789.
Pages stored in compressor:              100000.
"""


def test_macos_cpu_from_sysctl() -> None:
    cpu = dr.cpu_info(system="darwin", sysctl=_fake_sysctl(MAC))
    assert (cpu.model, cpu.logical_cores, cpu.physical_cores) == ("Apple M2 Max", 12, 12)
    assert cpu.neon and not (cpu.avx2 or cpu.fma or cpu.avx512f) and cpu.cpu_quota is None


def test_macos_memory_from_sysctl_and_vm_stat() -> None:
    from k3engine import sizes as sz

    swap = (2 * 2**30).to_bytes(8, "little") + (2**30).to_bytes(8, "little") + bytes(16)
    values = _fake_sysctl(MAC)
    read = lambda name: swap if name == "vm.swapusage" else values(name)  # noqa: E731
    mem = sz.read_machine_memory(system="darwin", sysctl=read, vm_stat=lambda: VM_STAT)
    assert mem.total == 64 * 2**30 and mem.cgroup is None
    assert mem.available == 16384 * (20000 + 5000 + 800000)  # free + speculative + inactive
    assert mem.swap_total == 2 * 2**30 and mem.limit == mem.available
    # no vm_stat: the free pages only, never more than the machine can give
    mem = sz.read_machine_memory(system="darwin", sysctl=read, vm_stat=lambda: None)
    assert mem.available == 1000 * 16384


def test_probe_uses_f_nocache_where_there_is_no_o_direct(tmp_path: Path, monkeypatch) -> None:
    import fcntl

    calls: list[tuple[int, int]] = []
    monkeypatch.delattr(os, "O_DIRECT", raising=False)
    monkeypatch.setattr(fcntl, "F_NOCACHE", 48, raising=False)
    real = fcntl.fcntl

    def fake_fcntl(fd: int, cmd: int, arg: int = 0):
        if cmd == 48:
            calls.append((fd, arg))
            return 0
        return real(fd, cmd, arg)

    monkeypatch.setattr(fcntl, "fcntl", fake_fcntl)
    result = dr.probe_disk(tmp_path, 40 * 2**20, seconds=0.05)
    assert result.direct_io and result.mode == "F_NOCACHE" and result.note == ""
    assert len(calls) == 2 and all(arg == 1 for _, arg in calls)  # the writer and the reader
    assert list(tmp_path.iterdir()) == []


def test_peak_rss_unit_per_os() -> None:
    from k3engine import sizes as sz

    # macOS reports ru_maxrss in bytes, Linux in KiB: a KiB reading taken as bytes on a Mac
    # would make the process reserve 1024 times too big and refuse every plan
    linux, darwin = sz._maxrss_bytes("linux"), sz._maxrss_bytes("darwin")
    assert 0 < linux <= 1024 * darwin <= linux + 64 * 2**20  # read second: may have grown
