"""``flashgen bench --score-mod``: score-mod points, and who gets which mod (no GPU: bench_point on
CPU tensors through test_bench's fakes)."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from click.testing import CliRunner

from flashgen import bench, bench_mods
from flashgen.cli import main
from flashgen.mods import BUILTIN_MODS


def test_the_cli_offers_every_bench_score_mod():
    option = next(o for o in main.commands["bench"].params if o.name == "score_mods")
    assert tuple(option.type.choices) == bench_mods.SCORE_MODS


def test_flex_gets_the_expression_flashgen_compiles_in():
    """The flex score mod and flashgen's ALiBi declaration, evaluated on the same scores and slopes."""
    r = np.random.default_rng(0)
    H, M, N = 4, 9, 13
    slope = np.asarray([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)])
    index = (np.zeros((1, 1, 1, 1), int), np.arange(H)[None, :, None, None], np.arange(M)[None, None, :, None],
             np.arange(N)[None, None, None, :])
    score = r.standard_normal((1, H, M, N))
    ours = BUILTIN_MODS["alibi"].function({"slope": slope}, xp=np)(*index, score=score)
    theirs = bench_mods.flex_score_mod("alibi", slope)(score, *index)
    assert np.allclose(ours, theirs, rtol=0, atol=1e-12) and not np.allclose(ours, score)
    with pytest.raises(ValueError, match="unknown bench score mod 'tanh'.*alibi"):
        bench_mods.flex_score_mod("tanh", slope)


def test_score_mods_replace_the_plain_points_and_old_points_load():
    grid = bench.default_grid(("f16",), (64,), seqlens=(1024,), score_mods=("alibi",))
    assert [(p.causal, p.score_mod) for p in grid] == [(False, "alibi"), (True, "alibi")]
    assert all(not p.score_mod for p in bench.default_grid(("f16",), (64,), seqlens=(1024,)))
    old = {"dtype": "f16", "head_dim": 64, "causal": True, "batch": 2, "heads": 8, "seqlen": 512, "group": 1,
           "mask": ""}
    assert bench.Point(**old).score_mod == ""
    # a mod costs no FLOPs in FlashAttention's count
    assert bench.flops(grid[1], "bwd") == bench.flops(bench.Point("f16", 64, True, 16, 32, 1024), "bwd")


def test_a_score_mod_point_gives_flashgen_and_flex_the_mod_and_the_others_a_reason(monkeypatch):
    torch = pytest.importorskip("torch")
    from bench_fakes import adapter, fake_nn, host_torch

    monkeypatch.setattr(bench, "_inputs", lambda _t, p, sets=3: [[torch.randn(s) for s in bench.shapes(p)]
                                                                  for _ in range(sets)])
    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=lambda: pool))
    host = host_torch(torch)
    host.tensor, host.float32 = torch.tensor, torch.float32
    nn, flex, calls = fake_nn()
    monkeypatch.setattr(host, "nn", nn)
    flex_mods = []

    def flex_with_mod(q, k, v, block_mask=None, score_mod=None, **kwargs):
        flex_mods.append((block_mask, score_mod))
        return flex(q, k, v, **kwargs)

    monkeypatch.setattr(bench, "_flex", flex_with_mod)
    monkeypatch.setitem(sys.modules, "torch.nn.attention.flex_attention",
                        types.SimpleNamespace(create_block_mask=lambda *a, **k: "causal-mask", flex_attention=None))
    seen = []

    def attention(q, k, v, attn_bias=None, **options):
        seen.append(options)
        return q * k + v

    adapter(monkeypatch, attention)
    point = bench.Point("f16", 8, True, 2, 3, 16, score_mod="alibi")
    results = bench.bench_point(point, ["flashgen-torch", "sdpa-cudnn", "fa4", "flex"], host, repeats=10)
    got = {(r.impl, r.direction): r.note if r.note else bool(r.tflops) for r in results}
    assert got == {("flashgen-torch", "fwd"): True, ("flashgen-torch", "bwd"): True,
                   ("sdpa-cudnn", "fwd"): "takes no score mod", ("sdpa-cudnn", "bwd"): "takes no score mod",
                   ("fa4", "fwd"): "takes no score mod", ("fa4", "bwd"): "takes no score mod",
                   ("flex", "fwd"): True, ("flex", "bwd"): True}
    slopes = [2.0 ** (-8.0 * (h + 1) / 3) for h in range(3)]
    assert seen and all(set(o) == {"causal", "score_mod", "mod_tensors"} and o["causal"] == "top_left"
                        and o["score_mod"] == "alibi" and o["mod_tensors"]["slope"].tolist() == pytest.approx(slopes)
                        for o in seen)
    assert flex_mods and all(mask == "causal-mask" and mod is not None for mask, mod in flex_mods)


def test_the_cli_refuses_a_score_mod_with_a_block_mask_and_shows_the_mod_in_the_table(monkeypatch):
    from bench_fakes import bench_cli

    points = []
    _, output = bench_cli(monkeypatch, {"flashgen": 100.0, "flex": 100.0}, "--score-mod", "alibi",
                           "--impl", "flashgen", "--impl", "flex", points=points)
    assert [(p.score_mod, p.causal) for p in points] == [("alibi", False), ("alibi", True)]
    cells = [line.split()[3] for line in output.splitlines() if line.startswith("f16")]
    assert cells == ["no+alibi", "no+alibi", "yes+alibi", "yes+alibi"]
    both = CliRunner().invoke(main, ["bench", "--score-mod", "alibi", "--mask", "document8"])
    assert both.exit_code != 0 and "a score mod with a block mask is not benched" in both.output
