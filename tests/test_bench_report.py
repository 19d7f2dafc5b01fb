"""tools/bench_report.py: its tables and ratios (fa4, GQA rows, the adapter and standing sections) and, with
--update, the regenerated report keeping the file's hand-written sections."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "bench_report.py"
spec = importlib.util.spec_from_file_location("bench_report", TOOL)
bench_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench_report)

OLD = """# Benchmarks

old intro

## Forward

old forward table

## Forward history

kept A

## Session notes

kept B

## Grouped-query attention (docs/bench_h200_gqa.json)

old gqa

## Bias study

kept C
"""
NEW = """# Benchmarks

new intro

## Forward

new forward table

## Tuning table

new tuning
"""


def test_hand_written_sections_follow_their_generated_section_and_orphans_go_last():
    merged = bench_report.merge(NEW, OLD)
    headings = [line for line in merged.splitlines() if line.startswith("## ")]
    # "Bias study" followed the GQA section, which this run did not write (dropped): it goes last
    assert headings == ["## Forward", "## Forward history", "## Session notes", "## Tuning table", "## Bias study"]
    assert "new forward table" in merged and "old forward table" not in merged and "old gqa" not in merged
    assert "new intro" in merged and "old intro" not in merged
    assert all(text in merged for text in ("kept A", "kept B", "kept C", "new tuning"))


def test_merging_again_changes_nothing():
    once = bench_report.merge(NEW, OLD)
    assert bench_report.merge(NEW, once) == once


def test_update_replaces_the_file_whole(tmp_path, monkeypatch):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(OLD)
    mode = path.stat().st_mode
    monkeypatch.setattr(bench_report, "main", lambda *args, **options: print(NEW, end=""))
    bench_report.update(str(path), [])
    assert path.read_text() == bench_report.merge(NEW, OLD)
    assert path.stat().st_mode == mode  # ordinary permissions, not a temporary file's 0600
    assert [p.name for p in tmp_path.iterdir()] == ["BENCHMARKS.md"]  # no temporary file left behind


def test_every_section_the_report_writes_is_known_as_generated(capsys):
    """GENERATED_* name the headings main() prints: a heading added there without them would be kept
    from the old file as hand-written and appear twice after an update."""
    docs = TOOL.parents[1] / "docs"
    bench_report.main(*(str(docs / name) for name in (
        "bench_h200.json", "bench_h200_repeat.json", "tuning_h200_runs.json", "bench_h200_gqa.json",
        "bench_h200_torch_queued.json", "bench_h200_torch_queued_repeat.json", "bench_h200_torch_call.json")),
        queued_path=str(docs / "fwd_d64_h100_s27_queued_tuned.json"),
        variant_paths=[str(docs / "bench_h200_s33_bias.json")])
    out = capsys.readouterr().out
    headings = [h for h, _ in bench_report.sections(out) if h is not None]
    assert len(headings) >= 10 and all(bench_report.is_generated(h) for h in headings), headings
    assert "--queued " + str(docs / "fwd_d64_h100_s27_queued_tuned.json") in out  # the command block says how


def test_the_queued_section_reads_each_peer_against_flashgen(tmp_path, capsys):
    def result(impl, direction, ms, causal):
        point = {"dtype": "bf16", "head_dim": 64, "causal": causal, "batch": 32, "heads": 32, "seqlen": 512,
                 "group": 1, "mask": "", "score_mod": ""}
        return {"impl": impl, "direction": direction, "point": point, "ms": ms, "tflops": 1.0 / ms, "spread": 0.02}
    run = {"device": "NVIDIA H100 80GB HBM3", "timing": "queued",
           "results": [result("flashgen", "fwd", 0.2, True), result("sdpa-cudnn", "fwd", 0.1, True),
                       result("flashgen", "bwd", 0.3, False), result("sdpa-cudnn", "bwd", 0.6, False)]}
    path = tmp_path / "queued.json"
    path.write_text(json.dumps(run))
    bench_report.queued_section(str(path), bench_report.load(str(path)))
    out = capsys.readouterr().out
    assert "- Forward: flashgen / sdpa-cudnn 0.50 to 0.50." in out
    assert "- Backward: flashgen / sdpa-cudnn 2.00 to 2.00." in out
    assert "| fwd | bf16 | 64 | yes | 32 x 512 | 5 | 10 | 0.50 | 2% |" in out
    assert "fa4" not in out.split("\n\n", 2)[2]  # no fa4 column where the run had none


def test_the_variants_section_reads_flashgen_against_its_twins_and_counts_the_bars(tmp_path, capsys):
    """Per variant, head dim and direction (forward first): flashgen / plain and / example 41 over the
    points, how many reach issue 17's bars, and flashgen.torch / flashgen; plain points are not in it."""
    def point(variant, seqlen):
        return {"dtype": "bf16", "head_dim": 64, "causal": False, "batch": 1, "heads": 32, "seqlen": seqlen,
                "group": 1, "mask": "", "score_mod": "", "variant": variant}

    ms = {"flashgen": 1.0, "flashgen-plain": 0.9, "flashgen-example41": 2.0, "flashgen-torch": 1.25}
    results = [{"impl": impl, "direction": d, "point": point("bias", s), "ms": t * s / 1024, "tflops": 1.0}
               for s in (1024, 4096) for d in ("bwd", "fwd") for impl, t in ms.items()]
    results[0]["ms"] = 0.8  # flashgen bwd at 1024: plain 0.9 / 0.8, example 41 2.0 / 0.8, the adapter 0.8 / 1.25
    results.append({"impl": "flashgen", "direction": "fwd", "point": point("", 1024), "ms": 9.0, "tflops": 1.0})
    path = tmp_path / "variants.json"
    path.write_text(json.dumps({"results": results}))
    bench_report.variants_section([str(path)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| bias")]
    assert rows == ["| bias | 64 | fwd | 0.90 to 0.90 | 2 of 2 | 2.00 to 2.00 | 0 of 2 | 0.80 to 0.80 |",
                    "| bias | 64 | bwd | 0.90 to 1.12 | 2 of 2 | 2.00 to 2.50 | 1 of 2 | 0.64 to 0.80 |"]


def test_a_variant_run_is_listed_with_the_command_that_makes_it_where_the_report_reads_it(tmp_path):
    """The header's commands must remake every file the report reads: a --variant run's recorded command
    (which wrote its JSON wherever the device put it) comes back writing the path given to --variants."""
    path = tmp_path / "bias.json"
    path.write_text(json.dumps({"command": "flashgen bench --variant bias --dtype bf16 --json /root/out/x.json"}))
    assert bench_report.variant_command(str(path)) == f"flashgen bench --variant bias --dtype bf16 --json {path}"
    path.write_text(json.dumps({"command": "flashgen bench --variant dropout"}))
    assert bench_report.variant_command(str(path)) == f"flashgen bench --variant dropout --json {path}"


def test_options_come_out_of_the_argument_list():
    args = bench_report.parse_args(["--queued", "q.json", "run.json", "--update", "B.md", "repeat.json", "table.json",
                                    "--variants", "v1.json", "--variants", "v2.json"])
    assert args.variants == ["v1.json", "v2.json"]
    assert args.update == "B.md"
    assert args.queued == "q.json"
    assert args.runs == ["run.json", "repeat.json", "table.json"]
    assert bench_report.parse_args(["run.json", "repeat.json", "table.json"]).queued == ""
    with pytest.raises(SystemExit):  # a run, its repeat and the table are the least the report needs
        bench_report.parse_args(["--update", "B.md", "run.json", "repeat.json"])


def test_the_standing_table_counts_points_at_or_above_a_peer_in_every_run(capsys):
    """Issue 16's bar: a point counts only where flashgen is at or above the peer in each run, and a
    point a run lacks is left out of the count rather than passed."""
    def cells(ms_by_seqlen):  # seqlen -> (flashgen, cudnn, fa4) ms, head dim 64, unmasked forward
        out = {}
        for seqlen, times in ms_by_seqlen.items():
            key = ("fwd", "bf16", 64, False, seqlen, 16384 // seqlen, 32, 1)
            out[key] = {impl: {"ms": ms} for impl, ms in zip(("flashgen", "sdpa-cudnn", "fa4"), times)}
        return out
    run = cells({512: (1.0, 1.2, 0.5), 1024: (1.0, 1.0, 2.0), 2048: (1.0, 1.1, 1.1)})
    repeat = cells({512: (1.0, 1.1, 0.5), 1024: (1.0, 0.9, 2.0), 2048: (1.0, 1.1, 1.1)})
    queued = cells({512: (1.0, 1.5, 1.5), 1024: (1.0, 1.0, 1.0)})  # 2048 missing
    bench_report.standing_table("fwd", [("run", run), ("repeat", repeat), ("queued", queued)])
    out = capsys.readouterr().out
    assert "| / cudnn (run, repeat, queued) | / fa4 (run, repeat, queued) |" in out
    # cudnn: 512 passes everywhere, 1024 fails in the repeat (0.90); fa4: 512 fails (0.50), 1024 passes
    assert "| 64 | no | 1.00-1.20, 0.90-1.10, 1.00-1.50 | 0.50-2.00, 0.50-2.00, 1.00-1.50 | 1/2 | 1/2 |" in out
    bench_report.standing_table("bwd", [("run", run)])  # no backward points: a header and no rows
    assert "| 64 |" not in capsys.readouterr().out


def _report(tmp_path, capsys, fa4_tflops):
    """tools/bench_report.py on two points (each fwd and bwd), fa4 at the points in ``fa4_tflops``
    (seqlen -> TFLOP/s), an import note at the others; returns the output and each table's rows as
    {column: cell} per (direction, seqlen)."""
    results = []
    for seqlen in (512, 1024):
        point = {"dtype": "bf16", "head_dim": 128, "causal": False, "batch": 16384 // seqlen, "heads": 16,
                 "seqlen": seqlen}
        for direction in ("fwd", "bwd"):
            for impl, tflops in (("flashgen", 400), ("sdpa-efficient", 200), ("sdpa-flash", 320),
                                 ("sdpa-cudnn", 500), ("fa4", fa4_tflops.get(seqlen))):
                note = "" if tflops else "ModuleNotFoundError: No module named 'flash_attn'"
                results.append({"impl": impl, "direction": direction, "point": point, "tflops": tflops,
                                "ms": 100 / tflops if tflops else None, "note": note, "spread": 0.01,
                                "compile_s": (12.5 if direction == "fwd" else 31.0) if tflops and impl == "fa4"
                                else None})
    run = {"device": "Fake GPU", "overhead_us": {"flashgen.attention_forward": 9.0}, "import_ms": {},
           "results": results}
    paths = [tmp_path / name for name in ("run.json", "repeat.json", "table.json")]
    for path, data in zip(paths, (run, run, {"measured": {"points": [], "command": "tune", "repeats": 10},
                                             "entries": []})):
        path.write_text(json.dumps(data))
    bench_report.main(*map(str, paths))
    output = capsys.readouterr().out
    rows = {}
    for direction, section in (("fwd", "## Forward\n"), ("bwd", "## Backward\n")):
        lines = output.split(section)[1].strip().split("\n\n")[0].splitlines()
        header = [c.strip() for c in lines[0].strip("|").split("|")]
        for line in lines[2:]:
            cells = dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
            rows[(direction, int(cells["B x S"].split(" x ")[1]))] = cells
    return output, rows


def test_bench_report_has_fa4_columns_and_ratios(tmp_path, capsys):
    output, rows = _report(tmp_path, capsys, {512: 500, 1024: 320})
    for direction in ("fwd", "bwd"):
        assert (rows[(direction, 512)]["fa4"], rows[(direction, 512)]["flashgen / fa4"]) == ("500", "0.80")
        assert (rows[(direction, 1024)]["fa4"], rows[(direction, 1024)]["flashgen / fa4"]) == ("320", "1.25")
        assert rows[(direction, 512)]["flashgen / cudnn"] == "0.80"
    assert output.count("flashgen / fa4: 0.80 to 1.25.") == 2  # the forward and backward summaries
    assert "first calls took 12.5 s to 31.0 s" in output


def test_bench_report_shows_dashes_where_fa4_is_missing(tmp_path, capsys):
    output, rows = _report(tmp_path, capsys, {512: 500})
    assert (rows[("fwd", 1024)]["fa4"], rows[("fwd", 1024)]["flashgen / fa4"]) == ("-", "-")
    assert output.count("flashgen / fa4: 0.80 to 0.80.") == 2
    output, rows = _report(tmp_path, capsys, {})
    assert all((r["fa4"], r["flashgen / fa4"]) == ("-", "-") for r in rows.values()) and len(rows) == 4
    assert output.count("flashgen / cudnn: 0.80 to 0.80; flashgen / fa4: -.") == 2
    assert "fa4 (FlashAttention-4) has no timing in this run: ModuleNotFoundError: No module named 'flash_attn'." \
        in output


def test_bench_report_gives_a_gqa_point_its_own_row(tmp_path, capsys):
    """A GQA point and its multi-head twin (same B x S) get their own rows; a peer without a GQA
    kernel there (sdpa-efficient) leaves dashes, not a crash; an old file without groups pairs up."""
    def point(group=None):
        p = {"dtype": "bf16", "head_dim": 128, "causal": False, "batch": 16, "heads": 16, "seqlen": 1024}
        return p if group is None else dict(p, group=group)

    def results(mha_point):
        rows = []
        for p, efficient in ((mha_point, 200), (point(4), None)):
            for direction in ("fwd", "bwd"):
                for impl, tflops in (("flashgen", 400 if p is mha_point else 500), ("sdpa-efficient", efficient),
                                     ("sdpa-flash", 320), ("sdpa-cudnn", 500)):
                    rows.append({"impl": impl, "direction": direction, "point": p, "tflops": tflops,
                                 "ms": 100 / tflops if tflops else None, "spread": 0.01,
                                 "note": "" if tflops else "at GQA 16/4 heads: RuntimeError: No available kernel"})
        return rows

    runs = [{"device": "Fake GPU", "overhead_us": {}, "import_ms": {}, "results": results(mha)}
            for mha in (point(1), point())]  # the repeat run: written before --group
    paths = [tmp_path / name for name in ("run.json", "repeat.json", "table.json")]
    for path, data in zip(paths, runs + [{"measured": {"points": [], "command": "tune", "repeats": 10},
                                          "entries": []}]):
        path.write_text(json.dumps(data))
    bench_report.main(*map(str, paths))
    output = capsys.readouterr().out
    table = output.split("## Forward\n")[1].strip().split("\n\n")[0].splitlines()
    header = [c.strip() for c in table[0].strip("|").split("|")]
    rows = {cells["B x S"]: cells for cells in (dict(zip(header, (c.strip() for c in line.strip("|").split("|"))))
                                                for line in table[2:])}
    assert set(rows) == {"16 x 1024", "16 x 1024, 16/4 heads"}
    assert (rows["16 x 1024"]["flashgen"], rows["16 x 1024"]["flashgen / efficient"]) == ("400", "2.00")
    assert (rows["16 x 1024, 16/4 heads"]["flashgen"], rows["16 x 1024, 16/4 heads"]["sdpa-efficient"],
            rows["16 x 1024, 16/4 heads"]["flashgen / efficient"]) == ("500", "-", "-")
    assert "moved each implementation's median by 0.0% (median)" in output  # the old repeat file paired up


def test_bench_report_adapter_section_ratios_per_timing_and_own_host_cost(tmp_path, capsys):
    """The adapter runs: flashgen-torch / flashgen per direction and run, named with the run's
    timing, and the adapter's host cost net of the no-op op, against the CuPy path's."""
    point = {"dtype": "bf16", "head_dim": 128, "causal": False, "batch": 8, "heads": 16, "seqlen": 2048}
    paths = []
    for name, timing, torch_ms in (("queued.json", "queued", (1.0, 2.04)), ("call.json", "call", (1.25, 2.5))):
        results = [{"impl": impl, "direction": d, "point": point, "tflops": 1.0, "ms": ms, "note": "", "spread": 0.0}
                   for d, cupy_ms, torch_d in (("fwd", 1.0, torch_ms[0]), ("bwd", 2.0, torch_ms[1]))
                   for impl, ms in (("flashgen", cupy_ms), ("flashgen-torch", torch_d))]
        overhead = {"flashgen.attention_forward": 20.0, "flashgen.attention_backward": 30.0,
                    "flashgen.torch forward": 40.0, "flashgen.torch backward (autograd.grad)": 120.0,
                    "no-op torch op forward": 10.0, "no-op torch op backward (autograd.grad)": 75.0}
        (tmp_path / name).write_text(json.dumps({"timing": timing, "overhead_us": overhead, "results": results}))
        paths.append(str(tmp_path / name))
    bench_report.adapter_section(paths)
    out = capsys.readouterr().out
    assert f"- {paths[0]} (queued), bwd: 0.98 to 0.98, median 0.980" in out
    assert f"- {paths[1]} (call), fwd: 0.80 to 0.80, median 0.800" in out
    assert "- forward: flashgen.torch 40.0 us - no-op op 10.0 us = 30.0 us, 1.50x the CuPy path's 20.0 us" in out
    assert "= 45.0 us, 1.50x the CuPy path's 30.0 us" in out
