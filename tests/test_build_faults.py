"""Builds that survive faults: a SIGKILL mid-build, two builds into one directory,
damaged files refused at load, an output directory that cannot be written.

The nvcc tests compile two small forward instances (about 4 s each on 2 cores);
the file takes about 20 s.  The load-time tests need neither nvcc nor a GPU.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from flashgen.build import manifest
from flashgen.build.cubin import parse_resource_usage, read_int64_array, sha256_file
from flashgen.build.graph import Job
from flashgen.cli import main
from flashgen.errors import UnsupportedError
from flashgen.runtime.registry import Registry
from flashgen.spec import default_kernels

REPO = Path(__file__).resolve().parents[1]
FWD = "mem_eff_fwd_f32_aligned_q64x64_k64_bias_sm80"  # (f16/bf16 below kMaxK 65536: not built for sm80)
FWD_K128 = "mem_eff_fwd_f32_aligned_q32x128_k128_bias_sm80"
WAITING = "waiting for another flashgen build"


def _kernel(name):
    return next(k for k in default_kernels() if k.name == name)


def _build(*args):
    """`flashgen build` in-process; an exception escaping the command fails the test."""
    return CliRunner().invoke(main, ["build", "--arch", "sm80", *args], catch_exceptions=False)


@pytest.fixture(scope="module")
def base(toolchain, tmp_path_factory):
    """FWD built for sm80; tests work on copies of it."""
    out = tmp_path_factory.mktemp("base") / "out"
    result = _build("--kernels", FWD, "--out", str(out))
    assert result.exit_code == 0, result.output
    return out


@pytest.fixture
def built(base, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(base, out)  # keeps mtimes: ninja sees FWD up to date
    return out


def _trusted(out):
    """Check what a later run trusts: the manifest parses, and every binary it lists is
    intact and accepted by the runtime's registry.  Returns the kernel names listed."""
    data = manifest.read(out / manifest.MANIFEST_NAME)
    for entry in data["kernels"]:
        for rec in entry["targets"].values():
            assert sha256_file(out / manifest.binary_path(rec)) == rec["sha256"], entry["name"]
    registry = Registry([out])
    for binary in registry.binaries.values():
        registry.verify(binary)
    return {e["name"] for e in data["kernels"]}


def _assert_complete(cubin):
    """A cubin that a finished nvcc run produced: ptxas reported on it and its constants read back."""
    kernel = _kernel(cubin.stem)
    assert kernel.name in parse_resource_usage(cubin.with_suffix(".log").read_text(errors="replace"))
    assert len(read_int64_array(cubin, kernel.meta_symbol)) == len(kernel.CONSTANTS)


def _no_temporaries(out):
    leftovers = [p.name for p in out.rglob(".*") if p.name.startswith((".manifest.json.", ".flashgen-probe."))]
    assert not leftovers


def _spawn(out, kernels):
    """`flashgen build` as a separate process, in a session of its own (so it can be killed whole)."""
    cmd = [sys.executable, "-m", "flashgen", "build", "--arch", "sm80", "--kernels", kernels,
           "--out", str(out), "-j", "2"]
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _session(sid):
    """(pid, process group, command name) of the live processes in session ``sid`` (Linux /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        comm, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            found.append((int(pid), int(fields[2]), comm))
    return found


def _kill_build(proc):
    """SIGKILL every process of the build: flashgen and ninja (the build's process group), and
    the nvcc pipelines, which ninja starts in process groups of their own."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # already killed: only its compilers may be left
        pass
    proc.wait()
    deadline = time.monotonic() + 30
    while (left := _session(proc.pid)) and time.monotonic() < deadline:
        for pgid in {pgid for _, pgid, _ in left}:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.01)
    assert not _session(proc.pid), "processes of the killed build survived"


# -- 1. SIGKILL mid-build, then rerun ----------------------------------------------------------


