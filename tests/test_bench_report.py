"""tools/bench_report.py --update: the regenerated report keeps the file's hand-written sections."""
from __future__ import annotations

import importlib.util
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
        queued_path=str(docs / "fwd_d64_h100_s27_queued_tuned.json"))
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
    path.write_text(bench_report.json.dumps(run))
    bench_report.queued_section(str(path))
    out = capsys.readouterr().out
    assert "- Forward: flashgen / sdpa-cudnn 0.50 to 0.50." in out
    assert "- Backward: flashgen / sdpa-cudnn 2.00 to 2.00." in out
    assert "| fwd | bf16 | 64 | yes | 32 x 512 | 5 | 10 | 0.50 | 2% |" in out
    assert "fa4" not in out.split("\n\n", 2)[2]  # no fa4 column where the run had none


def test_options_come_out_of_the_argument_list():
    args = bench_report.parse_args(["--queued", "q.json", "run.json", "--update", "B.md", "repeat.json", "table.json"])
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
