"""The benchmark's bookkeeping (the timings themselves need a GPU: see BENCHMARKS.md)."""
from __future__ import annotations

import sys
import time
import types

import pytest
from click.testing import CliRunner

from flashgen import bench, bench_host, bench_table
from flashgen.cli import main


def test_default_grid_is_the_issue_grid():
    grid = bench.default_grid()
    assert len(grid) == 2 * 3 * 2 * 6  # dtypes x head dims (64, 128, 256) x causal x seqlens
    for p in grid:
        assert p.batch * p.seqlen == 16384 and p.heads * p.head_dim == 2048


def test_flops_follow_flashattention_convention():
    p = bench.Point("f16", 128, False, 2, 16, 4096)
    fwd = 4 * 2 * 16 * 4096 * 4096 * 128
    assert bench.flops(p, "fwd") == fwd and bench.flops(p, "bwd") == 2.5 * fwd
    causal = bench.Point("f16", 128, True, 2, 16, 4096)
    assert bench.flops(causal, "fwd") == fwd / 2


def test_bench_without_torch_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    result = CliRunner().invoke(main, ["bench"])
    assert result.exit_code == 1 and "needs torch" in result.output


def test_tune_without_cupy_says_what_it_needs(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy -> ImportError
    result = CliRunner().invoke(main, ["tune", "--seqlen", "512"])
    assert result.exit_code == 1 and "needs CuPy and a CUDA GPU" in result.output


# flashgen-torch: the PyTorch adapter timed as a training step calls it.  bench_point runs here on
# CPU tensors with torch.cuda's timing surface faked, and with fakes for the adapter, so what is
# checked is the bookkeeping (which tensors reach the adapter, what is timed, how failures are
# recorded), not the kernels.

class _FakeEvent:
    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def synchronize(self):
        pass

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


def _host_torch(torch):
    """torch with torch.cuda's timing calls on the host clock: enough for bench_point's loops."""
    cuda = types.SimpleNamespace(Event=_FakeEvent, synchronize=lambda: None, empty_cache=lambda: None)
    return types.SimpleNamespace(nn=torch.nn, autograd=torch.autograd, cuda=cuda)


@pytest.fixture
def host_bench(monkeypatch):
    """bench_point without a GPU: CPU inputs (kept for the assertions), no CuPy."""
    torch = pytest.importorskip("torch")
    made = []

    def cpu_inputs(_torch, p, sets=3):
        made[:] = [[torch.randn(shape) for shape in bench.shapes(p)] for _ in range(sets)]
        return made

    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=lambda: pool))
    monkeypatch.setattr(bench, "_inputs", cpu_inputs)
    return types.SimpleNamespace(torch=_host_torch(torch), inputs=made)


def _adapter(monkeypatch, attention):
    monkeypatch.setitem(sys.modules, "flashgen.torch", types.SimpleNamespace(attention=attention))


POINT = bench.Point("f16", 8, True, 2, 3, 16)


def test_flashgen_torch_times_the_adapter_like_a_training_step(host_bench, monkeypatch):
    calls = []

    def attention(q, k, v, attn_bias=None, *, causal=None, **_):
        calls.append((q, k, v, causal))
        return q * k + v

    _adapter(monkeypatch, attention)
    results = bench.bench_point(POINT, ["flashgen-torch"], host_bench.torch, repeats=10)
    assert [(r.impl, r.direction) for r in results] == [("flashgen-torch", "fwd"), ("flashgen-torch", "bwd")]
    assert all(r.ms and r.tflops and not r.note and r.compile_s is None for r in results)  # AOT: nothing compiles
    # the forward: 3 warm-up + 10 timed calls; the backward's graphs: one forward per input set, in warm-up
    assert len(calls) == 3 + 10 + 3
    buffers = {t.data_ptr() for s in host_bench.inputs for t in s[:3]}
    for q, k, v, causal in calls:
        assert causal == "top_left"
        for t in (q, k, v):
            assert t.shape == (2, 16, 3, 8) and t.requires_grad and t.is_leaf and t.data_ptr() in buffers


