"""``flashgen bench --variant``: bias and dropout points, flashgen's two twins, and what each peer gets
(no GPU: bench_point on CPU tensors, with fakes for CuPy, flashgen's runtime calls and SDPA)."""
from __future__ import annotations

import contextlib
import os
import sys
import types

import pytest
from click.testing import CliRunner

from flashgen import bench, bench_table, bench_variants
from flashgen.cli import main


def test_the_cli_offers_every_bench_variant():
    option = next(o for o in main.commands["bench"].params if o.name == "variants")
    assert tuple(option.type.choices) == bench_variants.VARIANTS
    with pytest.raises(ValueError, match="unknown bench variant 'alibi'.*bias, dropout"):
        bench_variants.flashgen_options(bench.Point("f16", 64, False, 1, 1, 8, variant="alibi"))


def test_variants_replace_the_plain_points_and_old_points_load():
    grid = bench.default_grid(("f16",), (64,), seqlens=(1024,), variants=("bias", "dropout"))
    assert [(p.variant, p.causal) for p in grid] == [("bias", False), ("bias", True), ("dropout", False),
                                                     ("dropout", True)]
    old = {"dtype": "f16", "head_dim": 64, "causal": True, "batch": 2, "heads": 8, "seqlen": 512, "group": 1,
           "mask": "", "score_mod": ""}
    assert bench.Point(**old).variant == ""
    # neither costs FLOPs in FlashAttention's count
    assert bench.flops(grid[1], "bwd") == bench.flops(bench.Point("f16", 64, True, 16, 32, 1024), "bwd")


class _Runtime:
    """flashgen.runtime.api's two calls, recording each call's options and FLASHGEN_FAMILIES; calls
    under ``refuse`` (a FLASHGEN_FAMILIES value) raise as the runtime does when no kernel serves."""

    def __init__(self, torch, refuse=None):
        self.torch, self.refuse, self.calls = torch, refuse, []

    def _record(self, direction, options):
        families = os.environ.get("FLASHGEN_FAMILIES")
        if families is not None and families == self.refuse:
            raise RuntimeError("no kernel of mem_eff_fwd serves this call")
        self.calls.append((direction, families, options))

    def attention_forward(self, q, k, v, **options):
        self._record("fwd", options)
        return q * k + v, self.torch.zeros(q.shape[:3])

    def attention_backward(self, grad_out, q, k, v, out, lse, **options):
        self._record("bwd", options)
        return q, k, v


def _fake_nn(calls):
    """torch.nn whose SDPA records each call's keyword arguments and backend, its output depending
    on the mask (so a backward reaches it)."""
    from bench_fakes import sdpa_nn

    backend = []

    def sdpa(q, k, v, attn_mask=None, **kwargs):
        calls.append((backend[-1], attn_mask, kwargs))
        return q * k + v + (0 if attn_mask is None else attn_mask.float().nan_to_num(0, 0, 0).mean())

    return sdpa_nn(sdpa, backend)


@pytest.fixture
def variant_bench(monkeypatch):
    """bench_point at bias/dropout points on the CPU: the fake runtime, SDPA, flex and adapter, and
    autograd.grad counting the tensors each backward differentiates."""
    torch = pytest.importorskip("torch")
    from bench_fakes import adapter, host_torch

    monkeypatch.setattr(bench, "_inputs", lambda _t, p, sets=3: [[torch.randn(s) for s in bench.shapes(p)]
                                                                  for _ in range(sets)])
    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    cupy = types.SimpleNamespace(get_default_memory_pool=lambda: pool, from_dlpack=lambda t: t,
                                 cuda=types.SimpleNamespace(ExternalStream=lambda handle: contextlib.nullcontext()))
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    runtime = _Runtime(torch)
    from flashgen.runtime import api

    monkeypatch.setattr(api, "attention_forward", runtime.attention_forward)
    monkeypatch.setattr(api, "attention_backward", runtime.attention_backward)
    host = host_torch(torch)
    host.cuda.current_stream = lambda: types.SimpleNamespace(cuda_stream=0)
    host.randn, host.ones, host.bool = torch.randn, torch.ones, torch.bool
    sdpa_calls, flex_calls, adapter_calls, differentiated = [], [], [], []
    host.nn = _fake_nn(sdpa_calls)

    def grad(outputs, inputs, grad_outputs, retain_graph):
        differentiated.append(len(inputs))
        return torch.autograd.grad(outputs, inputs, grad_outputs, retain_graph=retain_graph)

    host.autograd = types.SimpleNamespace(grad=grad)

    def flex(q, k, v, block_mask=None, score_mod=None, **kwargs):
        flex_calls.append((block_mask, score_mod))
        score = q * k
        if score_mod is not None:  # the mod over a [1, H, S, S]-indexed score: enough to reach its bias
            h, s = torch.arange(q.shape[1])[:, None], torch.arange(q.shape[2])
            score = score + score_mod(torch.zeros(q.shape[1], q.shape[2]), 0, h, s, s)[None, :, :, None]
        return score + v

    monkeypatch.setattr(bench, "_flex", flex)
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention",
                        types.SimpleNamespace(create_block_mask=lambda *a, **k: "causal-mask", flex_attention=None))

    def attention(q, k, v, attn_bias=None, **options):
        adapter_calls.append((attn_bias, options))
        return q * k + v + (0 if attn_bias is None else attn_bias.float().mean())

    adapter(monkeypatch, attention)
    return types.SimpleNamespace(torch=torch, host=host, runtime=runtime, sdpa=sdpa_calls, flex=flex_calls,
                                 adapter=adapter_calls, differentiated=differentiated)


