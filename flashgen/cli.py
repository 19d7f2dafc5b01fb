"""The ``flashgen`` command: doctor, generate, build, list, mods, tune, bench."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import List, Optional

import click

from flashgen.bench import HEAD_DIMS as GRID_HEAD_DIMS
from flashgen.errors import FlashgenError
from flashgen.spec import FAMILIES, default_kernels
from flashgen.spec.core import KernelSpec, normalize_target, target_cc

DEFAULT_BUILD_DIR = Path("build") / "kernels"


def _fail(message: str) -> None:
    click.echo(click.style("error: ", fg="red") + message, err=True)
    sys.exit(1)


def _table(header: List[str], rows: List[List[str]]) -> str:
    """Plain aligned columns: readable on a terminal, greppable in CI logs, no extra dependency."""
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip()  # noqa: E731
    return "\n".join([fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows])


def _split(values) -> List[str]:
    """Accept both `--arch sm80,sm90` and `--arch sm80 --arch sm90`."""
    return [v.strip() for value in values for v in value.split(",") if v.strip()]


@click.group()
@click.version_option(package_name="flashgen")
def main() -> None:
    """Ahead-of-time built fused attention kernels, shipped as cubins."""


@main.command()
def doctor() -> None:
    """Show the GPUs and which packaged kernels run on them, and the build toolchain
    (compiler, headers, tools) with how to get what is missing."""
    from flashgen.toolchain import Found, probe_toolchain

    _doctor_gpus()
    click.echo("build toolchain (needed only to compile kernels):")
    report = probe_toolchain()
    for key, item in report.items.items():
        if isinstance(item, Found):
            version = f" {item.version}" if item.version else ""
            click.echo(f"{click.style('ok', fg='green')}       {key:<10} {item.path}{version}  ({item.source})")
        else:
            click.echo(f"{click.style('missing', fg='red')}  {key:<10} {item.message}")
    if report.nvcc_archs:
        click.echo("nvcc targets: " + " ".join(report.nvcc_archs))
    if not report.ok():
        sys.exit(1)


def _doctor_gpus() -> None:
    from flashgen.errors import UnsupportedError
    from flashgen.runtime.registry import default_registry

    try:
        import cupy
    except ImportError:
        click.echo("GPUs: CuPy is not installed, so flashgen cannot run kernels: "
                   "pip install 'flashgen[cu13]' (CUDA 13 driver) or 'flashgen[cu12]'")
        return
    try:
        count = cupy.cuda.runtime.getDeviceCount()
        driver = cupy.cuda.runtime.driverGetVersion()
    except Exception as e:  # no driver, no device
        click.echo(f"GPUs: none usable ({e})")
        return
    from flashgen.runtime import tuning
    from flashgen.runtime.device import device_info

    registry = default_registry()
    click.echo(f"GPUs: {count}, driver supports CUDA {driver // 1000}.{driver % 1000 // 10}; "
               f"kernels found for: {', '.join(registry.targets()) or 'none'} "
               f"(in {', '.join(str(p) for p in registry.paths)})")
    for index in range(count):
        info = device_info(index)
        runnable = []
        for family in FAMILIES:
            try:
                runnable.append(f"{family} {len(registry.for_device(family, info))}")
            except UnsupportedError:
                runnable.append(f"{family} 0")
        click.echo(f"  GPU {index}: {info.name}, sm_{info.cc}, {info.multiprocessors} SMs, "
                   f"{info.shared_memory_optin // 1024} KB shared memory per block; runnable: {', '.join(runnable)}")
        for line in tuning.report(info, registry):
            click.echo(f"    {line}")


_MODS_OPTION = click.option(
    "--mods", "mods_file", type=click.Path(dir_okay=False, exists=True, path_type=Path), default=None,
    help="A mods file (flashgen mods FILE checks it): also the sm90 instances of the score mods it declares, "
         "named ..._mod_<name>_... (see the README's 'Declared mods').")


def _declared_mod_kernels(mods_file: Optional[Path]) -> List[KernelSpec]:
    """The score-mod instances of a mods file (declared for this command), or none without one."""
    from flashgen.mods import ModError
    from flashgen.spec import mod_kernels, score_mods

    if mods_file is None:
        return []
    try:
        return mod_kernels(score_mods.declare_file(mods_file))
    except ModError as e:
        _fail(str(e))


@main.command()
@click.option("--check", is_flag=True, help="Exit 1 and name the files if instances/ differs from the generator.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Instances directory (default: instances/ of this source checkout).")
@_MODS_OPTION
def generate(check: bool, out: Optional[Path], mods_file: Optional[Path]) -> None:
    """Render one .cu per kernel instance, and each family's ABI header, into instances/<family>/."""
    from flashgen import generator

    out = out or generator.INSTANCES_DIR
    kernels = default_kernels() + _declared_mod_kernels(mods_file)
    if check:
        problems = generator.check(out, kernels)
        if problems:
            for rel, status in problems.items():
                click.echo(f"{status}: {out / rel}")
            _fail(f"{len(problems)} file(s) in {out} differ from the generator; run `flashgen generate`")
        families = len({k.FAMILY for k in kernels})
        click.echo(f"{len(kernels)} instance sources and {families} ABI headers in {out} are up to date")
        return
    changes = generator.write(out, kernels)
    for rel, status in changes.items():
        click.echo(f"{'removed' if status == 'extra' else 'wrote'}: {out / rel}")
    click.echo(f"{len(kernels)} instances, {len(changes)} file(s) changed in {out}")