def test_flashgen_torch_records_an_adapter_that_fails(host_bench, monkeypatch):
    def attention(*args, **kwargs):
        raise RuntimeError("no kernel for this point")

    _adapter(monkeypatch, attention)
    results = bench.bench_point(POINT, ["flashgen-torch"], host_bench.torch, repeats=10)
    assert [(r.direction, r.ms, r.note) for r in results] == [
        ("fwd", None, "RuntimeError: no kernel for this point"), ("bwd", None, "RuntimeError: no kernel for this point")]


def test_flashgen_torch_records_an_adapter_that_cannot_be_imported(host_bench, monkeypatch):
    monkeypatch.setitem(sys.modules, "flashgen.torch", None)  # import -> ImportError
    results = bench.bench_point(POINT, ["flashgen-torch"], host_bench.torch, repeats=10)
    assert [r.direction for r in results] == ["fwd", "bwd"]
    assert all(r.ms is None and r.note == "ModuleNotFoundError: import of flashgen.torch halted; None in sys.modules"
               for r in results)


def test_time_interleaved_does_not_run_an_entry_that_arrives_failed():
    ran = []
    entries = [bench.Timed("a", "fwd", None, error="ImportError: x"), bench.Timed("b", "fwd", ran.append)]
    bench.time_interleaved(entries, types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=_FakeEvent, synchronize=lambda: None)), repeats=10)
    assert entries[0].error == "ImportError: x" and not entries[0].times
    assert len(ran) == 3 + 10 and len(entries[1].times) == 10


def test_time_interleaved_keeps_the_first_call_out_of_the_timings():
    """A first call that compiles (here: sleeps 50 ms) is timed on its own, and is in no round."""
    calls = []

    def fn(i):
        calls.append(i)
        if len(calls) == 1:
            time.sleep(0.05)

    entry = bench.Timed("fa4", "fwd", fn)
    bench.time_interleaved([entry], types.SimpleNamespace(cuda=types.SimpleNamespace(
        Event=_FakeEvent, synchronize=lambda: None)), repeats=10)
    assert entry.first_call_s >= 0.05 and len(calls) == 3 + 10
    assert len(entry.times) == 10 and max(entry.times) < 25  # ms


def test_time_interleaved_queued_waits_once_per_round_and_opens_each_round_untimed():
    """Queued timing: one host wait per round (not per call), one untimed call ahead of each
    round's timed ones, and as many timings as the per-call mode takes."""
    waits, calls = [], []

    class Event(_FakeEvent):
        def synchronize(self):
            waits.append(len(calls))

    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(Event=Event, synchronize=lambda: None))
    entry = bench.Timed("b", "fwd", calls.append)
    bench.time_interleaved([entry], fake, rounds=5, repeats=20, queued=True)
    timed_rounds = [calls[3 + r * 5:3 + (r + 1) * 5] for r in range(5)]  # after 3 warm-up calls: 1 + 4 per round
    assert len(calls) == 3 + 5 * 5 and len(entry.times) == 20 and len(entry.round_medians) == 5
    assert waits == [3 + 5 * (r + 1) for r in range(5)]  # the host waits after a round's last call only
    assert [c[1:] for c in timed_rounds] == [[4 * r + i for i in range(4)] for r in range(5)]  # input sets in order

    per_call_waits = len(waits)
    waits.clear()
    bench.time_interleaved([bench.Timed("b", "fwd", calls.append)], fake, rounds=5, repeats=20)
    assert len(waits) == 20 > per_call_waits  # the per-call mode waits after every timed call


# fa4: FlashAttention-4 through a fake flash_attn.cute.interface (the real one needs a GPU).

def _fa4(monkeypatch, module):
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", types.ModuleType("flash_attn.cute"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute.interface", module)


