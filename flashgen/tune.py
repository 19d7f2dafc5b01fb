"""``flashgen tune``: measure every choice the runtime could make per shape bucket, keep the fastest.

For each point of a grid (``bench.default_grid`` by default) and each
direction, every kernel tile that can serve the call on this GPU and, for the
backward, every key-split policy that gives a different split count is timed
through the public API with a one-entry table installed (so what is measured
is exactly what the runtime would launch).  The fastest becomes the bucket's
entry, unless the priority order's own choice is within ``KEEP_DEFAULT`` of it.
With several passes each choice's time is the median of its passes, the candidates
timed in the opposite order every other pass, and the fastest is recorded only if it
also beat the priority order in every pass: single passes of one H200 session
picked a different tile in most buckets where choices were within a few percent
(BENCHMARKS.md, session 31), and one lucky pass of three moves a median by as much
as such a margin (session 32: passes of a point spread by 3-7% at 512 tokens).
"""
from __future__ import annotations

import os
import statistics
from typing import Callable, Dict, List, Optional, Tuple

from flashgen.bench import Point, shapes
from flashgen.errors import UnsupportedError
from flashgen.runtime import tuning
from flashgen.runtime.select import KEYS_CAP, Request, num_splits_key, rejection, seq_multiples

KEEP_DEFAULT = 0.01  # a choice must beat the priority order by more than 1% (medians) to be recorded
ROUNDS = 5  # rounds a point's choices are timed in (measure_choices)
RESUMED = "; resumed by: "  # between the commands of a resumed table's runs (its measured["command"])


def family_for(direction: str, registry, device) -> str:
    """The family the runtime serves an aligned, bias- and dropout-free call from on ``device``:
    the first in dispatch order with kernels built for it."""
    from flashgen.runtime.families import serving

    found = serving(direction)
    if not found:
        raise UnsupportedError(f"no {direction} family to tune: FLASHGEN_FAMILIES allows none of them")
    for family in found:
        try:
            registry.for_device(family.name, device)
            return family.name
        except UnsupportedError:  # not built for this GPU
            continue
    return found[-1].name


def event_times(fn: Callable[[int], object], warmup: int, repeats: int) -> List[float]:
    """Milliseconds of each of ``repeats`` calls ``fn(i)`` between CUDA events on the current stream,
    after ``warmup`` untimed ones."""
    import cupy

    for i in range(warmup):
        fn(i)
    times = []
    for i in range(repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        fn(i)
        end.record()
        end.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, end))
    return times


def _cupy_dtype(name: str):
    import numpy as np

    if name == "bf16":
        try:
            import ml_dtypes
        except ImportError:
            raise RuntimeError("bf16 inputs need ml_dtypes (pip install ml-dtypes), as CuPy's bfloat16 does") from None
        return ml_dtypes.bfloat16
    return {"f16": np.float16, "f32": np.float32}[name]


def inputs(p: Point, sets: int = 3):
    """``sets`` independent (q, k, v, grad_out) sets, [B, S, heads, D] (k and v: the point's k/v heads),
    so repeats do not measure the cache."""
    import cupy

    dtype = _cupy_dtype(p.dtype)
    return [[cupy.random.standard_normal(shape, dtype=cupy.float32).astype(dtype) for shape in shapes(p)]
            for _ in range(sets)]


def directions(p: Point) -> Tuple[str, ...]:
    """What tune measures at a point: a forward bucket has no group (tuning.Bucket), so a multi-head
    point's forward speaks for grouped calls too, and a grouped point times the backward alone."""
    return ("fwd", "bwd") if p.group == 1 else ("bwd",)


def bucket_of(p: Point, family: str) -> tuning.Bucket:
    return tuning.Bucket.of(family, p.dtype, p.head_dim, p.head_dim, p.causal, p.seqlen, p.seqlen,
                            p.batch * p.heads, p.group)


