"""``flashgen bench``: flashgen side by side with the attention a user would otherwise pick.

Forward and backward throughput over a grid of shapes, in one process, with
CUDA events, warm-up, the median of many repeats and three input sets used in
turn (so repeated runs do not measure the cache).  TFLOP/s follow
FlashAttention's convention: forward 4*B*H*M*N*D (halved for causal),
backward 2.5x that, H the query heads.  A point may be grouped-query
(``Point.group`` query heads per key/value head): k and v then have H / group
heads, and the FLOP count is the same (every query head still attends over
every key), so TFLOP/s compare across groups as time does.  Whatever an
implementation does with fewer k/v heads (flashgen's example-41 fallback
repeats them per query head) is in its timing, as a user pays it; one that
refuses them (an SDPA backend without a GQA kernel) gets a note, not a number.

Backward timing: flashgen calls ``attention_backward`` directly (no autograd);
torch's SDPA backends are timed with ``torch.autograd.grad`` on one retained
forward graph, the cheapest honest path to their backward kernels.
``flashgen-torch`` is flashgen through its PyTorch adapter, timed the way
SDPA is, so against ``flashgen`` it shows what the adapter costs a training
step.  ``fa4`` is FlashAttention-4 (the pip package ``flash-attn-4``), whose
CuTe DSL kernels are compiled on the first call for each configuration: that
first call lands in the warm-up, so the compile is in no timing, and its wall
time is reported on its own as ``Result.compile_s``.  Needs torch for the
peers (and for the inputs); flashgen itself runs through CuPy.
"""
from __future__ import annotations

import contextlib
import functools
import os
import random
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Callable, List, Optional

TORCH_BACKENDS = ("flash", "efficient", "cudnn")
JIT_IMPLS = ("fa4", "flex")  # compile on the first call at a point: Result.compile_s says how long that took


@dataclass
class Point:
    """One shape of the grid.  ``heads`` counts query heads; k and v have ``heads // group``
    (``group`` = 1: multi-head, > 1: grouped-query).  ``mask`` names a block mask the point runs
    under instead (``bench_masks``; "" for none), ``score_mod`` a score mod its scores take
    (``bench_mods``; "" for none), ``variant`` an attention bias or dropout the calls take
    (``bench_variants``; "" for none).  They come last with defaults, so a point written before they
    existed (``Point(**old_json_point)``) still loads, as the same shape."""

    dtype: str
    head_dim: int
    causal: bool
    batch: int
    heads: int
    seqlen: int
    group: int = 1
    mask: str = ""
    score_mod: str = ""
    variant: str = ""

    @property
    def kv_heads(self) -> int:
        return self.heads // self.group

    @property
    def heads_label(self) -> str:
        """``H/Hk``, as the table's column and the progress lines show it (e.g. "32/8")."""
        return f"{self.heads}/{self.kv_heads}"


@dataclass
class Result:
    impl: str
    direction: str  # "fwd" | "bwd"
    point: Point
    ms: Optional[float]  # None: not applicable here
    tflops: Optional[float]
    note: str = ""
    spread: Optional[float] = None  # run-to-run noise: (slowest - fastest round median) / median
    compile_s: Optional[float] = None  # JIT_IMPLS: wall seconds of the point's first call (compile + one run)

    def as_dict(self) -> dict:
        return dict(asdict(self), point=asdict(self.point))


# The bench's default head dims: the two that most models use, and 256, the largest tier (issue 16).
HEAD_DIMS = (64, 128, 256)