def test_fa4_times_flash_attn_func_on_bench_layout_with_its_compile_apart(host_bench, monkeypatch):
    torch = pytest.importorskip("torch")
    calls, backwards = [], []

    class Attention(torch.autograd.Function):
        """q * k + v, whose first forward and first backward 'compile' (sleep 50 ms)."""

        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k)
            if len(calls) == 1:
                time.sleep(0.05)
            return q * k + v

        @staticmethod
        def backward(ctx, grad):
            q, k = ctx.saved_tensors
            backwards.append(grad)
            if len(backwards) == 1:
                time.sleep(0.05)
            return grad * k, grad * q, grad

    def flash_attn_func(q, k, v, qv=None, gather_kv_indices=None, softmax_scale=None, causal=False, **_):
        calls.append((q, k, v, causal))
        return Attention.apply(q, k, v), None  # FA4 returns (out, lse); lse None unless return_lse

    _fa4(monkeypatch, types.SimpleNamespace(flash_attn_func=flash_attn_func))
    results = bench.bench_point(POINT, ["fa4"], host_bench.torch, repeats=10)
    assert [(r.impl, r.direction, r.note) for r in results] == [("fa4", "fwd", ""), ("fa4", "bwd", "")]
    for r in results:  # the compile is reported on its own and is in no timing
        assert r.compile_s >= 0.05 and r.ms < 25 and r.tflops
    assert len(calls) == 3 + 10 + 3 and len(backwards) == 3 + 10
    buffers = {t.data_ptr() for s in host_bench.inputs for t in s[:3]}
    for q, k, v, causal in calls:  # bench's own [B, S, H, D] buffers, no transposes, as grad leaves
        assert causal is True
        for t in (q, k, v):
            assert t.shape == (2, 16, 3, 8) and t.requires_grad and t.is_leaf and t.data_ptr() in buffers


class _NotInstalled:
    """A meta path finder that makes these top-level packages missing, as on a machine without them."""

    def __init__(self, *names):
        self.names = names

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None


def test_fa4_records_a_package_that_is_not_installed(host_bench, monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "flash_attn"]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_NotInstalled("flash_attn"), *sys.meta_path])
    results = bench.bench_point(POINT, ["fa4"], host_bench.torch, repeats=10)
    assert [(r.impl, r.direction) for r in results] == [("fa4", "fwd"), ("fa4", "bwd")]
    assert all(r.ms is None and r.compile_s is None and r.note == "ModuleNotFoundError: No module named 'flash_attn'"
               for r in results)


def test_fa4_records_a_package_that_fails_to_load(host_bench, monkeypatch):
    """Not only ImportError: the CUTLASS DSL raises RuntimeError where no CUDA flavour of it fits."""
    class Broken(types.ModuleType):
        def __getattr__(self, name):
            raise RuntimeError("No CTK flavor installed")

    _fa4(monkeypatch, Broken("flash_attn.cute.interface"))
    results = bench.bench_point(POINT, ["fa4"], host_bench.torch, repeats=10)
    assert [(r.direction, r.ms, r.note) for r in results] == [
        ("fwd", None, "RuntimeError: No CTK flavor installed"), ("bwd", None, "RuntimeError: No CTK flavor installed")]


def test_adapter_overhead_cases_pair_forward_and_autograd_backward(monkeypatch):
    torch = pytest.importorskip("torch")
    forwards = []

    def attention(q, k, v, **_):
        forwards.append(q)
        return q * k * v

    _adapter(monkeypatch, attention)
    q = torch.randn(1, 128, 1, 64)
    cases = bench_host.adapter_overhead_cases(q, torch)
    assert list(cases) == ["flashgen.torch forward", "flashgen.torch backward (autograd.grad)",
                           "no-op torch op forward", "no-op torch op backward (autograd.grad)"]
    for _ in range(2):  # the backward is repeatable: one retained graph
        (grad,) = cases["flashgen.torch backward (autograd.grad)"]()
        assert grad.shape == q.shape
    cases["flashgen.torch forward"]()
    # two calls before the cases (the backward's graph is the second's: a replay), one by the case
    assert len(forwards) == 3 and all(t.requires_grad and t.data_ptr() == q.data_ptr() for t in forwards)
    # the no-op op is a real autograd op of the adapter's shape: q feeds q, k and v, so dq = 3 * dO
    out = cases["no-op torch op forward"]()
    (grad,) = cases["no-op torch op backward (autograd.grad)"]()
    assert out.requires_grad and torch.equal(grad, torch.full_like(q, 3.0)) and len(forwards) == 3


