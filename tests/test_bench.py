"""The benchmark's bookkeeping (the timings themselves need a GPU: see BENCHMARKS.md)."""
from __future__ import annotations

import sys
import time
import types

import pytest
from click.testing import CliRunner

from bench_fakes import POINT, FakeEvent, adapter, bench_cli, table
from flashgen import bench, bench_host
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


# flashgen-torch, timed as a training step calls it, on CPU tensors with the fakes of bench_fakes.py:
# what is checked is the bookkeeping, not the kernels.

def test_flashgen_torch_times_the_adapter_like_a_training_step(host_bench, monkeypatch):
    calls = []

    def attention(q, k, v, attn_bias=None, *, causal=None, **_):
        calls.append((q, k, v, causal))
        return q * k + v

    adapter(monkeypatch, attention)
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

    adapter(monkeypatch, attention)
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
        Event=FakeEvent, synchronize=lambda: None)), repeats=10)
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
        Event=FakeEvent, synchronize=lambda: None)), repeats=10)
    assert entry.first_call_s >= 0.05 and len(calls) == 3 + 10
    assert len(entry.times) == 10 and max(entry.times) < 25  # ms


def test_time_interleaved_queued_waits_once_per_round_and_opens_each_round_untimed():
    """Queued timing: one host wait per round (not per call), one untimed call ahead of each
    round's timed ones, and as many timings as the per-call mode takes."""
    waits, calls = [], []

    class Event(FakeEvent):
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

    adapter(monkeypatch, attention)
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



def test_bench_defaults_to_the_adapter_and_fa4_with_ratio_and_compile_time(monkeypatch):
    tflops = {"flashgen": 400, "flashgen-torch": 300, "fa4": 450, "sdpa-efficient": 200, "sdpa-flash": 350,
              "sdpa-cudnn": 500}
    impls, output = bench_cli(monkeypatch, tflops, compile_s={("fa4", "fwd"): 12.34, ("fa4", "bwd"): 30.0})
    assert impls == ["flashgen", "flashgen-torch", "fa4", "sdpa-flash", "sdpa-efficient", "sdpa-cudnn"]
    header, _, fwd, bwd = table(output)
    assert header == ["dtype", "hdim", "H/Hk", "causal", "seqlen", "dir", *impls, "fg/efficient", "noise",
                      "fg-torch/fg", "fa4", "compile", "s"]
    assert fwd == ["f16", "64", "32/32", "no", "512", "fwd", "400", "300", "450", "350", "200", "500", "2.00", "1%",
                   "0.75", "12.3"]
    assert bwd[-4:] == ["2.00", "1%", "0.75", "30.0"]
    assert "fa4/fwd 450 (first call 12.3 s)" in output
    assert "call overhead, flashgen.torch forward: 12.5 us" in output


def test_bench_says_why_fa4_has_no_column(monkeypatch):
    note = "ModuleNotFoundError: No module named 'flash_attn'"
    _, output = bench_cli(monkeypatch, {"flashgen": 400}, "--impl", "flashgen", "--impl", "fa4",
                           notes={"fa4": note})
    header, _, fwd, bwd = table(output)
    assert header[-3:] == ["fa4", "compile", "s"] and fwd[-3:] == ["400", "-", "-"] and bwd[-3:] == ["400", "-", "-"]
    assert f"no timing, fa4: {note} (4 of 4)" in output.splitlines()  # 2 points (causal or not) x fwd, bwd


def test_bench_ratio_of_the_adapter_needs_both_flashgen_impls(monkeypatch):
    _, output = bench_cli(monkeypatch, {"flashgen-torch": 300, "sdpa-efficient": 200},
                           "--impl", "flashgen-torch", "--impl", "sdpa-efficient")
    header, _, fwd, _ = table(output)
    assert header == ["dtype", "hdim", "H/Hk", "causal", "seqlen", "dir", "flashgen-torch", "sdpa-efficient"]
    assert fwd[-2:] == ["300", "200"]


def test_bench_ratio_of_the_adapter_is_blank_where_it_failed(monkeypatch):
    _, output = bench_cli(monkeypatch, {"flashgen": 400}, "--impl", "flashgen", "--impl", "flashgen-torch")
    header, _, fwd, _ = table(output)
    assert header[-1] == "fg-torch/fg" and fwd[-3:] == ["400", "-", "-"]



def test_adapter_cost_ratios_subtract_the_no_op_op_and_divide_by_the_cupy_call():
    overhead = {"flashgen.attention_forward": 20.0, "flashgen.attention_backward": 30.0,
                "flashgen.torch forward": 34.0, "no-op torch op forward": 9.0,
                "flashgen.torch backward (autograd.grad)": 100.0, "no-op torch op backward (autograd.grad)": 64.0}
    assert bench_host.adapter_cost_ratios(overhead) == {"forward": 1.25, "backward": 1.2}
    del overhead["no-op torch op backward (autograd.grad)"]
    assert bench_host.adapter_cost_ratios(overhead) == {"forward": 1.25}


def test_bench_prints_the_adapters_own_cost_ratio(monkeypatch):
    overhead = {"flashgen.attention_forward": 20.0, "flashgen.torch forward": 35.0, "no-op torch op forward": 9.0}
    _, output = bench_cli(monkeypatch, {"flashgen": 400}, overhead=overhead)
    assert "flashgen.torch's own host cost over the CuPy path's, forward: 1.30x" in output
    assert "backward:" not in output