def default_grid(dtypes=("f16", "bf16"), head_dims=HEAD_DIMS, hidden=2048, tokens=16384,
                 seqlens=(512, 1024, 2048, 4096, 8192, 16384), groups=(1,), masks=(), score_mods=(),
                 variants=()) -> List[Point]:
    """Every combination, with ``hidden // head_dim`` query heads and ``tokens // seqlen`` batches.
    A group that does not divide a head dim's head count is left out for that head dim only
    (hidden 2048: group 32 fits head dim 64's 32 heads, not 128's 16), so a mixed grid still runs
    what it can; the CLI refuses a group that fits no head dim at all.  With ``masks``, each
    mask replaces the causal and full points (a mask carries its own causality); with
    ``score_mods`` (``variants``), each mod's (variant's) causal and full points replace the plain ones."""
    return [Point(d, hd, causal, max(1, tokens // s), hidden // hd, s, g, mask, mod, variant)
            for d in dtypes for hd in head_dims for mod in (score_mods or ("",)) for variant in (variants or ("",))
            for causal, mask in _mask_kinds(masks) for g in groups if (hidden // hd) % g == 0 for s in seqlens]


def _mask_kinds(masks) -> List[tuple]:
    """(causal, mask) per grid line: full and causal, or each block mask asked for."""
    return [(False, m) for m in masks] if masks else [(False, ""), (True, "")]


def flops(p: Point, direction: str) -> float:
    """FlashAttention's count: 4 B H S^2 D forward, 2.5 times that backward, halved with a causal
    mask; under a block mask only the scores it shows count (``bench_masks.visible``)."""
    shown = 0.5 if p.causal else 1.0
    if p.mask:
        from flashgen.bench_masks import visible

        shown = visible(p.mask, p.seqlen)
    return 4.0 * p.batch * p.heads * p.seqlen * p.seqlen * p.head_dim * shown * (2.5 if direction == "bwd" else 1.0)


@dataclass
class Timed:
    """One implementation and direction at one point, timed in interleaved rounds."""

    impl: str
    direction: str
    fn: Optional[Callable[[int], object]]  # i picks the input set; None: could not be set up (see error)
    context: Callable[[], object] = contextlib.nullcontext
    times: List[float] = field(default_factory=list)
    round_medians: List[float] = field(default_factory=list)
    error: Optional[str] = None
    first_call_s: Optional[float] = None  # wall time of the first warm-up call, synchronized on both sides


def time_interleaved(entries: List[Timed], torch, rounds: int = 10, repeats: int = 30, warmup: int = 3,
                     queued: bool = False) -> None:
    """Time every entry in ``rounds`` rounds, each visiting the entries in a new random order, so
    clock ramps, thermal drift and the after-effects of the previous implementation (a hot
    cuDNN kernel lowers the clocks for the next one) fall on every implementation alike.  Each
    call is timed alone between CUDA events (host work before the launch counts, as it does
    for a user).  With ``queued`` a round's calls are issued back to back, as a training loop
    issues them, each between its own pair of events, and the host waits once per round: a
    call's time is then the GPU's, as long as the host issues faster than the GPU runs (one
    untimed call opens each round, so the first timed one has work queued ahead of it too).
    Entries that arrive with an error are not run.

    The first warm-up call is timed on the host clock on its own (``first_call_s``): for a peer
    that compiles its kernels on first use that is the compile, which the warm-up keeps out of
    the timed rounds."""
    for e in entries:
        if e.error is not None:
            continue
        try:
            with e.context():
                torch.cuda.synchronize()
                start = time.perf_counter()
                e.fn(0)
                torch.cuda.synchronize()
                e.first_call_s = time.perf_counter() - start
                for i in range(1, warmup):
                    e.fn(i)
            torch.cuda.synchronize()
        except Exception as ex:  # a peer that does not support this point
            torch.cuda.synchronize()
            e.error = error_note(ex)
    live = [e for e in entries if e.error is None]
    per_round = max(1, repeats // rounds)
    order = random.Random(0)
    for r in range(rounds):
        order.shuffle(live)
        for e in live:
            with e.context():
                times = _queued_round(e, torch, r, per_round) if queued else _lone_calls(e, torch, r, per_round)
            e.times += times
            e.round_medians.append(statistics.median(times))


def _lone_calls(e: Timed, torch, r: int, calls: int) -> List[float]:
    """Milliseconds of each call of round ``r``, the host waiting for each before the next."""
    times = []
    for i in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        e.fn(r * calls + i)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _queued_round(e: Timed, torch, r: int, calls: int) -> List[float]:
    """Milliseconds of each call of round ``r`` issued back to back after one untimed call."""
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(calls)]
    e.fn(r * calls + calls - 1)
    for i, (start, end) in enumerate(events):
        start.record()
        e.fn(r * calls + i)
        end.record()
    events[-1][1].synchronize()
    return [start.elapsed_time(end) for start, end in events]


def error_note(ex: Exception) -> str:
    """Why an entry has no timing, short enough for a results table."""
    return f"{type(ex).__name__}: {str(ex)[:80]}"


def spread(e: Timed) -> Optional[float]:
    """Run-to-run noise of an entry: (slowest - fastest round median) / overall median."""
    if not e.times:
        return None
    return (max(e.round_medians) - min(e.round_medians)) / statistics.median(e.times)


def shapes(p: Point):
    """[B, S, H, D] shapes of q, k, v and dO: k and v have the point's k/v heads (fewer under GQA)."""
    q = (p.batch, p.seqlen, p.heads, p.head_dim)
    kv = (p.batch, p.seqlen, p.kv_heads, p.head_dim)
    return q, kv, kv, q


def _inputs(torch, p: Point, sets: int = 3):
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16}[p.dtype]
    return [[torch.randn(shape, device="cuda", dtype=dtype) for shape in shapes(p)] for _ in range(sets)]


def _gqa_note(p: Point, note: str) -> str:
    """A peer that fails at a grouped-query point: say so, as the likely reason (an SDPA backend
    without a GQA kernel answers only "No available kernel")."""
    return f"at GQA {p.heads_label} heads: {note}" if p.group > 1 else note


def bench_point(p: Point, impls: List[str], torch, repeats: int = 30, all_instances: bool = False,
                queued: bool = False) -> List[Result]:
    import cupy

    sets = _inputs(torch, p)
    # SDPA and flex take [B, H, S, D]: transposed views of the same BMHK buffers
    t_sets = [[t.transpose(1, 2).requires_grad_(j < 3) if j < 3 else t.transpose(1, 2) for j, t in enumerate(s)]
              for s in sets]
    if p.mask:
        from flashgen import bench_masks

        entries = bench_masks.entries(p, impls, sets, t_sets, torch)
    elif p.score_mod:
        from flashgen import bench_mods

        entries = bench_mods.entries(p, impls, sets, t_sets, torch)
    elif p.variant:
        from flashgen import bench_variants

        entries = bench_variants.entries(p, impls, sets, t_sets, torch)
    else:
        entries = _unmasked_entries(p, impls, sets, t_sets, torch)
    not_set_up = {id(e) for e in entries if e.error}  # e.g. an import: not about this point's shape
    time_interleaved(entries, torch, repeats=repeats, queued=queued)
    for e in entries:
        if e.error and id(e) not in not_set_up:
            e.error = _gqa_note(p, e.error)
    results = [Result(e.impl, e.direction, p, None, None, e.error) if e.error else
               Result(e.impl, e.direction, p, statistics.median(e.times),
                      flops(p, e.direction) / statistics.median(e.times) / 1e9, spread=spread(e),
                      compile_s=e.first_call_s if e.impl in JIT_IMPLS else None)
               for e in entries]
    del sets, t_sets
    if all_instances and (p.mask or p.score_mod or p.variant):  # tune: plain inputs
        why = ("instances not timed at block-mask points: flashgen tune measures unmasked shapes only"
               if p.mask else "instances not timed at score-mod, bias or dropout points: flashgen tune measures "
               "plain calls only")
        results += [Result("flashgen[*]", direction, p, None, None, why) for direction in ("fwd", "bwd")]
    elif all_instances:  # every tile (and split policy) the runtime could pick here, through a one-entry table
        from flashgen import tune
        from flashgen.runtime.device import device_info
        from flashgen.runtime.registry import default_registry

        device = device_info(cupy.cuda.runtime.getDevice())
        for direction in ("fwd", "bwd"):
            # back to back after the rounds, so on other clocks than the columns above: the runtime's
            # own choice is timed the same way, as flashgen[default], for the tiles to be read against
            times = tune.measure_choices(p, direction, default_registry(), device, repeats)
            for label, ms in times.items():
                results.append(Result(f"flashgen[{label}]", direction, p, ms, flops(p, direction) / ms / 1e9))
    torch.cuda.empty_cache()
    cupy.get_default_memory_pool().free_all_blocks()
    return results


def _unmasked_entries(p: Point, impls: List[str], sets, t_sets, torch) -> List[Timed]:
    """Each asked implementation's forward and backward at a point without a block mask."""
    causal = "top_left" if p.causal else None
    entries: List[Timed] = []
    if "flashgen" in impls:
        entries += flashgen_entries(sets, torch, causal=causal)
    if "flashgen-torch" in impls:
        entries += flashgen_torch_entries(sets, torch, causal=causal)
    if "fa4" in impls:
        entries += _fa4_entries(p, sets, torch)
    entries += sdpa_entries(p, impls, t_sets, torch, is_causal=p.causal)
    if "flex" in impls:
        entries += flex_entries(p, t_sets, torch)
    return entries


def sdpa_entries(p: Point, impls: List[str], t_sets, torch, grad_also=(), **kwargs) -> List[Timed]:
    """The asked SDPA backends (``sdpa-*`` in ``impls``), each restricted to its kernel, on the point's
    [B, H, S, D] views with ``kwargs`` (is_causal, attn_mask, dropout_p); the backward through
    autograd, into the leaves ``grad_also`` too.  Grouped-query points pass ``enable_gqa``, only
    they: torch < 2.5 has no such argument."""
    sdpa = torch.nn.functional.scaled_dot_product_attention
    if p.group > 1:
        kwargs["enable_gqa"] = True
    entries: List[Timed] = []
    for backend in TORCH_BACKENDS:
        impl = f"sdpa-{backend}"
        if impl not in impls:
            continue
        kind = {"flash": torch.nn.attention.SDPBackend.FLASH_ATTENTION,
                "efficient": torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": torch.nn.attention.SDPBackend.CUDNN_ATTENTION}[backend]
        context = functools.partial(torch.nn.attention.sdpa_kernel, kind)
        entries.append(Timed(impl, "fwd", lambda i: sdpa(*t_sets[i % 3][:3], **kwargs), context))
        entries.append(Timed(impl, "bwd", autograd_backward(lambda s: sdpa(*s[:3], **kwargs), t_sets, torch,
                                                            grad_also), context))
    return entries


def causal_option(p: Point) -> dict:
    """flashgen's causal option at the point, for keyword use (nothing where it is not causal)."""
    return {"causal": "top_left"} if p.causal else {}


@contextlib.contextmanager
def only_families(families: Optional[str]):
    """FLASHGEN_FAMILIES set to ``families`` (None: left as it is) while an entry runs: the runtime
    reads it on every dispatch, so one process can time flashgen on a chosen set of families."""
    if families is None:
        yield
        return
    from flashgen.runtime.plans import FAMILIES_VARIABLE

    saved = os.environ.get(FAMILIES_VARIABLE)
    os.environ[FAMILIES_VARIABLE] = families
    try:
        yield
    finally:
        if saved is None:
            del os.environ[FAMILIES_VARIABLE]
        else:
            os.environ[FAMILIES_VARIABLE] = saved


def flashgen_entries(sets, torch, impl: str = "flashgen", families: Optional[str] = None,
                     backward_options: Optional[dict] = None, **options) -> List[Timed]:
    """flashgen's runtime on CuPy views of the point's buffers, on torch's stream, with ``options``
    (causal, block_mask, ...) in both directions and ``backward_options`` (bias_requires_grad) in
    the backward; the backward takes each set's own forward outputs.  ``impl`` names the entries,
    ``families`` the families the runtime may use while they run (``only_families``)."""
    import cupy

    from flashgen.runtime import api

    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream)
    cp_sets = [[cupy.from_dlpack(t) for t in s] for s in sets]
    bwd_options = dict(options, **(backward_options or {}))

    @contextlib.contextmanager
    def context():
        with only_families(families), stream:
            yield

    try:
        with context():
            fwd_out = [api.attention_forward(q, k, v, **options) for q, k, v, _ in cp_sets]
    except Exception as ex:  # e.g. families whose kernels were not built: a note, as for a peer
        return [Timed(impl, direction, None, error=error_note(ex)) for direction in ("fwd", "bwd")]
    return [Timed(impl, "fwd", lambda i: api.attention_forward(*cp_sets[i % 3][:3], **options), context),
            Timed(impl, "bwd", lambda i: api.attention_backward(
                cp_sets[i % 3][3], *cp_sets[i % 3][:3], *fwd_out[i % 3], **bwd_options), context)]


def autograd_backward(forward, t_sets, torch, also=()):
    """The cheapest honest path to a torch backward: one retained forward graph per input set
    (built during warm-up), then ``torch.autograd.grad`` with the set's dO, into q, k, v and the
    leaves ``also`` (an attention bias that requires grad)."""
    outs = []

    def backward(i):
        if not outs:
            outs.extend(forward(s) for s in t_sets)
        return torch.autograd.grad(outs[i % 3], (*t_sets[i % 3][:3], *also), t_sets[i % 3][3], retain_graph=True)

    return backward


def _grad_leaves(sets):
    """The [B, S, H, D] q, k, v of each input set as new leaves that require grad (same storage),
    and its dO, for peers that take bench's own layout and are timed as a training step."""
    return [[t.detach().requires_grad_() for t in s[:3]] + [s[3]] for s in sets]


def flashgen_torch_entries(sets, torch, grad_also=(), **options) -> List[Timed]:
    """flashgen through ``flashgen.torch.attention`` as a training step calls it: the same
    [B, S, H, D] buffers as the ``flashgen`` entries, as leaves that require grad (so the forward
    saves what its backward needs), backward through autograd like SDPA.  An adapter that cannot
    be imported is a result for this point, as an unsupported point is for a peer.  ``grad_also``:
    further leaves the backward differentiates (``autograd_backward``'s ``also``)."""
    try:
        from flashgen.torch import attention
    except Exception as ex:
        return [Timed("flashgen-torch", direction, None, error=error_note(ex)) for direction in ("fwd", "bwd")]
    g_sets = _grad_leaves(sets)

    def forward(s):
        return attention(*s[:3], **options)

    return [Timed("flashgen-torch", "fwd", lambda i: forward(g_sets[i % 3])),
            Timed("flashgen-torch", "bwd", autograd_backward(forward, g_sets, torch, grad_also))]


def _fa4_entries(p: Point, sets, torch) -> List[Timed]:
    """FlashAttention-4 (``flash_attn.cute.interface.flash_attn_func``, pip package
    ``flash-attn-4``) on the same [B, S, H, D] buffers as flashgen, no transposes, as leaves that
    require grad; backward through autograd like SDPA.  Its kernels are compiled on the first
    call for each configuration, inside the warm-up (``time_interleaved``), so the timings hold
    none of it and ``compile_s`` reports it.  A package that does not import (missing, or its
    CUTLASS DSL failing to load) is a result for this point, as an unsupported point is."""
    try:
        from flash_attn.cute.interface import flash_attn_func
    except Exception as ex:
        return [Timed("fa4", direction, None, error=error_note(ex)) for direction in ("fwd", "bwd")]
    g_sets = _grad_leaves(sets)

    def forward(s):
        out = flash_attn_func(*s[:3], causal=p.causal)
        return out[0] if isinstance(out, tuple) else out  # (out, lse): lse is None unless return_lse

    return [Timed("fa4", "fwd", lambda i: forward(g_sets[i % 3])),
            Timed("fa4", "bwd", autograd_backward(forward, g_sets, torch))]


_flex = None


def flex_entries(p: Point, t_sets, torch, mask=None, score_mod=None, grad_also=()) -> List[Timed]:
    """torch.compile'd flex_attention: Triton kernels generated for the shape and mask, compiled
    once per shape (during warm-up); backward through autograd like SDPA.  Grouped-query points
    pass ``enable_gqa`` (flex refuses k/v with fewer heads without it).  ``mask``: flex's block
    mask of a masked point (bench_masks); else a causal one at a causal point, none otherwise.
    ``score_mod``: flex's score mod of a score-mod point (bench_mods) or bias point (bench_variants,
    whose bias, in ``grad_also``, gets its gradient too)."""
    global _flex
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _flex is None:
        # a compile per shape, mask and score mod: past dynamo's default limit (8) flex_attention would
        # fall back to its unfused eager form and time that instead
        config = torch._dynamo.config
        for limit in ("cache_size_limit", "recompile_limit"):
            if hasattr(config, limit):
                setattr(config, limit, max(getattr(config, limit), 256))
        _flex = torch.compile(flex_attention, dynamic=False)
    if mask is None and p.causal:
        mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, p.seqlen, p.seqlen, device="cuda")
    extra = {"enable_gqa": True} if p.group > 1 else {}
    if score_mod is not None:
        extra["score_mod"] = score_mod
    return [Timed("flex", "fwd", lambda i: _flex(*t_sets[i % 3][:3], block_mask=mask, **extra)),
            Timed("flex", "bwd", autograd_backward(lambda s: _flex(*s[:3], block_mask=mask, **extra), t_sets,
                                                    torch, grad_also))]