def test_adapter_overhead_cases_leave_out_an_adapter_that_cannot_run(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setitem(sys.modules, "flashgen.torch", None)
    with pytest.warns(UserWarning, match="flashgen.torch call overhead not measured: ModuleNotFoundError"):
        assert bench_host.adapter_overhead_cases(torch.zeros(1, 128, 1, 64), torch) == {}


def _bench_cli(monkeypatch, tflops, *args, compile_s=None, notes=None, overhead=None, points=None):
    """`flashgen bench` on one point, with a fake GPU torch and these TFLOP/s per implementation
    (and compile seconds per implementation and direction, and notes per implementation); the
    points timed are appended to ``points`` if given."""
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True,
                                                                  get_device_name=lambda: "Fake GPU"))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    seen, timings = [], []

    def bench_point(p, impls, torch, repeats, all_instances, queued):
        seen.append(impls)
        if points is not None:
            points.append(p)
        timings.append(queued)
        return [bench.Result(i, d, p, 1.0, tflops.get(i), (notes or {}).get(i, ""), spread=0.01,
                             compile_s=(compile_s or {}).get((i, d))) for i in impls for d in ("fwd", "bwd")]

    monkeypatch.setattr(bench, "bench_point", bench_point)
    monkeypatch.setattr(bench_host, "call_overhead_us", lambda torch: overhead or {"flashgen.torch forward": 12.5})
    monkeypatch.setattr(bench_host, "import_times_ms", lambda: {})
    result = CliRunner().invoke(main, ["bench", "--dtype", "f16", "--head-dim", "64", "--seqlen", "512", *args],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert len(set(timings)) == 1 and timings[0] == ("queued" in args)  # --timing reaches every point
    return seen[0], result.output


def _table(output):
    lines = output.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("dtype"))
    return [line.split() for line in lines[start:start + 4]]  # header, rule, fwd, bwd