@pytest.mark.nvcc
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the build's compilers through /proc")
def test_sigkill_mid_build_leaves_nothing_torn_and_a_rerun_finishes(built):
    proc = _spawn(built, f"{FWD},{FWD_K128}")  # FWD is up to date: FWD_K128 gets compiled
    try:
        deadline = time.monotonic() + 120
        while not any(comm in ("cicc", "ptxas") for _, _, comm in _session(proc.pid)):
            assert proc.poll() is None, "the build ended before nvcc ran:\n" + proc.communicate()[0]
            assert time.monotonic() < deadline, "nvcc never started"
            time.sleep(0.01)
    finally:
        _kill_build(proc)
    assert proc.returncode == -signal.SIGKILL

    # Nothing a later run trusts is torn: the old manifest parses and its cubins are intact;
    # the killed kernel has no cubin (cubins appear only by renaming a finished nvcc output).
    assert _trusted(built) == {FWD}
    assert not (built / "sm80" / f"{FWD_K128}.cubin").exists()
    for cubin in built.rglob("*.cubin"):
        _assert_complete(cubin)

    rerun = subprocess.run(proc.args, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "2 of 2 binaries ready (1 compiled)" in rerun.stderr  # only the killed kernel again
    assert _trusted(built) == {FWD, FWD_K128}
    for cubin in built.rglob("*.cubin"):
        _assert_complete(cubin)
    listed = CliRunner().invoke(main, ["list", "--build-dir", str(built), "--json"])
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.stdout)
    assert {r["name"] for r in rows} == {FWD, FWD_K128}
    assert [t["verified"] for r in rows for t in r["targets"].values()] == ["ok", "ok"]


