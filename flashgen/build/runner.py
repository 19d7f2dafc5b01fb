"""Run a build: pick the jobs, let ninja run nvcc, then write the manifest."""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from flashgen import generator
from flashgen.atomic import atomic_write_text
from flashgen.build import manifest
from flashgen.build.graph import Job, name_units, render_ninja, unit_sources, units
from flashgen.errors import BuildError
from flashgen.spec.core import KernelSpec, normalize_target, target_cc
from flashgen.toolchain import Toolchain

NVCC_JOB_BYTES = 1 << 30  # one nvcc on a backward instance peaks near 0.6 GB; leave headroom
# A unit's cicc holds all its kernels at its peak: 8.6 GB for the 26 sm80_bwd kernels on sm_80.
UNIT_KERNEL_BYTES = 340 << 20
_STATUS = re.compile(r"^\[flashgen (\d+)/(\d+)\] (\S+) (\S+)$")


@dataclass
class BuildResult:
    build_dir: Path
    jobs: List[Job]
    failed: List[Job] = field(default_factory=list)
    compiled: int = 0  # jobs ninja actually ran (0 on a no-op rebuild)
    manifest_path: Optional[Path] = None
    seconds: float = 0.0


def _available_bytes() -> Optional[int]:
    try:
        meminfo = Path("/proc/meminfo").read_text()
        return int(re.search(r"MemAvailable:\s+(\d+)", meminfo).group(1)) * 1024
    except (OSError, AttributeError):
        return None