def test_bench_defaults_to_the_adapter_and_fa4_with_ratio_and_compile_time(monkeypatch):
    tflops = {"flashgen": 400, "flashgen-torch": 300, "fa4": 450, "sdpa-efficient": 200, "sdpa-flash": 350,
              "sdpa-cudnn": 500}
    impls, output = _bench_cli(monkeypatch, tflops, compile_s={("fa4", "fwd"): 12.34, ("fa4", "bwd"): 30.0})
    assert impls == ["flashgen", "flashgen-torch", "fa4", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn"]
    header, _, fwd, bwd = _table(output)
    assert header == ["dtype", "hdim", "H/Hk", "causal", "seqlen", "dir", *impls, "fg/efficient", "noise",
                      "fg-torch/fg", "fa4", "compile", "s"]
    assert fwd == ["f16", "64", "32/32", "no", "512", "fwd", "400", "300", "450", "350", "200", "500", "2.00", "1%",
                   "0.75", "12.3"]
    assert bwd[-4:] == ["2.00", "1%", "0.75", "30.0"]
    assert "fa4/fwd 450 (first call 12.3 s)" in output
    assert "call overhead, flashgen.torch forward: 12.5 us" in output


def test_bench_says_why_fa4_has_no_column(monkeypatch):
    note = "ModuleNotFoundError: No module named 'flash_attn'"
    _, output = _bench_cli(monkeypatch, {"flashgen": 400}, "--impl", "flashgen", "--impl", "fa4",
                           notes={"fa4": note})
    header, _, fwd, bwd = _table(output)
    assert header[-3:] == ["fa4", "compile", "s"] and fwd[-3:] == ["400", "-", "-"] and bwd[-3:] == ["400", "-", "-"]
    assert f"no timing, fa4: {note} (4 of 4)" in output.splitlines()  # 2 points (causal or not) x fwd, bwd


def test_bench_ratio_of_the_adapter_needs_both_flashgen_impls(monkeypatch):
    _, output = _bench_cli(monkeypatch, {"flashgen-torch": 300, "sdpa-efficient": 200},
                           "--impl", "flashgen-torch", "--impl", "sdpa-efficient")
    header, _, fwd, _ = _table(output)
    assert header == ["dtype", "hdim", "H/Hk", "causal", "seqlen", "dir", "flashgen-torch", "sdpa-efficient"]
    assert fwd[-2:] == ["300", "200"]


def test_bench_ratio_of_the_adapter_is_blank_where_it_failed(monkeypatch):
    _, output = _bench_cli(monkeypatch, {"flashgen": 400}, "--impl", "flashgen", "--impl", "flashgen-torch")
    header, _, fwd, _ = _table(output)
    assert header[-1] == "fg-torch/fg" and fwd[-3:] == ["400", "-", "-"]


# Grouped-query points (--group): k and v with heads // group heads, everything else as before.

GQA = bench.Point("f16", 8, False, 2, 8, 16, 4)  # 8 query heads, 2 k/v heads


def test_default_grid_adds_groups_and_skips_those_that_do_not_divide():
    grid = bench.default_grid(("f16",), (64, 128), hidden=2048, tokens=16384, seqlens=(1024,), groups=(1, 4, 32))
    # head dim 64: 32 heads, every group divides; head dim 128: 16 heads, no group of 32
    assert [(p.head_dim, p.causal, p.heads, p.kv_heads, p.group) for p in grid] == [
        (64, False, 32, 32, 1), (64, False, 32, 8, 4), (64, False, 32, 1, 32),
        (64, True, 32, 32, 1), (64, True, 32, 8, 4), (64, True, 32, 1, 32),
        (128, False, 16, 16, 1), (128, False, 16, 4, 4), (128, True, 16, 16, 1), (128, True, 16, 4, 4)]
    assert all(p.batch == 16 and p.seqlen == 1024 for p in grid)
    assert {p.group for p in bench.default_grid()} == {1}  # no --group: the multi-head grid as before


def test_gqa_keeps_the_flop_count_and_shrinks_only_k_and_v():
    mha, gqa = bench.Point("bf16", 128, True, 2, 16, 4096), bench.Point("bf16", 128, True, 2, 16, 4096, 4)
    assert bench.flops(gqa, "fwd") == bench.flops(mha, "fwd") == 4 * 2 * 16 * 4096 * 4096 * 128 / 2
    assert bench.shapes(gqa) == ((2, 4096, 16, 128), (2, 4096, 4, 128), (2, 4096, 4, 128), (2, 4096, 16, 128))
    assert gqa.heads_label == "16/4" and mha.heads_label == "16/16"


def test_point_json_round_trip_with_and_without_group():
    import json
    from dataclasses import asdict

    result = bench.Result("flashgen", "fwd", GQA, 1.5, 300.0)
    written = json.loads(json.dumps(result.as_dict()))
    assert written["point"] == {"dtype": "f16", "head_dim": 8, "causal": False, "batch": 2, "heads": 8,
                                "seqlen": 16, "group": 4, "mask": "", "score_mod": "", "variant": ""}
    assert bench.Point(**written["point"]) == GQA
    old = {k: v for k, v in asdict(POINT).items() if k not in ("group", "mask", "score_mod", "variant")}  # from before --group
    assert bench.Point(**json.loads(json.dumps(old))) == POINT and POINT.group == 1
    assert bench.Point(**old) != bench.Point(**dict(old, group=3))


def test_flashgen_torch_gets_fewer_kv_heads_at_a_gqa_point(host_bench, monkeypatch):
    seen = []

    def attention(q, k, v, attn_bias=None, *, causal=None, **_):
        seen.append((q.shape, k.shape, v.shape))
        group = q.shape[2] // k.shape[2]
        return q * k.repeat_interleave(group, 2) + v.repeat_interleave(group, 2)

    _adapter(monkeypatch, attention)
    results = bench.bench_point(GQA, ["flashgen-torch"], host_bench.torch, repeats=10)
    assert all(r.tflops and not r.note and r.point.group == 4 for r in results)
    assert set(seen) == {((2, 16, 8, 8), (2, 16, 2, 8), (2, 16, 2, 8))}


def _fake_nn(refuse_gqa=()):
    """torch.nn with SDPA backends chosen by sdpa_kernel as on a GPU; those in ``refuse_gqa`` (and
    any, without enable_gqa) answer fewer k/v heads as torch does: "No available kernel"."""
    import contextlib

    calls, backend = [], []

    @contextlib.contextmanager
    def sdpa_kernel(kind):
        backend.append(kind)
        try:
            yield
        finally:
            backend.pop()

    def attend(q, k, v, enable_gqa, refused):
        group = q.shape[1] // k.shape[1]
        if group > 1 and (refused or not enable_gqa):
            raise RuntimeError("No available kernel. Aborting execution.")
        return q * k.repeat_interleave(group, 1) + v.repeat_interleave(group, 1)

    def sdpa(q, k, v, is_causal=False, **kwargs):
        calls.append((backend[-1], tuple(k.shape), kwargs))
        return attend(q, k, v, kwargs.get("enable_gqa", False), backend[-1] in refuse_gqa)

    def flex(q, k, v, block_mask=None, **kwargs):
        calls.append(("flex", tuple(k.shape), kwargs))
        return attend(q, k, v, kwargs.get("enable_gqa", False), False)

    kinds = types.SimpleNamespace(FLASH_ATTENTION="flash", EFFICIENT_ATTENTION="efficient", CUDNN_ATTENTION="cudnn")
    nn = types.SimpleNamespace(functional=types.SimpleNamespace(scaled_dot_product_attention=sdpa),
                               attention=types.SimpleNamespace(SDPBackend=kinds, sdpa_kernel=sdpa_kernel))
    return nn, flex, calls


def test_sdpa_and_flex_pass_enable_gqa_and_a_refusing_backend_is_a_dash_with_why(host_bench, monkeypatch):
    nn, flex, calls = _fake_nn(refuse_gqa=("efficient",))
    monkeypatch.setattr(host_bench.torch, "nn", nn)
    monkeypatch.setattr(bench, "_flex", flex)
    results = bench.bench_point(GQA, ["sdpa-flash", "sdpa-efficient", "flex"], host_bench.torch, repeats=10)
    got = {(r.impl, r.direction): (bool(r.tflops), r.note) for r in results}
    refused = "at GQA 8/2 heads: RuntimeError: No available kernel. Aborting execution."
    assert got == {("sdpa-flash", "fwd"): (True, ""), ("sdpa-flash", "bwd"): (True, ""),
                   ("sdpa-efficient", "fwd"): (False, refused), ("sdpa-efficient", "bwd"): (False, refused),
                   ("flex", "fwd"): (True, ""), ("flex", "bwd"): (True, "")}
    assert {(impl, shape, kwargs["enable_gqa"]) for impl, shape, kwargs in calls} == {
        ("flash", (2, 2, 16, 8), True), ("efficient", (2, 2, 16, 8), True), ("flex", (2, 2, 16, 8), True)}


def test_sdpa_at_a_multi_head_point_gets_no_enable_gqa(host_bench, monkeypatch):
    """torch before 2.5 has no enable_gqa: a multi-head point must not pass it."""
    nn, _, calls = _fake_nn()
    monkeypatch.setattr(host_bench.torch, "nn", nn)
    results = bench.bench_point(POINT, ["sdpa-flash"], host_bench.torch, repeats=10)
    assert all(r.tflops and not r.note for r in results)
    assert {(impl, shape, tuple(kwargs)) for impl, shape, kwargs in calls} == {("flash", (2, 3, 16, 8), ())}


def test_all_instances_are_not_timed_at_a_gqa_point(host_bench, monkeypatch):
    """tune.measure_choices builds multi-head inputs: at a GQA point its numbers would be another shape's."""
    from flashgen import tune

    monkeypatch.setattr(tune, "measure_choices", lambda *a, **k: pytest.fail("timed a GQA point as multi-head"))
    results = bench.bench_point(GQA, [], host_bench.torch, repeats=10, all_instances=True)
    assert [(r.impl, r.direction, r.tflops) for r in results] == [("flashgen[*]", "fwd", None),
                                                                  ("flashgen[*]", "bwd", None)]
    assert results[0].note == "instances not timed at GQA points: flashgen tune measures multi-head shapes only"


class _NoTensor:
    """Stands in for a torch tensor where no implementation is asked for (bench_point only views it)."""

    def transpose(self, *dims):
        return self

    def requires_grad_(self, flag=True):
        return self


def test_all_instances_report_the_best_tile_against_the_default_timed_alike(monkeypatch):
    """The tiles are timed back to back after the rounds (other clocks than the columns): the runtime's
    own choice comes with them as flashgen[default], and the table's cell is the best tile over it."""
    from flashgen import tune
    from flashgen.bench_table import bench_table
    from flashgen.runtime import device as device_module

    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(
        get_default_memory_pool=lambda: pool, cuda=types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))))
    monkeypatch.setattr(bench, "_inputs", lambda torch, p, sets=3: [[_NoTensor() for _ in range(4)] for _ in range(sets)])
    monkeypatch.setattr(device_module, "device_info", lambda index: types.SimpleNamespace(name="Fake GPU", cc=90))
    monkeypatch.setattr("flashgen.runtime.registry.default_registry", lambda: None)
    ms = {"fwd": {"default": 2.0, "128_64_4": 2.0, "128_128_4": 1.6},
          "bwd": {"default": 4.0, "128_128_8": 4.0, "64_128_8": 5.0}}
    monkeypatch.setattr(tune, "measure_choices", lambda p, direction, *a: dict(ms[direction]))
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: None),
                                  nn=types.SimpleNamespace(functional=types.SimpleNamespace(
                                      scaled_dot_product_attention=None)))
    results = bench.bench_point(POINT, [], torch, repeats=10, all_instances=True)
    timed = {(r.impl, r.direction): r.ms for r in results}
    assert timed == {(f"flashgen[{label}]", d): t for d, times in ms.items() for label, t in times.items()}
    table = bench_table([POINT], results, [], all_instances=True)
    assert "best instance / its default" in table
    rows = [line for line in table.splitlines() if " fwd " in line or " bwd " in line]
    assert "128_128_4 1.25x" in rows[0] and "128_128_8 1.00x" in rows[1], table


