"""``flashgen bench --mask``: block-mask points, their FLOP count, and who gets which mask (no GPU:
the masks' own arithmetic on NumPy, bench_point on CPU tensors through test_bench's fakes)."""
from __future__ import annotations

import sys
import types

import numpy as np
import pytest
from click.testing import CliRunner

from flashgen import bench, bench_host, bench_masks
from flashgen.cli import main


def dense(mask, seqlen):
    """The mask as a [seqlen, seqlen] boolean matrix, from the same function the bench hands out."""
    mod = bench_masks.mask_mod(mask, seqlen, np.arange)
    i = np.arange(seqlen)
    return np.asarray(mod(0, 0, i[:, None], i[None, :]))


@pytest.mark.parametrize("seqlen", [1, 13, 512, 1500, 4096])
def test_each_mask_is_the_documented_one_and_visible_counts_its_scores(seqlen):
    q, kv = np.meshgrid(np.arange(seqlen), np.arange(seqlen), indexing="ij")
    documents = q * 8 // seqlen == kv * 8 // seqlen  # document d: the positions i with i * 8 // seqlen == d
    window = (q >= kv) & (q - kv < 1024)
    for mask, want in (("document8", documents), ("window1024", window), ("document8-causal", documents & (q >= kv))):
        assert np.array_equal(dense(mask, seqlen), want), mask
        assert bench_masks.visible(mask, seqlen) == pytest.approx(want.mean(), rel=1e-12), mask


def test_an_unknown_mask_is_refused_with_the_ones_there_are():
    with pytest.raises(ValueError, match="unknown bench mask 'diagonal'.*document8, window1024, document8-causal"):
        bench_masks.visible("diagonal", 64)


def test_the_cli_offers_every_bench_mask():
    option = next(o for o in main.commands["bench"].params if o.name == "masks")
    assert tuple(option.type.choices) == bench_masks.MASKS


def test_flops_of_a_masked_point_count_only_its_visible_scores():
    full = bench.Point("bf16", 128, False, 1, 16, 4096)
    masked = bench.Point("bf16", 128, False, 1, 16, 4096, mask="document8")
    for direction in ("fwd", "bwd"):
        assert bench.flops(masked, direction) == pytest.approx(bench.flops(full, direction) / 8)


def test_masks_replace_the_full_and_causal_points_of_the_grid():
    grid = bench.default_grid(("f16",), (64,), seqlens=(1024, 4096), masks=("document8", "window1024"))
    assert [(p.causal, p.mask, p.seqlen) for p in grid] == [
        (False, "document8", 1024), (False, "document8", 4096), (False, "window1024", 1024),
        (False, "window1024", 4096)]
    assert all(not p.mask for p in bench.default_grid(("f16",), (64,), seqlens=(1024,)))


def test_point_without_a_mask_loads_from_an_older_json():
    old = {"dtype": "f16", "head_dim": 64, "causal": True, "batch": 2, "heads": 8, "seqlen": 512, "group": 1}
    assert bench.Point(**old).mask == ""


def test_a_masked_point_gives_flashgen_and_flex_its_mask_and_the_others_a_reason(monkeypatch):
    """flashgen-torch gets flashgen's block mask in both directions, flex its own of the same mask,
    SDPA and FA4 a cell that says they take none; no call gets a causal flag except flashgen's at a
    document8-causal point (the document mask with causal beside it, as a user writes it)."""
    torch = pytest.importorskip("torch")
    from bench_fakes import adapter, fake_nn, host_torch

    made = []
    monkeypatch.setattr(bench, "_inputs", lambda _t, p, sets=3: [[torch.randn(s) for s in bench.shapes(p)]
                                                                  for _ in range(sets)])
    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=lambda: pool))
    host = host_torch(torch)
    nn, flex, calls = fake_nn()
    monkeypatch.setattr(host, "nn", nn)
    flex_calls = []

    def flex_with_mask(q, k, v, block_mask=None, **kwargs):
        flex_calls.append(block_mask)
        return flex(q, k, v, **kwargs)

    monkeypatch.setattr(bench, "_flex", flex_with_mask)
    monkeypatch.setattr(bench_masks, "flashgen_block_mask", lambda p: made.append(("flashgen", p.mask)) or "fg-mask")
    monkeypatch.setattr(bench_masks, "flex_block_mask", lambda p, t: made.append(("flex", p.mask)) or "flex-mask")
    seen = []

    def attention(q, k, v, attn_bias=None, **options):
        seen.append(options)
        return q * k + v

    adapter(monkeypatch, attention)
    point = bench.Point("f16", 8, False, 2, 3, 16, mask="window1024")
    results = bench.bench_point(point, ["flashgen-torch", "sdpa-flash", "fa4", "flex"], host, repeats=10)
    got = {(r.impl, r.direction): r.note if r.note else bool(r.tflops) for r in results}
    assert got == {("flashgen-torch", "fwd"): True, ("flashgen-torch", "bwd"): True,
                   ("sdpa-flash", "fwd"): "takes no block mask", ("sdpa-flash", "bwd"): "takes no block mask",
                   ("fa4", "fwd"): "takes no block mask", ("fa4", "bwd"): "takes no block mask",
                   ("flex", "fwd"): True, ("flex", "bwd"): True}
    assert made == [("flashgen", "window1024"), ("flex", "window1024")]  # once per point, not per call
    assert seen and all(options == {"block_mask": "fg-mask"} for options in seen)
    assert flex_calls and set(flex_calls) == {"flex-mask"}
    seen.clear()
    causal = bench.Point("f16", 8, False, 2, 3, 16, mask="document8-causal")  # flashgen: the mask and causal
    bench.bench_point(causal, ["flashgen-torch"], host, repeats=10)
    assert seen and all(options == {"block_mask": "fg-mask", "causal": "top_left"} for options in seen)


