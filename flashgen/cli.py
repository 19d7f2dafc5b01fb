"""The ``flashgen`` command: doctor, generate, build, list."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import click
from rich.console import Console
from rich.table import Table

from flashgen.errors import FlashgenError
from flashgen.spec import FAMILIES, default_kernels
from flashgen.spec.core import KernelSpec, normalize_target

DEFAULT_BUILD_DIR = Path("build") / "kernels"


def _console() -> Console:
    return Console(stderr=True, soft_wrap=True)  # never break paths or commands across lines


def _fail(message: str) -> None:
    _console().print(f"[red]error:[/] {message}", highlight=False)
    sys.exit(1)


def _split(values) -> List[str]:
    """Accept both `--arch sm80,sm90` and `--arch sm80 --arch sm90`."""
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


@click.group()
@click.version_option(package_name="flashgen")
def main() -> None:
    """Ahead-of-time built fused attention kernels, shipped as cubins."""


@main.command()
def doctor() -> None:
    """Show the compiler, headers and tools flashgen found, and how to get what is missing."""
    from flashgen.toolchain import Found, probe_toolchain

    report = probe_toolchain()
    console = Console(soft_wrap=True)  # whole paths and commands, one per line, easy to copy
    for key, item in report.items.items():
        if isinstance(item, Found):
            version = f" {item.version}" if item.version else ""
            console.print(f"[green]ok[/]       {key:<10} {item.path}{version}  [dim]({item.source})[/]", highlight=False)
        else:
            console.print(f"[red]missing[/]  {key:<10} {item.message}", highlight=False)
    if report.nvcc_archs:
        console.print("nvcc targets: " + " ".join(report.nvcc_archs), highlight=False)
    if not report.ok():
        sys.exit(1)


@main.command()
@click.option("--check", is_flag=True, help="Exit 1 and name the files if instances/ differs from the generator.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Instances directory (default: instances/ of this source checkout).")
def generate(check: bool, out: Optional[Path]) -> None:
    """Render one .cu per kernel instance into instances/<family>/."""
    from flashgen import generator

    out = out or generator.INSTANCES_DIR
    kernels = default_kernels()
    if check:
        problems = generator.check(out, kernels)
        if problems:
            for rel, status in problems.items():
                click.echo(f"{status}: {out / rel}")
            _fail(f"{len(problems)} file(s) in {out} differ from the generator; run `flashgen generate`")
        click.echo(f"{len(kernels)} instance sources in {out} are up to date")
        return
    changes = generator.write(out, kernels)
    for rel, status in changes.items():
        click.echo(f"{'removed' if status == 'extra' else 'wrote'}: {out / rel}")
    click.echo(f"{len(kernels)} instances, {len(changes)} file(s) changed in {out}")


def _select(family: List[str], kernels_glob: Optional[str], dtype: List[str] = (),
            max_k: Optional[int] = None) -> List[KernelSpec]:
    from flashgen.build.runner import matches, parse_globs

    for name in family:
        if name not in FAMILIES:
            _fail(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    globs = parse_globs(kernels_glob)
    return [k for k in default_kernels()
            if (not family or k.FAMILY in family) and matches(k.name, globs)
            and (not dtype or k.dtype in dtype) and (max_k is None or k.max_k == max_k)]


@main.command()
@click.option("--arch", "arch", multiple=True, required=True,
              help="SM targets, comma-separated: sm80,sm86,sm90 (sm75 builds the Turing kernels).")
@click.option("--family", multiple=True, help="Only these families (repeatable).")
@click.option("--kernels", "kernels_glob", default=None,
              help="Only kernels whose name matches one of these comma-separated globs.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None,
              help="Parallel nvcc jobs (default: min(cores, free GB)).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_BUILD_DIR,
              show_default=True, help="Build directory: cubins, logs and manifest.json.")
@click.option("--launcher", default=None, help="Compiler launcher put before nvcc, e.g. sccache.")
@click.option("--instances", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Instance sources (default: instances/ of this source checkout).")
def build(arch, family, kernels_glob, jobs, out, launcher, instances) -> None:
    """Compile the selected kernels for every requested target into cubins with a manifest."""
    from flashgen import generator
    from flashgen.build.runner import check_sources, check_targets, run_build, select_jobs
    from flashgen.toolchain import require_toolchain

    console = _console()
    try:
        tc = require_toolchain()
        targets = check_targets(_split(arch), tc)
        instances = instances or generator.INSTANCES_DIR
        selected = select_jobs(_select(list(family), kernels_glob), targets, instances)
        if not selected:
            _fail(f"no kernel matches --arch {','.join(targets)} "
                  f"{'--family ' + ','.join(family) if family else ''} "
                  f"{'--kernels ' + kernels_glob if kernels_glob else ''}".rstrip())
        check_sources(selected, instances)
        console.print(f"building {len(selected)} cubins for {', '.join(targets)} into {out} "
                      f"(nvcc {tc.nvcc_version}, CUTLASS {tc.cutlass_version})", highlight=False)
        result = run_build(selected, tc, out, parallelism=jobs, launcher=launcher, console=console)
    except FlashgenError as e:
        _fail(str(e))
    built = len(result.jobs) - len(result.failed)
    console.print(f"{built} of {len(result.jobs)} cubins ready ({result.compiled} compiled) in "
                  f"{result.seconds:.1f} s; manifest: {result.manifest_path}", highlight=False)
    if result.failed:
        for job in result.failed:
            console.print(f"[red]FAILED[/] {job.kernel.name} ({job.target}): log {result.build_dir / job.log}",
                          highlight=False)
        _fail(f"{len(result.failed)} kernel(s) failed to build")


@main.command(name="list")
@click.option("--family", multiple=True, help="Only these families.")
@click.option("--arch", "arch", multiple=True, help="Only kernels that run on these targets.")
@click.option("--dtype", multiple=True, type=click.Choice(["f32", "f16", "bf16"]))
@click.option("--max-k", type=int, default=None, help="Only kernels with this kMaxK tier.")
@click.option("--kernels", "kernels_glob", default=None, help="Comma-separated name globs.")
@click.option("--build-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help=f"Show what the manifest there records (default: {DEFAULT_BUILD_DIR} if it exists).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_(family, arch, dtype, max_k, kernels_glob, build_dir, as_json) -> None:
    """List kernels, with per-target resource usage where a build manifest exists."""
    from flashgen.build import manifest

    targets = [normalize_target(t) for t in _split(arch)]
    kernels = [k for k in _select(list(family), kernels_glob, list(dtype), max_k)
               if not targets or any(k.runs_on(t) for t in targets)]
    built = {}
    build_dir = build_dir or (DEFAULT_BUILD_DIR if (DEFAULT_BUILD_DIR / manifest.MANIFEST_NAME).exists() else None)
    if build_dir is not None:
        try:
            built = {e["name"]: e["targets"] for e in manifest.read(build_dir / manifest.MANIFEST_NAME)["kernels"]}
        except FlashgenError as e:
            _fail(str(e))
    rows = []
    for k in kernels:
        records = {t: r for t, r in built.get(k.name, {}).items() if not targets or t in targets}
        rows.append({"name": k.name, "family": k.FAMILY, "params": k.params, "targets": records})
    if as_json:
        click.echo(json.dumps(rows, indent=1))
        return
    table = Table("family", "kernel", "target", "regs", "spills st/ld", "smem", "threads", "cubin")
    for row in rows:
        if not row["targets"]:
            table.add_row(row["family"], row["name"], "-", "", "", "", "", "")
        for target, r in sorted(row["targets"].items()):
            table.add_row(row["family"], row["name"], target, str(r["registers"]),
                          f"{r['spill_stores']}/{r['spill_loads']}", f"{r['shared_memory_dynamic']:,}",
                          str(r["threads_per_block"]), f"{r['size'] / 1024:.0f} KiB")
    console = Console(width=max(Console().width, 160))
    console.print(table)
    for name in FAMILIES:
        of_family = [r for r in rows if r["family"] == name]
        if of_family:
            built_count = sum(1 for r in of_family if r["targets"])
            console.print(f"{name}: {len(of_family)} kernels" + (f", {built_count} built" if built else ""))