def test_plot_keeps_a_gqa_point_apart_from_its_multi_head_twin():
    mha, gqa = bench.Point("f16", 64, False, 16, 32, 1024), bench.Point("f16", 64, False, 16, 32, 1024, 4)
    results = [bench.Result("flashgen", "fwd", mha, 1.0, 400.0), bench.Result("flashgen", "fwd", gqa, 1.0, 350.0),
               bench.Result("sdpa-efficient", "fwd", gqa, None, None, "at GQA 32/8 heads: no kernel")]
    assert bench_table.plot_series(results) == {"fwd f16 hdim 64": {"flashgen": [(1024, 400.0)]},
                                          "fwd f16 hdim 64 GQA 32/8": {"flashgen": [(1024, 350.0)]}}


def _table_rows(output):
    """Every row of the bench table (header and rule included), split on whitespace."""
    lines = output.splitlines()
    start = next(n for n, line in enumerate(lines) if line.startswith("dtype"))
    end = next((n for n in range(start, len(lines)) if not lines[n].strip() or lines[n].startswith(
        ("no timing", "call overhead"))), len(lines))
    return [line.split() for line in lines[start:end]]


def test_bench_table_json_and_progress_show_the_group(monkeypatch, tmp_path):
    import json

    path = tmp_path / "run.json"
    _, output = _bench_cli(monkeypatch, {"flashgen": 400}, "--impl", "flashgen", "--group", "1", "--group", "4",
                           "--json", str(path))
    rows = _table_rows(output)
    assert rows[0] == ["dtype", "hdim", "H/Hk", "causal", "seqlen", "dir", "flashgen"]
    assert [row[:6] for row in rows[2:]] == [
        ["f16", "64", heads, causal, "512", d] for causal in ("no", "yes") for heads in ("32/32", "32/8")
        for d in ("fwd", "bwd")]
    assert "f16 d64 B32 H32/8 S512: flashgen/fwd 400" in output  # the progress line
    points = [r["point"] for r in json.loads(path.read_text())["results"]]
    assert [p["group"] for p in points] == [1, 1, 4, 4, 1, 1, 4, 4]
    assert all(p["heads"] == 32 for p in points)
    assert json.loads(path.read_text())["timing"] == "call"