def test_bench_cli_takes_masks_and_shows_them_in_the_table(monkeypatch):
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True,
                                                                  get_device_name=lambda: "Fake GPU"))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    points = []

    def bench_point(p, impls, torch, repeats, all_instances, queued):
        points.append(p)
        return [bench.Result(i, d, p, 1.0, 100.0) for i in impls for d in ("fwd", "bwd")]

    monkeypatch.setattr(bench, "bench_point", bench_point)
    monkeypatch.setattr(bench_host, "call_overhead_us", lambda torch: {})
    monkeypatch.setattr(bench_host, "import_times_ms", lambda: {})
    result = CliRunner().invoke(main, ["bench", "--dtype", "f16", "--head-dim", "64", "--seqlen", "2048",
                                       "--mask", "document8", "--impl", "flashgen", "--impl", "flex"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert [(p.mask, p.causal) for p in points] == [("document8", False)]
    rows = [line.split() for line in result.output.splitlines() if line.startswith("f16")]
    assert [row[:6] for row in rows] == [["f16", "64", "32/32", "document8", "2048", "fwd"],
                                         ["f16", "64", "32/32", "document8", "2048", "bwd"]]
    assert "document8 B8 H32/32 S2048" in result.output
    bad = CliRunner().invoke(main, ["bench", "--mask", "diagonal"])
    assert bad.exit_code != 0 and "document8" in bad.output


def test_all_instances_are_not_timed_at_a_masked_point(monkeypatch):
    """tune.measure_choices times unmasked shapes: at a block-mask point its numbers would be another call's."""
    torch = pytest.importorskip("torch")
    from bench_fakes import host_torch

    from flashgen import tune

    monkeypatch.setattr(bench, "_inputs", lambda _t, p, sets=3: [[torch.randn(s) for s in bench.shapes(p)]
                                                                  for _ in range(sets)])
    pool = types.SimpleNamespace(free_all_blocks=lambda: None)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(get_default_memory_pool=lambda: pool))
    monkeypatch.setattr(tune, "measure_choices", lambda *a, **k: pytest.fail("timed a masked point unmasked"))
    point = bench.Point("f16", 8, False, 2, 3, 16, mask="document8")
    results = bench.bench_point(point, [], host_torch(torch), repeats=10, all_instances=True)
    assert [(r.impl, r.direction, r.tflops) for r in results] == [("flashgen[*]", "fwd", None),
                                                                  ("flashgen[*]", "bwd", None)]
    assert results[0].note == "instances not timed at block-mask points: flashgen tune measures unmasked shapes only"


@pytest.mark.parametrize("seqlen", [1000, 1024, 2500])  # 2500: past the window, ragged documents and blocks
@pytest.mark.parametrize("mask", bench_masks.MASKS)
def test_flashgens_declared_mask_mod_builds_the_block_mask_of_the_masks_function(mask, seqlen):
    """flashgen's side gets the point's mask as a built-in mask mod with its tensors (the AOT Flex
    path); flex gets the Python function.  Both must describe the same mask: on the host, the block
    mask of the mod equals the block mask of the function (its causal part passed as the option)."""
    import flashgen

    elements = mask[:-len("-causal")] if mask.endswith("-causal") else mask
    from_function = flashgen.block_mask(bench_masks.mask_mod(elements, seqlen, np.arange), 1, 1, seqlen, seqlen,
                                        block=bench_masks.BLOCK, device="cpu")
    mod, tensors = bench_masks.declared_mask(mask, seqlen, np)
    from_mod = flashgen.block_mask(mod, 1, 1, seqlen, seqlen, block=bench_masks.BLOCK, device="cpu",
                                   mod_tensors=tensors)
    for a, b in zip(from_function.kernel_arrays() + from_function.backward_arrays(),
                    from_mod.kernel_arrays() + from_mod.backward_arrays()):
        np.testing.assert_array_equal(a, b)
    assert from_mod.kv_num_blocks.sum() + from_mod.full_kv_num_blocks.sum() > 0  # the mask shows something