IMPLS = ["flashgen", "flashgen-torch", "fa4", "sdpa-flash", "sdpa-efficient", "flex"]


def test_a_bias_point_gives_every_side_the_bias_and_takes_its_gradient(variant_bench):
    """flashgen: the bias in both directions and bias_requires_grad in the backward, its plain twin
    neither, its example-41 twin both under FLASHGEN_FAMILIES (restored after); the adapter, SDPA and
    flex a bias that their backward differentiates too; SDPA at a causal point the bias with -inf
    above the diagonal and no causal flag; FA4 and SDPA's flash backend a reason."""
    vb, torch = variant_bench, variant_bench.torch
    point = bench.Point("f16", 8, True, 2, 3, 16, variant="bias")
    saved = os.environ.pop("FLASHGEN_FAMILIES", None)
    try:
        results = bench.bench_point(point, IMPLS, vb.host, repeats=10)
        assert "FLASHGEN_FAMILIES" not in os.environ
    finally:
        if saved is not None:
            os.environ["FLASHGEN_FAMILIES"] = saved
    got = {(r.impl, r.direction): r.note or bool(r.tflops) for r in results}
    timed = ("flashgen", "flashgen-plain", "flashgen-example41", "flashgen-torch", "sdpa-efficient", "flex")
    assert got == {**{(i, d): True for i in timed for d in ("fwd", "bwd")},
                   **{(i, d): "takes no bias" for i in ("fa4", "sdpa-flash") for d in ("fwd", "bwd")}}
    biases = {id(o.get("attn_bias")) for _, _, o in vb.runtime.calls if "attn_bias" in o}
    assert len(biases) == 1
    bias = next(o["attn_bias"] for _, _, o in vb.runtime.calls if "attn_bias" in o)
    assert tuple(bias.shape) == (1, 3, 16, 16)
    by_families = {}
    for direction, families, options in vb.runtime.calls:
        by_families.setdefault((families, "attn_bias" in options), set()).add(
            (direction, options.get("causal"), options.get("bias_requires_grad", False)))
    assert by_families == {
        (None, True): {("fwd", "top_left", False), ("bwd", "top_left", True)},   # flashgen
        (None, False): {("fwd", "top_left", False), ("bwd", "top_left", False)},  # flashgen-plain
        (bench_variants.EXAMPLE41, True): {("fwd", "top_left", False), ("bwd", "top_left", True)}}
    masks = [(backend, mask, kwargs) for backend, mask, kwargs in vb.sdpa]
    assert masks and all(backend == "efficient" and "is_causal" not in kwargs for backend, _, kwargs in masks)
    mask = masks[0][1]
    above = torch.ones(16, 16, dtype=torch.bool).triu(1)
    assert mask.requires_grad and torch.isinf(mask[0][:, above]).all()
    assert torch.equal(mask[0][:, ~above], bias[0][:, ~above].to(mask.dtype))
    assert all(a is not None and a.requires_grad and o == {"causal": "top_left"} for a, o in vb.adapter)
    assert vb.flex and all(m == "causal-mask" and mod is not None for m, mod in vb.flex)
    # every torch backward (the adapter's, SDPA's, flex's) differentiates q, k, v and the bias
    assert vb.differentiated and set(vb.differentiated) == {4}