def test_bench_queued_timing_reaches_the_points_and_the_json(monkeypatch, tmp_path):
    import json

    path = tmp_path / "run.json"
    _bench_cli(monkeypatch, {"flashgen": 400}, "--impl", "flashgen", "--timing", "queued", "--json", str(path))
    assert json.loads(path.read_text())["timing"] == "queued"


@pytest.mark.parametrize("group, message", [
    ("0", "0 is not in the range x>=1"),
    ("3", "3 divides none of the head counts: 32 (head dim 64), 16 (head dim 128)"),
])
def test_bench_rejects_a_group_that_cannot_be_run(group, message):
    result = CliRunner().invoke(main, ["bench", "--head-dim", "64", "--head-dim", "128", "--group", "4",
                                       "--group", group])
    assert result.exit_code == 2 and "--group" in result.output
    assert message in " ".join(result.output.split())  # click wraps long messages


def test_bench_accepts_a_group_that_fits_one_head_dim(monkeypatch):
    """--group 32 fits head dim 64's 32 heads: those points run, head dim 128's 16 heads are skipped."""
    _, output = _bench_cli(monkeypatch, {"flashgen": 400}, "--impl", "flashgen", "--head-dim", "128",
                           "--group", "32")
    rows = _table_rows(output)
    assert {(row[1], row[2]) for row in rows[2:]} == {("64", "32/1")}