def candidates(registry, device, p: Point, direction: str) -> List[Tuple[str, tuning.Choice]]:
    """(label, choice) for every distinct tile of the smallest head-dim tier that accepts an aligned call
    at ``p`` (priority order), times the split policies that change the backward's split count."""
    family = family_for(direction, registry, device)
    # a plain call: the bias and dropout twins, compiled in, take none (their own tiles are not its choices)
    req = Request(family, p.dtype, p.head_dim, p.head_dim, 8, False, False, device,
                  seq_multiples(p.seqlen, p.seqlen, False), band=p.causal, num_keys=min(p.seqlen, KEYS_CAP),
                  num_queries=min(p.seqlen, KEYS_CAP),
                  compiled_bias=True, compiled_dropout=True)
    accepting = [b for b in registry.for_device(family, device) if rejection(b, req) is None]
    # a larger head-dim tier's kernel runs the call on zeros past its head dim: more work on a like tile
    # (k192's 64 x 64 backward tile took 2.3x the k128 tiles' time at d128 on an H200), so only the smallest
    tier = min((b.spec.max_k for b in accepting), default=None)
    found, seen = [], set()
    for b in accepting:
        tile = tuning.tile_of(b.spec)
        if tile in seen or b.spec.max_k != tier:
            continue
        seen.add(tile)
        label = "_".join(f"{v}" for _, v in tile)
        if not b.constants.get("enable_split_keys"):  # no key splits to choose
            found.append((label, tuning.Choice(tile)))
            continue
        counts = {}
        for policy in tuning.SPLIT_POLICIES:
            n = num_splits_key(b, p.batch, p.heads, p.seqlen, device, p.head_dim, p.head_dim, policy)
            counts.setdefault(n, policy)  # "auto" first: the label of a count it already gives
        found += [(f"{label}/splits={n}({policy})", tuning.Choice(tile, policy)) for n, policy in counts.items()]
    return found


def run_call(api, direction: str, p: Point, sets) -> Callable[[int], object]:
    causal = "top_left" if p.causal else None
    if direction == "fwd":
        return lambda i: api.attention_forward(*sets[i % len(sets)][:3], causal=causal)
    outs = [api.attention_forward(q, k, v, causal=causal) for q, k, v, _ in sets]
    return lambda i: api.attention_backward(sets[i % len(sets)][3], *sets[i % len(sets)][:3], *outs[i % len(sets)],
                                            causal=causal)


def consulted(device, bucket: tuning.Bucket, choice: Optional[tuning.Choice]) -> None:
    """Refuse to time a choice the runtime would not make: with FLASHGEN_TUNING=off it consults no
    table, and every choice would time the priority order (the H200 table of a80583c recorded noise so)."""
    if choice is None:
        return
    found = tuning.choice(device, bucket)
    if found != choice:
        why = (f"FLASHGEN_TUNING={os.environ[tuning.VARIABLE]!r}: unset it and run again" if tuning.tables_off()
               else f"it found {found} for {device.name} (sm_{device.cc})")
        raise ValueError(f"the runtime does not consult flashgen tune's tables here ({why})")