@pytest.mark.nvcc
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds the build's compilers through /proc")
def test_rerun_while_a_killed_builds_nvcc_still_runs(built):
    """Killing only flashgen and ninja (their process group) leaves nvcc running: ninja starts
    each compile in a group of its own.  A rerun started at once must not be disturbed by it."""
    proc = _spawn(built, f"{FWD},{FWD_K128}")
    deadline = time.monotonic() + 120
    while not any(comm in ("cicc", "ptxas") for _, _, comm in _session(proc.pid)):
        assert proc.poll() is None and time.monotonic() < deadline, "nvcc never started"
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the build's own group only
    proc.wait()
    try:
        assert _session(proc.pid), "expected the compiler to outlive the killed build"
        rerun = subprocess.run(proc.args, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    finally:
        _kill_build(proc)  # reaps whatever of the old build is left
    # the leftover compiler may have renamed its (identical) cubin over the rerun's: still whole
    assert _trusted(built) == {FWD, FWD_K128}
    for cubin in built.rglob("*.cubin"):
        _assert_complete(cubin)
    assert not list(built.rglob("*.tmp*"))


# -- 2. Two builds into one directory --------------------------------------------------------


@pytest.mark.nvcc
def test_concurrent_builds_into_one_directory_take_turns(toolchain, tmp_path):
    out = tmp_path / "out"
    procs = [_spawn(out, FWD), _spawn(out, FWD_K128)]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("1 of 1 binaries ready (1 compiled)" in o for o in outputs), outputs
    # both compile for seconds after reaching the lock, so exactly one found it taken
    assert sum(WAITING in o for o in outputs) == 1, outputs
    assert _trusted(out) == {FWD, FWD_K128}  # the second build kept the first one's entry
    _no_temporaries(out)


# -- 3. Damaged files are refused at load, naming the file -----------------------------------


@pytest.fixture
def fake_build(tmp_path):
    """A build directory written by hand with the manifest helpers: one kernel, a stand-in cubin."""
    kernel = _kernel(FWD)
    job = Job(kernel, "sm80", Path("unused.cu"))
    out = tmp_path / "kernels"
    cubin = out / job.output
    cubin.parent.mkdir(parents=True)
    cubin.write_bytes(os.urandom(4096))
    constants = {c.name: 1 for c in kernel.CONSTANTS}
    record = manifest.kernel_record(job)
    record["targets"]["sm80"] = {"cubin": job.output, "sha256": sha256_file(cubin), "size": 4096,
                                 "shared_memory_dynamic": 1, "threads_per_block": 1, "min_blocks_per_sm": 1,
                                 "constants": constants}
    manifest.write(out, manifest.make(manifest.toolchain_record("13.0", "4.2.0.0"), {kernel.name: record}))
    return out


def test_intact_build_loads_and_verifies(fake_build):
    registry = Registry([fake_build])
    assert list(registry.binaries) == [(FWD, "sm80")]
    registry.verify(registry.binaries[(FWD, "sm80")])


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_bytes(p.read_bytes()[:-1] + bytes([p.read_bytes()[-1] ^ 1])), "does not match"),
    (lambda p: p.write_bytes(p.read_bytes()[:1000]), "does not match"),  # a write cut short
    (lambda p: p.unlink(), "missing"),
], ids=["flipped-bit", "truncated", "missing"])
def test_damaged_cubin_is_refused_naming_it(fake_build, damage, message):
    registry = Registry([fake_build])
    binary = registry.binaries[(FWD, "sm80")]
    damage(binary.path)
    with pytest.raises(UnsupportedError) as e:
        registry.verify(binary)
    assert str(binary.path) in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("damage, message", [
    (lambda text: text[:len(text) // 2], "not valid JSON"),
    (lambda text: "", "not valid JSON"),
    (lambda text: json.dumps(dict(json.loads(text), schema_version=manifest.SCHEMA_VERSION + 1)), "newer"),
], ids=["truncated", "empty", "newer-schema"])
def test_damaged_manifest_is_refused_naming_it(fake_build, damage, message):
    path = fake_build / manifest.MANIFEST_NAME
    path.write_text(damage(path.read_text()))
    with pytest.raises(manifest.ManifestError) as e:
        Registry([fake_build])
    assert str(path) in str(e.value) and message in str(e.value)


# -- 4. An output directory that cannot be written -------------------------------------------


def _assert_one_error_line(result, path, reason):
    """Exit 1 with a single `error:` line naming ``path`` and the reason, no traceback."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    assert len(errors) == 1, result.output
    assert str(path) in errors[0] and reason in errors[0], errors[0]


@pytest.mark.nvcc
def test_out_below_a_regular_file_is_a_clear_error(toolchain, tmp_path):
    (tmp_path / "file").write_text("not a directory\n")
    out = tmp_path / "file" / "out"  # unwritable even for root
    result = _build("--kernels", FWD, "--out", str(out))
    _assert_one_error_line(result, out, "is not writable: Not a directory")


@pytest.fixture
def read_only_dir(tmp_path):
    """A directory nobody, root included, can write: mode 0555, and `chattr +i` when running as root."""
    path = tmp_path / "ro"
    path.mkdir()
    path.chmod(0o555)
    immutable = False
    try:
        if os.geteuid() == 0 and shutil.which("chattr"):  # root ignores the mode; not an immutable directory
            immutable = subprocess.run(["chattr", "+i", str(path)], capture_output=True).returncode == 0
        try:
            (path / "probe").write_text("")
        except OSError:
            yield path
        else:
            pytest.skip("cannot make a directory unwritable here (root without chattr +i)")
    finally:
        if immutable:
            subprocess.run(["chattr", "-i", str(path)], check=True)
        path.chmod(0o755)


@pytest.mark.nvcc
def test_read_only_out_is_a_clear_error(toolchain, read_only_dir):
    result = _build("--kernels", FWD, "--out", str(read_only_dir))
    _assert_one_error_line(result, read_only_dir, "is not writable")
    assert list(read_only_dir.iterdir()) == []


def _fail_fsync(fd):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.nvcc
@pytest.mark.parametrize("case", ["disk-full", "permission-denied"])
def test_unwritable_out_is_reported_before_building(toolchain, tmp_path, monkeypatch, case):
    out = (tmp_path / "out").resolve()
    if case == "disk-full":  # what a full disk does: the file is created, its data cannot be stored
        monkeypatch.setattr(os, "fsync", _fail_fsync)
        reason = os.strerror(errno.ENOSPC)
    else:  # what mode 0555 does to a user other than root
        mkstemp = tempfile.mkstemp

        def refuse(*args, dir=None, **kwargs):
            if dir is not None and Path(dir) == out:
                raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(dir))
            return mkstemp(*args, dir=dir, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", refuse)
        reason = os.strerror(errno.EACCES)
    result = _build("--kernels", FWD, "--out", str(out))
    _assert_one_error_line(result, out, f"is not writable: {reason}")
    assert list(out.iterdir()) == []  # no probe file, no lock, nothing compiled


@pytest.mark.nvcc
def test_failed_manifest_write_keeps_the_old_one(built, monkeypatch):
    path = built.resolve() / manifest.MANIFEST_NAME
    before = path.read_bytes()
    replace = os.replace

    def disk_full_for_the_manifest(src, dst, **kwargs):
        if Path(dst).name == manifest.MANIFEST_NAME:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return replace(src, dst, **kwargs)

    monkeypatch.setattr(os, "replace", disk_full_for_the_manifest)
    result = _build("--kernels", FWD, "--out", str(built))
    _assert_one_error_line(result, path, os.strerror(errno.ENOSPC))
    assert path.read_bytes() == before
    _no_temporaries(built)
    monkeypatch.undo()
    assert _trusted(built) == {FWD}