@main.command()
@click.argument("mods_file", required=False, type=click.Path(dir_okay=False, exists=True, path_type=Path))
def mods(mods_file: Optional[Path]) -> None:
    """Check a mods file (ScoreMod / MaskMod declarations) and show each mod's C++ and digest; without
    a file, the built-ins.  A malformed expression is reported with its line and column."""
    from flashgen import mods as declared

    try:
        found = declared.BUILTIN_MODS if mods_file is None else declared.load_mods(mods_file)
        rows = [[name, mod.KIND, ", ".join(f"{t} {s}" for t, s in mod.specs(name).items()) or "-",
                 mod.digest(name)[:12], mod.cpp(name)] for name, mod in found.items()]
    except declared.ModError as e:
        _fail(str(e))
    click.echo(_table(["mod", "kind", "tensors", "digest", "C++"], rows))


def _select(family: List[str], kernels_glob: Optional[str], dtype: List[str] = (),
            max_k: Optional[int] = None, extra: List[KernelSpec] = ()) -> List[KernelSpec]:
    """The default set's kernels (and ``extra``: a mods file's) that the filters select."""
    from flashgen.spec import matches, parse_globs

    for name in family:
        if name not in FAMILIES:
            _fail(f"unknown family {name!r}; known: {', '.join(FAMILIES)}")
    globs = parse_globs(kernels_glob)
    return [k for k in default_kernels() + list(extra)
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
@click.option("--ptx", is_flag=True, help="Also emit PTX for the newest target, which newer GPUs JIT-compile.")
@_MODS_OPTION
def build(arch, family, kernels_glob, jobs, out, launcher, instances, ptx, mods_file) -> None:
    """Compile the selected kernels for every requested target into cubins with a manifest.  With --mods, a
    mods file's score-mod instances are generated into <out>/mod_instances and built beside the others."""
    from rich.console import Console

    from flashgen import generator
    from flashgen.build.graph import units
    from flashgen.build.runner import check_sources, check_targets, run_build, select_jobs
    from flashgen.toolchain import require_toolchain

    console = Console(stderr=True, soft_wrap=True)  # never break paths or commands across lines
    try:
        tc = require_toolchain()
        targets = check_targets(_split(arch), tc)
        instances = instances or generator.INSTANCES_DIR
        declared = _declared_mod_kernels(mods_file)
        kernels = _select(list(family), kernels_glob, extra=declared)
        modded = [k for k in kernels if k in declared]
        selected = select_jobs([k for k in kernels if k not in declared], targets, instances, ptx=ptx)
        check_sources(selected, instances)
        if modded:  # their sources are the build's own, generated from the mods file
            generator.write(out.resolve() / "mod_instances", modded)
            selected += select_jobs(modded, targets, out.resolve() / "mod_instances", ptx=ptx)
        if not selected:
            why = ""
            if kernels:  # the filters match, the targets do not: say where the first one builds
                where = [t for t in sorted({normalize_target(a) for a in tc.nvcc_archs} | {"sm90a"}, key=target_cc)
                         if kernels[0].runs_on(t)]
                why = (f": {len(kernels)} kernel(s) match the filters, none builds for it "
                       f"({kernels[0].name} builds for {', '.join(where) or 'no target this nvcc has'})")
            asked = [f"--arch {','.join(targets)}", *([f"--family {','.join(family)}"] if family else []),
                     *([f"--kernels {kernels_glob}"] if kernels_glob else [])]
            _fail(f"no kernel matches {' '.join(asked)}{why}")
        compile_jobs = units(selected)
        shared = sorted((len(m) for m in compile_jobs.values() if m[0].grouped), reverse=True)
        n = len(compile_jobs)
        in_units = (f": {n} nvcc job{'' if n == 1 else 's'}, units of {' and '.join(map(str, shared))} kernels "
                    "among them (minutes each)") if shared else ""
        console.print(f"building {len(selected)} binaries for {', '.join(targets)} into {out} "
                      f"(nvcc {tc.nvcc_version}, CUTLASS {tc.cutlass_version}){in_units}", highlight=False)
        result = run_build(selected, tc, out, parallelism=jobs, launcher=launcher, console=console)
    except FlashgenError as e:
        _fail(str(e))
    built = len(result.jobs) - len(result.failed)
    console.print(f"{built} of {len(result.jobs)} binaries ready ({result.compiled} compiled) in "
                  f"{result.seconds:.1f} s; manifest: {result.manifest_path}", highlight=False)
    if result.failed:
        for job in result.failed:
            console.print(f"[red]FAILED[/] {job.kernel.name} ({job.target}): log {result.build_dir / job.log}",
                          highlight=False)
        _fail(f"{len(result.failed)} kernel(s) failed to build")


def _manifest_dir(build_dir: Optional[Path]) -> Optional[Path]:
    """Where `list` reads kernels from: --build-dir, ./build/kernels, or the installed package."""
    from flashgen.build.manifest import MANIFEST_NAME
    from flashgen.runtime.registry import PACKAGE_KERNELS

    if build_dir is not None:
        return build_dir
    for candidate in (DEFAULT_BUILD_DIR, PACKAGE_KERNELS):
        if (candidate / MANIFEST_NAME).exists():
            return candidate
    return None


def _verify(directory: Path, record: dict) -> str:
    from flashgen.build.cubin import sha256_file
    from flashgen.build.manifest import binary_path

    path = directory / binary_path(record)
    if not path.is_file():
        return "missing"
    return "ok" if sha256_file(path) == record["sha256"] else "mismatch"


@main.command(name="list")
@click.option("--family", multiple=True, help="Only these families.")
@click.option("--arch", "arch", multiple=True, help="Only kernels that run on these targets.")
@click.option("--dtype", multiple=True, type=click.Choice(["f32", "f16", "bf16"]))
@click.option("--max-k", type=int, default=None, help="Only kernels with this kMaxK tier.")
@click.option("--kernels", "kernels_glob", default=None, help="Comma-separated name globs.")
@click.option("--build-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help=f"Read this build's manifest (default: {DEFAULT_BUILD_DIR} if it exists, "
                   "else the kernels installed with the package).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
def list_(family, arch, dtype, max_k, kernels_glob, build_dir, as_json) -> None:
    """List kernels: what a build or the installed package holds (each binary's sha256 checked, and
    the Params layout it was built for), or, where nothing is built, what the families would build.
    Exits 1 if a binary fails its check."""
    from flashgen.build import manifest

    targets = [normalize_target(t) for t in _split(arch)]
    directory = _manifest_dir(build_dir)
    entries = []
    if directory is not None:
        try:
            entries = manifest.read(directory / manifest.MANIFEST_NAME)["kernels"]
        except FlashgenError as e:
            _fail(str(e))
    # a mods file's score-mod instances are no default kernels: the manifest's params make them
    declared = [FAMILIES[e["family"]](**e["params"]) for e in entries if e.get("score_mod") and e["family"] in FAMILIES]
    selected = {k.name: k for k in _select(list(family), kernels_glob, list(dtype), max_k, extra=declared)
                if not targets or any(k.runs_on(t) for t in targets)}
    rows = []
    if directory is None:
        rows = [{"name": k.name, "family": k.FAMILY, "params": k.params, "targets": {}} for k in selected.values()]
    else:
        for e in entries:
            if e["name"] not in selected:
                continue
            stale = manifest.stale_layout(e)
            records = {t: dict(r, verified="stale layout, rebuild" if stale else _verify(directory, r))
                       for t, r in e["targets"].items() if not targets or t in targets or t.startswith("compute")}
            rows.append({"name": e["name"], "family": e["family"], "params": e["params"], "targets": records})
    bad = [(row["name"], t, r["verified"]) for row in rows for t, r in row["targets"].items() if r["verified"] != "ok"]
    if as_json:
        click.echo(json.dumps(rows, indent=1))
    else:
        table = []
        for row in rows:
            if not row["targets"]:
                table.append([row["family"], row["name"], "-", "", "", "", "", "", ""])
            for target, r in sorted(row["targets"].items()):
                regs = r.get("registers", "jit")
                spills = f"{r['spill_stores']}/{r['spill_loads']}" if "spill_stores" in r else "jit"
                table.append([row["family"], row["name"], target, regs, spills, f"{r['shared_memory_dynamic']:,}",
                              r["threads_per_block"], f"{r['size'] / 1024:.0f} KiB", r["verified"]])
        click.echo(_table(["family", "kernel", "target", "regs", "spills st/ld", "smem", "threads", "size",
                           "sha256"], table))
        source = f"from {directory / manifest.MANIFEST_NAME}" if directory else "nothing built: the families' default sets"
        click.echo(source)
        for name in FAMILIES:
            of_family = [r for r in rows if r["family"] == name]
            if of_family:
                click.echo(f"{name}: {len(of_family)} kernels")
    if bad:
        for name, target, status in bad:
            click.echo(f"{click.style('FAILED CHECK', fg='red')} {name} ({target}): {status}; it will not be loaded",
                       err=True)
        sys.exit(1)


def _every_group_used(grid, groups, hidden, head_dims):
    """``grid``, refused if a --group divides none of its head counts (checked before torch or a GPU is
    looked for: a typo fails fast anywhere)."""
    unused = sorted(set(groups) - {p.group for p in grid})
    if unused:
        heads = ", ".join(f"{hidden // hd} (head dim {hd})" for hd in head_dims)
        raise click.BadParameter(f"{', '.join(map(str, unused))} divides none of the head counts: {heads}",
                                 param_hint="--group")
    return grid


def _grid_options(head_dims):
    """The benchmark grid's options (bench.default_grid), shared by tune and bench, with ``head_dims``
    as the default head dims."""
    options = [
        click.option("--dtype", "dtypes", multiple=True, type=click.Choice(["f16", "bf16"]), default=("f16", "bf16")),
        click.option("--head-dim", "head_dims", multiple=True, type=int, default=head_dims, show_default=True),
        click.option("--seqlen", "seqlens", multiple=True, type=int, default=(512, 1024, 2048, 4096, 8192, 16384)),
        click.option("--tokens", type=int, default=16384, show_default=True, help="batch x seqlen"),
        click.option("--hidden", type=int, default=2048, show_default=True, help="heads x head dim"),
        click.option("--group", "groups", multiple=True, type=click.IntRange(min=1), default=(1,), show_default=True,
                     help="Query heads per key/value head (grouped-query attention; repeatable): k and v get "
                          "heads / N heads.  Left out for a head dim whose head count N does not divide."),
    ]

    def decorate(command):
        for option in reversed(options):
            command = option(command)
        return command
    return decorate


@main.command()
@_grid_options(head_dims=(64, 128))  # the tiers with several tiles to choose from
@click.option("--repeats", type=int, default=10, show_default=True)
@click.option("--passes", type=click.IntRange(min=1), default=3, show_default=True,
              help="Times each point is measured; a choice's time is the median of its passes.")
@click.option("--out", "out_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Where to write the table [default: tuning-<gpu>-sm<cc>.json]; an existing table for this "
                   "GPU, measured with the same --passes, is resumed.")
def tune(dtypes, head_dims, seqlens, tokens, hidden, groups, repeats, passes, out_path) -> None:
    """Time every kernel tile and key-split policy per shape bucket on this GPU; write a tuning table.

    Use the table with FLASHGEN_TUNING=<path> (or flashgen.use_tuning_table), or
    ship it in flashgen/tuning/ where the runtime finds it by GPU name.  A backward bucket is
    per --group (query heads per k/v head): grouped-query backwards use only entries measured at their group.
    """
    from flashgen import tune as t
    from flashgen.bench import default_grid

    grid = _every_group_used(default_grid(dtypes, head_dims, hidden, tokens, seqlens, groups), groups, hidden,
                             head_dims)
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
    except Exception as e:
        _fail(f"flashgen tune needs CuPy and a CUDA GPU ({type(e).__name__}: {e})")
    from flashgen.runtime.device import device_info

    device = device_info(cupy.cuda.runtime.getDevice())
    pairs = sum(len(t.directions(p)) for p in grid)
    click.echo(f"{device.name} (sm_{device.cc}): tuning {pairs} point/directions", err=True)
    slug = "".join(ch if ch.isalnum() else "_" for ch in device.name.lower()).strip("_")
    out_path = out_path or Path(f"tuning-{slug}-sm{device.cc}.json")
    try:
        table = t.tune(grid, repeats, lambda line: click.echo(line, err=True), " ".join(["flashgen"] + sys.argv[1:]),
                       out_path, passes)
    except ValueError as e:
        _fail(str(e))
    click.echo(f"{len(table.entries)} buckets where a choice beat the priority order by > "
               f"{t.KEEP_DEFAULT:.0%} and in every pass; table: {out_path}")


@main.command()
@_grid_options(head_dims=GRID_HEAD_DIMS)
@click.option("--impl", "impls", multiple=True, type=click.Choice(["flashgen", "flashgen-torch", "fa4", "sdpa-flash",
                                                                   "sdpa-efficient", "sdpa-cudnn", "flex"]),
              default=("flashgen", "flashgen-torch", "fa4", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn"),
              show_default=True,
              help="flashgen-torch: flashgen through flashgen.torch.attention, backward by autograd, as a training "
                   "step calls it (the table's fg-torch/fg divides its TFLOP/s by flashgen's). "
                   "fa4: FlashAttention-4 (pip install flash-attn-4; where it does not import, its cells are '-' "
                   "and a note under the table says why). "
                   "flex: torch.compile'd flex_attention (compiles once per shape: slow to start). "
                   "fa4 and flex compile on the first call at a point: that call's seconds are a column of their "
                   "own (fa4 compile s), not in the TFLOP/s.")
@click.option("--mask", "masks", multiple=True, type=click.Choice(["document8", "window1024", "document8-causal"]),
              help="Time under a block mask instead (repeatable; replaces the full and causal points): document8, "
                   "8 equal documents per sequence; window1024, causal over the last 1024 keys; document8-causal, "
                   "the documents, causal within each (flashgen: the document mask and causal=top_left).  flashgen "
                   "gets a flashgen.block_mask of it, flex the same mask; TFLOP/s count only the scores it shows.")
@click.option("--score-mod", "score_mods", multiple=True, type=click.Choice(["alibi"]),
              help="Time with a score mod instead (repeatable; its causal and full points replace the plain ones): "
                   "alibi, score - slope[h] * |q_idx - kv_idx|.  flashgen runs its compiled-in ALiBi instances, "
                   "flex the same expression as its score_mod; the other peers take none.")
@click.option("--variant", "variants", multiple=True, type=click.Choice(["bias", "dropout"]),
              help="Time with an attention bias or dropout instead (repeatable; its causal and full points replace "
                   "the plain ones): bias, a [1, H, S, S] bias with its gradient; dropout, p = 0.1.  flashgen's "
                   "columns gain flashgen-plain (the same call without it) and flashgen-example41 (it on CUTLASS "
                   "example 41's kernels), and the table fg/plain and fg/ex41; SDPA gets the bias as attn_mask, "
                   "flex as a score_mod.")
@click.option("--all-instances", is_flag=True, help="Also time every flashgen kernel tile (and backward key-split "
              "policy) that can serve each point, as flashgen[<tile>] (not under a mask, mod or variant), and the "
              "runtime's own choice as flashgen[default], back to back after the interleaved rounds: read them "
              "against each other (the table's best tile / its default), not against the other columns, whose clocks "
              "differ.")
@click.option("--repeats", type=int, default=30, show_default=True,
              help="Timed calls per implementation and direction, in 10 interleaved rounds.")
@click.option("--timing", type=click.Choice(["call", "queued"]), default="call", show_default=True,
              help="call: each call timed alone, its host work before the launch included; queued: calls issued "
                   "back to back as a training loop issues them, so host work hides behind the GPU's.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path), default=None)
def bench(dtypes, head_dims, seqlens, tokens, hidden, groups, masks, score_mods, variants, impls, all_instances,
          repeats, timing, json_path, plot_path) -> None:
    """Forward and backward TFLOP/s of flashgen (directly and through its PyTorch adapter), FlashAttention-4 and
    torch's SDPA backends, side by side."""
    from flashgen import bench as b, bench_host as host
    from flashgen.bench_table import bench_notes, bench_table, plot

    if masks and score_mods:  # flashgen's score-mod instances take no block mask (runtime/score_mods.py)
        raise click.BadParameter("a score mod with a block mask is not benched: pass one of the two",
                                 param_hint="--score-mod")
    if variants and (masks or score_mods):  # one thing a point adds to the plain call, so its ratios say what it costs
        raise click.BadParameter("a bias or dropout with a block mask or score mod is not benched: pass one of them",
                                 param_hint="--variant")
    grid = _every_group_used(b.default_grid(dtypes, head_dims, hidden, tokens, seqlens, groups, masks, score_mods,
                                            variants), groups, hidden, head_dims)
    try:
        import torch
    except ImportError:
        _fail("flashgen bench needs torch (for the peers and the inputs): pip install torch")
    if not torch.cuda.is_available():
        _fail("flashgen bench needs a CUDA GPU")
    click.echo(f"{torch.cuda.get_device_name()}: {len(grid)} points x {len(impls)} implementations", err=True)
    results = []
    for n, point in enumerate(grid, 1):
        rows = b.bench_point(point, list(impls), torch, repeats, all_instances, queued=timing == "queued")
        results += rows
        summary = "  ".join(f"{r.impl}/{r.direction} {r.tflops:.0f}"
                            + (f" (first call {r.compile_s:.1f} s)" if r.compile_s is not None else "")
                            for r in rows if r.tflops)
        click.echo(f"[{n}/{len(grid)}] {point.dtype} d{point.head_dim} {'causal ' if point.causal else ''}"
                   + "".join(f"{extra} " for extra in (point.mask, point.score_mod, point.variant) if extra) +
                   f"B{point.batch} H{point.heads_label} S{point.seqlen}: {summary}", err=True)
    click.echo(bench_table(grid, results, impls, all_instances))
    for line in bench_notes(results):
        click.echo(line)
    overhead = host.call_overhead_us(torch)
    for name, us in overhead.items():
        click.echo(f"call overhead, {name}: {us:.1f} us")
    for direction, ratio in host.adapter_cost_ratios(overhead).items():
        click.echo(f"flashgen.torch's own host cost over the CuPy path's, {direction}: {ratio:.2f}x")
    imports = host.import_times_ms()
    for name, ms in imports.items():
        click.echo(f"{name}: {ms:.1f} ms")
    if json_path:
        json_path.write_text(json.dumps({"device": torch.cuda.get_device_name(), "timing": timing,
                                         "overhead_us": overhead, "import_ms": imports,
                                         "command": " ".join(["flashgen"] + sys.argv[1:]),
                                         "results": [r.as_dict() for r in results]}, indent=1))
    if plot_path:
        plot(results, plot_path)
        click.echo(f"plot: {plot_path}", err=True)