def measure_choices(p: Point, direction: str, registry, device, repeats: int,
                    only: Optional[List[Tuple[str, tuning.Choice]]] = None) -> Dict[str, float]:
    """Milliseconds per call for the priority order ("default") and each candidate at ``p``: the
    median of ``repeats`` calls each (rounded up to whole rounds), timed in ``ROUNDS`` rounds that
    visit every choice, each round starting one choice further down the list.  Timed one after
    another, the default (always first) ran 1-5% faster than the same kernel timed right after it
    from 2k tokens on (BENCHMARKS.md, session 32): the GPU's clocks drift over a point, and rounds
    spread the drift over every choice."""
    import cupy

    from flashgen.runtime import api

    sets = inputs(p)
    bucket = bucket_of(p, family_for(direction, registry, device))
    choices = [("default", None)] + (only if only is not None else candidates(registry, device, p, direction))
    times = {label: [] for label, _ in choices}
    per_round = max(1, -(-repeats // ROUNDS))
    try:
        call = run_call(api, direction, p, sets)
        for r in range(ROUNDS):
            shift = r % len(choices)
            for label, choice in choices[shift:] + choices[:shift]:
                tuning.use_table(tuning.Table(device.name, device.cc, {} if choice is None else {bucket: choice}, {}))
                consulted(device, bucket, choice)
                # a new table drops the plans: one untimed call makes the next launch's (three in the
                # first round, to load the kernel and warm the clocks)
                times[label] += event_times(call, warmup=3 if r == 0 else 1, repeats=per_round)
    finally:
        tuning.use_table(None)
        del sets
        cupy.get_default_memory_pool().free_all_blocks()
    return {label: statistics.median(t) for label, t in times.items()}


def measure_passes(p: Point, direction: str, registry, device, repeats: int,
                   options: List[Tuple[str, tuning.Choice]], passes: int) -> Tuple[Dict[str, float], list]:
    """(each choice's median over ``passes`` passes of ``measure_choices``, the passes' own times); every
    other pass takes the candidates in reverse, so a clock that drifts over a point favours none."""
    runs = [measure_choices(p, direction, registry, device, repeats, options if i % 2 == 0 else options[::-1])
            for i in range(passes)]
    return {label: statistics.median(run[label] for run in runs) for label in runs[0]}, runs


def tune(points: List[Point], repeats: int, progress: Callable[[str], None], command: str,
         out_path, passes: int = 1) -> tuning.Table:
    """Measure ``points`` (each ``passes`` times) and write the table to ``out_path`` after each one
    (atomically), so an interrupted run loses at most one point; a run given an existing table for
    this GPU resumes it, skipping the points it already holds."""
    if passes < 1:
        raise ValueError(f"passes must be at least 1, got {passes}")
    import cupy

    import flashgen
    from flashgen.runtime.device import device_info
    from flashgen.runtime.registry import default_registry

    registry, device = default_registry(), device_info(cupy.cuda.runtime.getDevice())
    entries, measured = {}, []
    if out_path.exists():
        previous = tuning.Table.load(out_path)
        if (previous.device_name, previous.cc) != (device.name, device.cc):
            raise ValueError(f"{out_path} was measured on {previous.device_name} (sm_{previous.cc}), this is "
                             f"{device.name} (sm_{device.cc}): pass another --out")
        before = previous.measured.get("passes", 1)  # tables from before --passes took one
        if before != passes:
            raise ValueError(f"{out_path} was measured with {before} pass(es) a point, this run asks for {passes}: "
                             f"pass --passes {before} to resume it, or another --out")
        entries, measured = dict(previous.entries), list(previous.measured.get("points", []))
        earlier = previous.measured.get("command", "")  # the table keeps every command that measured into it
        if earlier and command not in earlier.split(RESUMED):
            command = earlier + RESUMED + command
    # points measured before Point had a group field are multi-head: read them as group 1 to resume them
    done = {(tuple(sorted({"group": 1, **m["point"]}.items())), m["direction"]) for m in measured}
    for n, p in enumerate(points, 1):
        for direction in directions(p):
            if (tuple(sorted(vars(p).items())), direction) in done:
                continue
            options = candidates(registry, device, p, direction)
            times, runs = measure_passes(p, direction, registry, device, repeats, options, passes)
            best_label = min((label for label, _ in options), key=times.__getitem__)
            # options[0] is the priority order's own tile with the "auto" split: the default itself
            keep_default = (best_label == options[0][0] or times["default"] <= times[best_label] * (1 + KEEP_DEFAULT)
                            or any(run[best_label] >= run["default"] for run in runs))
            if not keep_default:
                entries[bucket_of(p, family_for(direction, registry, device))] = dict(options)[best_label]
            measured.append({"point": vars(p), "direction": direction, "ms": times,
                             "chosen": "default" if keep_default else best_label,
                             **({"passes": runs} if passes > 1 else {})})
            table = tuning.Table(device.name, device.cc, entries,
                                 {"command": command, "flashgen": flashgen.__version__, "repeats": repeats,
                                  "passes": passes, "cupy": cupy.__version__, "points": measured})
            table.save(out_path)
            heads = p.heads_label if p.group > 1 else p.heads
            progress(f"[{n}/{len(points)}] {direction} {p.dtype} d{p.head_dim} {'causal ' if p.causal else ''}"
                     f"b{p.batch} h{heads} s{p.seqlen}: default {times['default']:.3f} ms, best {best_label} "
                     f"{times[best_label]:.3f} ms -> {'default' if keep_default else best_label}")
    return tuning.Table.load(out_path)