def default_parallelism() -> int:
    """As many nvcc jobs as there are cores and free gigabytes, whichever is fewer."""
    cores = os.cpu_count() or 1
    available = _available_bytes()
    return max(1, min(cores, cores if available is None else available // NVCC_JOB_BYTES))


def unit_parallelism(jobs: Sequence[Job]) -> Optional[int]:
    """How many units of several kernels may compile at once (None: there are none): as many of the
    largest as free memory holds, at least one.  A small machine then compiles them one at a time
    beside the one-kernel jobs, instead of running out of memory."""
    sizes = [len(members) for members in units(jobs).values() if members[0].grouped]
    if not sizes:
        return None
    available = _available_bytes()
    largest = max(NVCC_JOB_BYTES, sizes[0] * UNIT_KERNEL_BYTES)  # units() puts the largest first
    return len(sizes) if available is None else max(1, min(len(sizes), available // largest))


def check_targets(targets: Sequence[str], tc: Toolchain) -> List[str]:
    """Normalize targets and refuse those this nvcc cannot compile for."""
    supported = {normalize_target(a) for a in tc.nvcc_archs}
    out = []
    for t in targets:
        norm = normalize_target(t)
        if norm.rstrip("a") not in supported:
            raise BuildError(f"nvcc {tc.nvcc_version} ({tc.nvcc}) cannot compile for {t}; it targets "
                             f"{', '.join(sorted(supported, key=target_cc))}")
        out.append(norm)
    return list(dict.fromkeys(out))


def select_jobs(kernels: Sequence[KernelSpec], targets: Sequence[str], instances: Path,
                ptx: bool = False) -> List[Job]:
    """Every (kernel, target) pair whose target lies in the kernel's arch-tag range, plus with
    ``ptx`` a PTX job for the newest target, which newer GPUs can JIT-compile at load time."""
    jobs = [Job(k, t, instances / generator.source_path(k)) for t in targets for k in kernels if k.runs_on(t)]
    if ptx and targets:
        newest = max(targets, key=target_cc)
        jobs += [Job(j.kernel, f"compute{target_cc(newest)}", j.source) for j in jobs if j.target == newest]
    return name_units(jobs)


def check_sources(jobs: Sequence[Job], instances: Path) -> None:
    """Refuse to compile sources that differ from what the spec generates."""
    problems = {rel: s for rel, s in generator.check(instances, [j.kernel for j in jobs]).items() if s != "extra"}
    if problems:
        listing = "\n".join(f"  {status}: {instances / rel}" for rel, status in problems.items())
        raise BuildError(f"instance sources are out of date with the spec:\n{listing}\n"
                         "run `flashgen generate` (and commit the result)")


def check_writable(build_dir: Path) -> None:
    """Create ``build_dir`` and prove a file can be written there, or raise a BuildError naming it.

    Permission bits cannot answer this (root ignores them, and a read-only
    mount, an immutable directory or a full disk do not show in them), so
    this writes, flushes and deletes a small file.  Failing here, before
    the lock file is opened and ninja starts, turns what would be a Python
    traceback into one line that names the directory and the reason.
    """
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".flashgen-probe.", dir=build_dir)
        try:
            os.write(fd, b"flashgen")
            os.fsync(fd)
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as e:
        raise BuildError(f"build directory {build_dir} is not writable: {e.strerror or e}; "
                         "fix that or build somewhere else (--out)") from None


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """Report an OSError (disk full, directory made read-only mid-build) while writing ``path``
    as a BuildError naming it.  The writes are atomic, so the old file stays intact and no
    temporary file is left behind; a rerun once the cause is fixed finishes the job."""
    try:
        yield
    except OSError as e:
        raise BuildError(f"could not write {path}: {e.strerror or e}; fix that and rerun the build") from None


@contextlib.contextmanager
def build_lock(build_dir: Path, console: Console) -> Iterator[None]:
    """One build per directory at a time; a second one waits instead of tearing the manifest."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / ".flashgen.lock", "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            console.print(f"waiting for another flashgen build in {build_dir} ...")
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run_ninja(tc: Toolchain, build_dir: Path, jobs: Sequence[Job], parallelism: int,
               console: Console) -> tuple:
    """Run ninja with a progress bar; returns (jobs that failed, number of edges run)."""
    by_output = units(jobs)
    env = dict(os.environ, NINJA_STATUS="[flashgen %f/%t] ")
    cmd = [str(tc.ninja), "-C", str(build_dir), "-k", "0", "-j", str(parallelism)]
    failed, ran, transcript = set(), 0, []
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=not console.is_terminal) as progress:
        task = progress.add_task("building", total=None)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        for line in proc.stdout:
            transcript.append(line)
            status = _STATUS.match(line.rstrip("\n"))
            if status:
                ran, total = int(status.group(1)), int(status.group(2))
                progress.update(task, completed=ran, total=total,
                                description=f"built {ran - len(failed)}, failed {len(failed)}")
                if not console.is_terminal:
                    console.print(f"[{ran}/{total}] {status.group(3)} ({status.group(4)})", highlight=False)
            elif line.startswith("FAILED: "):
                failed.update(o for o in line[len("FAILED: "):].split() if o in by_output)
                progress.update(task, description=f"built {ran - len(failed)}, failed {len(failed)}")
        returncode = proc.wait()
    if returncode != 0 and not failed:
        raise BuildError("ninja failed before compiling anything:\n" + "".join(transcript[-40:]))
    return [j for o in sorted(failed) for j in by_output[o]], ran


def _write_if_changed(path: Path, text: str) -> None:
    """Write a unit's source only when it changes: ninja would recompile a unit whose source is newer."""
    try:
        if path.read_text() == text:
            return
    except OSError:
        pass
    atomic_write_text(path, text)


def run_build(jobs: List[Job], tc: Toolchain, build_dir: Path, parallelism: Optional[int] = None,
              launcher: Optional[str] = None, console: Optional[Console] = None) -> BuildResult:
    """Compile ``jobs`` into ``build_dir`` and (re)write its manifest.

    Kernels that fail keep their nvcc log and stay out of the manifest; the
    others are built and recorded regardless.  Entries of an earlier manifest
    for other targets survive when their cubins are intact.  A build directory
    that cannot be written, or a failed write of build.ninja or the manifest,
    raises BuildError naming the path.
    """
    console = console or Console(stderr=True)
    build_dir = Path(build_dir).resolve()
    start = time.monotonic()
    result = BuildResult(build_dir=build_dir, jobs=list(jobs))
    check_writable(build_dir)
    with build_lock(build_dir, console):
        for target in {j.target for j in jobs}:
            (build_dir / target).mkdir(exist_ok=True)
        for rel, text in unit_sources(jobs).items():
            with _writing(build_dir / rel):
                _write_if_changed(build_dir / rel, text)
        with _writing(build_dir / "build.ninja"):
            atomic_write_text(build_dir / "build.ninja", render_ninja(jobs, tc, launcher, unit_parallelism(jobs)))
        result.failed, result.compiled = _run_ninja(tc, build_dir, jobs, parallelism or default_parallelism(),
                                                    console)
        toolchain = manifest.toolchain_record(tc.nvcc_version, tc.cutlass_version)
        previous = build_dir / manifest.MANIFEST_NAME
        kernels = {}
        if previous.exists():
            try:
                kernels = manifest.surviving_entries(build_dir, manifest.read(previous), toolchain)
            except manifest.ManifestError as e:
                console.print(f"[yellow]ignoring the old manifest:[/] {e}")
        failed = {j.output for j in result.failed}
        for job in sorted(jobs, key=lambda j: j.is_ptx):  # PTX records borrow their SASS twin's constants
            record = kernels.setdefault(job.kernel.name, manifest.kernel_record(job))
            record["targets"].pop(job.target, None)
            if job.output not in failed:
                record["targets"][job.target] = manifest.describe(build_dir, job, record["targets"])
        kernels = {name: rec for name, rec in kernels.items() if rec["targets"]}
        with _writing(build_dir / manifest.MANIFEST_NAME):
            result.manifest_path = manifest.write(build_dir, manifest.make(toolchain, kernels))
    result.seconds = time.monotonic() - start
    return result
