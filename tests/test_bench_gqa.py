"""The benchmark's points beyond the plain grid, without a GPU: grouped-query points (--group: k and
v with heads // group heads, everything else as before), every instance's tile (--all-instances),
and how both reach the table, the plot and the JSON."""
from __future__ import annotations

import sys
import types

import pytest
from click.testing import CliRunner

from bench_fakes import POINT, adapter, bench_cli, fake_nn
from flashgen import bench, bench_table
from flashgen.cli import main

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

    adapter(monkeypatch, attention)
    results = bench.bench_point(GQA, ["flashgen-torch"], host_bench.torch, repeats=10)
    assert all(r.tflops and not r.note and r.point.group == 4 for r in results)
    assert set(seen) == {((2, 16, 8, 8), (2, 16, 2, 8), (2, 16, 2, 8))}



def test_sdpa_and_flex_pass_enable_gqa_and_a_refusing_backend_is_a_dash_with_why(host_bench, monkeypatch):
    nn, flex, calls = fake_nn(refuse_gqa=("efficient",))
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
    nn, _, calls = fake_nn()
    monkeypatch.setattr(host_bench.torch, "nn", nn)
    results = bench.bench_point(POINT, ["sdpa-flash"], host_bench.torch, repeats=10)
    assert all(r.tflops and not r.note for r in results)
    assert {(impl, shape, tuple(kwargs)) for impl, shape, kwargs in calls} == {("flash", (2, 3, 16, 8), ())}


class _NoTensor:
    """Stands in for a torch tensor where no implementation is asked for (bench_point only views it)."""

    def transpose(self, *dims):
        return self

    def requires_grad_(self, flag=True):
        return self


@pytest.mark.parametrize("point", [POINT, GQA], ids=["multi-head", "gqa"])
def test_all_instances_report_the_best_tile_against_the_default_timed_alike(monkeypatch, point):
    """The tiles are timed back to back after the rounds (other clocks than the columns): the runtime's
    own choice comes with them as flashgen[default], and the table's cell is the best tile over it.
    tune.measure_choices times the point itself (its inputs are the point's shapes, GQA included)."""
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
    timed_points = []
    monkeypatch.setattr(tune, "measure_choices", lambda p, direction, *a: timed_points.append(p) or dict(ms[direction]))
    torch = types.SimpleNamespace(cuda=types.SimpleNamespace(synchronize=lambda: None, empty_cache=lambda: None),
                                  nn=types.SimpleNamespace(functional=types.SimpleNamespace(
                                      scaled_dot_product_attention=None)))
    results = bench.bench_point(point, [], torch, repeats=10, all_instances=True)
    timed = {(r.impl, r.direction): r.ms for r in results}
    assert timed == {(f"flashgen[{label}]", d): t for d, times in ms.items() for label, t in times.items()}
    assert timed_points == [point, point]
    table = bench_table([point], results, [], all_instances=True)
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
    _, output = bench_cli(monkeypatch, {"flashgen": 400}, "--impl", "flashgen", "--group", "1", "--group", "4",
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
    bench_cli(monkeypatch, {"flashgen": 400}, "--impl", "flashgen", "--timing", "queued", "--json", str(path))
    assert json.loads(path.read_text())["timing"] == "queued"


@pytest.mark.parametrize("group, message", [
    ("0", "0 is not in the range x>=1"),
    ("3", "3 divides none of the head counts: 32 (head dim 64), 16 (head dim 128)"),
])
@pytest.mark.parametrize("command", ["bench", "tune"])
def test_bench_and_tune_reject_a_group_that_cannot_be_run(group, message, command):
    """Before any GPU, CuPy or torch is looked for."""
    result = CliRunner().invoke(main, [command, "--head-dim", "64", "--head-dim", "128", "--group", "4",
                                       "--group", group])
    assert result.exit_code == 2 and "--group" in result.output
    assert message in " ".join(result.output.split())  # click wraps long messages


def test_bench_accepts_a_group_that_fits_one_head_dim(monkeypatch):
    """--group 32 fits head dim 64's 32 heads: those points run, head dim 128's 16 heads are skipped."""
    _, output = bench_cli(monkeypatch, {"flashgen": 400}, "--impl", "flashgen", "--head-dim", "128",
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