def test_tune_resumes_a_table_written_before_points_had_a_group(monkeypatch, tmp_path):
    """Point's new field must not make `flashgen tune` re-measure what an older table holds."""
    import json

    from flashgen import tune
    from flashgen.runtime import device as device_module
    from flashgen.runtime import tuning

    fake_cupy = types.ModuleType("cupy")
    fake_cupy.__version__ = "fake"
    fake_cupy.cuda = types.SimpleNamespace(runtime=types.SimpleNamespace(getDevice=lambda: 0))
    monkeypatch.setitem(sys.modules, "cupy", fake_cupy)
    monkeypatch.setattr(device_module, "device_info", lambda index: types.SimpleNamespace(name="Fake GPU", cc=90))
    monkeypatch.setattr("flashgen.runtime.registry.default_registry", lambda: None)
    monkeypatch.setattr(tune, "family_for", lambda direction, registry, device: f"mem_eff_{direction}")
    tile = tuning.Choice((("queries_per_block", 64), ("keys_per_block", 64), ("max_k", 64)))
    monkeypatch.setattr(tune, "candidates", lambda registry, device, p, direction: [("prio", tile)])
    measured = []
    monkeypatch.setattr(tune, "measure_choices", lambda p, direction, *a: measured.append(p) or
                        {"default": 1.0, "prio": 1.0})
    out = tmp_path / "table.json"
    points = bench.default_grid(("f16",), (64,), seqlens=(512,))
    tune.tune(points, 3, lambda line: None, "flashgen tune", out)
    assert len(measured) == 2 * len(points)
    data = json.loads(out.read_text())
    assert all(m["point"].pop("group") == 1 for m in data["measured"]["points"])  # as an older flashgen wrote it
    out.write_text(json.dumps(data))
    tune.tune(points, 3, lambda line: None, "flashgen tune", out)
    assert len(measured) == 2 * len(points)  # nothing measured again


def test_adapter_cost_ratios_subtract_the_no_op_op_and_divide_by_the_cupy_call():
    overhead = {"flashgen.attention_forward": 20.0, "flashgen.attention_backward": 30.0,
                "flashgen.torch forward": 34.0, "no-op torch op forward": 9.0,
                "flashgen.torch backward (autograd.grad)": 100.0, "no-op torch op backward (autograd.grad)": 64.0}
    assert bench_host.adapter_cost_ratios(overhead) == {"forward": 1.25, "backward": 1.2}
    del overhead["no-op torch op backward (autograd.grad)"]
    assert bench_host.adapter_cost_ratios(overhead) == {"forward": 1.25}


def test_bench_prints_the_adapters_own_cost_ratio(monkeypatch):
    overhead = {"flashgen.attention_forward": 20.0, "flashgen.torch forward": 35.0, "no-op torch op forward": 9.0}
    _, output = _bench_cli(monkeypatch, {"flashgen": 400}, overhead=overhead)
    assert "flashgen.torch's own host cost over the CuPy path's, forward: 1.30x" in output
    assert "backward:" not in output