def test_a_dropout_point_gives_flashgen_one_seed_and_the_peers_dropout_p(variant_bench):
    vb = variant_bench
    point = bench.Point("f16", 8, False, 2, 3, 16, variant="dropout")
    results = bench.bench_point(point, IMPLS + ["sdpa-cudnn"], vb.host, repeats=10)
    got = {(r.impl, r.direction): r.note or bool(r.tflops) for r in results}
    timed = ("flashgen", "flashgen-plain", "flashgen-example41", "flashgen-torch", "sdpa-flash", "sdpa-efficient",
             "sdpa-cudnn")
    assert got == {**{(i, d): True for i in timed for d in ("fwd", "bwd")},
                   **{(i, d): "takes no dropout" for i in ("fa4", "flex") for d in ("fwd", "bwd")}}
    dropout = {"dropout_p": bench_variants.DROPOUT_P, "seed": bench_variants.SEED}
    assert {(d, f, tuple(sorted(o.items()))) for d, f, o in vb.runtime.calls} == {
        (d, f, tuple(sorted(o.items()))) for d in ("fwd", "bwd") for f, o in ((None, dropout), (None, {}),
                                                                             (bench_variants.EXAMPLE41, dropout))}
    assert vb.adapter and all(a is None and o == {"dropout_p": bench_variants.DROPOUT_P} for a, o in vb.adapter)
    assert {backend for backend, _, _ in vb.sdpa} == {"flash", "efficient", "cudnn"}
    assert all(mask is None and kwargs == {"dropout_p": bench_variants.DROPOUT_P, "is_causal": False}
               for _, mask, kwargs in vb.sdpa)
    assert set(vb.differentiated) == {3}


def test_example41_without_its_kernels_is_a_note_and_the_rest_still_run(variant_bench):
    vb = variant_bench
    vb.runtime.refuse = bench_variants.EXAMPLE41
    results = bench.bench_point(bench.Point("f16", 8, False, 2, 3, 16, variant="bias"), ["flashgen"], vb.host,
                                repeats=10)
    got = {(r.impl, r.direction): r.note or bool(r.tflops) for r in results}
    note = "RuntimeError: no kernel of mem_eff_fwd serves this call"
    assert got == {("flashgen", "fwd"): True, ("flashgen", "bwd"): True, ("flashgen-plain", "fwd"): True,
                   ("flashgen-plain", "bwd"): True, ("flashgen-example41", "fwd"): note,
                   ("flashgen-example41", "bwd"): note}


def test_only_families_sets_and_restores_the_environment(monkeypatch):
    monkeypatch.setenv("FLASHGEN_FAMILIES", "sm90_fwd,sm90_bwd")
    with bench.only_families("mem_eff_fwd,mem_eff_bwd"):
        assert os.environ["FLASHGEN_FAMILIES"] == "mem_eff_fwd,mem_eff_bwd"
    assert os.environ["FLASHGEN_FAMILIES"] == "sm90_fwd,sm90_bwd"
    monkeypatch.delenv("FLASHGEN_FAMILIES")
    with pytest.raises(KeyError), bench.only_families("mem_eff_fwd"):
        raise KeyError("an entry that fails")
    assert "FLASHGEN_FAMILIES" not in os.environ
    with bench.only_families(None):
        assert "FLASHGEN_FAMILIES" not in os.environ


def test_the_table_reads_flashgen_against_its_twins():
    point = bench.Point("bf16", 64, True, 4, 32, 4096, variant="bias")
    tflops = {"flashgen": 300.0, "flashgen-plain": 400.0, "flashgen-example41": 100.0, "sdpa-efficient": 150.0}
    results = [bench.Result(i, d, point, 1.0, t) for i, t in tflops.items() for d in ("fwd", "bwd")]
    lines = bench_table.bench_table([point], results, ["flashgen", "sdpa-efficient"], False).splitlines()
    header, fwd = lines[0].split(), lines[2].split()
    assert header == ["dtype", "hdim", "H/Hk", "causal", "seqlen", "dir", "flashgen", "sdpa-efficient",
                      "flashgen-plain", "flashgen-example41", "fg/efficient", "noise", "fg/plain", "fg/ex41"]
    assert fwd == ["bf16", "64", "32/32", "yes+bias", "4096", "fwd", "300", "150", "400", "100", "2.00", "-", "0.75",
                   "3.00"]


def test_the_cli_takes_variants_and_refuses_them_with_masks_or_mods(monkeypatch):
    from bench_fakes import bench_cli

    points = []
    _, output = bench_cli(monkeypatch, {"flashgen": 100.0}, "--variant", "dropout", "--impl", "flashgen",
                           points=points)
    assert [(p.variant, p.causal) for p in points] == [("dropout", False), ("dropout", True)]
    assert "dropout B32 H32/32 S512" in output
    for other in (["--mask", "document8"], ["--score-mod", "alibi"]):
        both = CliRunner().invoke(main, ["bench", "--variant", "bias", *other])
        assert both.exit_code != 0 and "a bias or dropout with a block mask or score mod is not benched" in both.output
