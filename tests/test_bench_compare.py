"""tools/bench_compare.py: new / old TFLOP/s per point over runs of two versions of the kernels."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("bench_compare", Path(__file__).parents[1] / "tools" / "bench_compare.py")
tool = importlib.util.module_from_spec(spec)
spec.loader.exec_module(tool)


def test_bench_compare_finds_the_point_a_change_slowed(tmp_path):
    """A point slower in every new run than the old runs' spread is listed first."""
    def run(name, slow_point_tflops, noise):
        points = [{"dtype": "bf16", "head_dim": 128, "causal": c, "seqlen": 4096} for c in (False, True)]
        results = [{"impl": "flashgen", "direction": "fwd", "point": points[0], "tflops": slow_point_tflops},
                   {"impl": "flashgen", "direction": "fwd", "point": points[1], "tflops": 300 + noise},
                   {"impl": "sdpa-cudnn", "direction": "fwd", "point": points[0], "tflops": 1.0}]
        path = tmp_path / name
        path.write_text(json.dumps({"results": results}))
        return tool.load(str(path), "flashgen")

    old = [run("o1", 500, 0), run("o2", 505, 3)]
    new = [run("n1", 450, 1), run("n2", 452, 2)]
    rows = tool.compare(new, old)
    assert [round(r[0], 3) for r in rows] == [round(451 / 502.5, 3), round(301.5 / 301.5, 3)]
    slowest, spread, point, direction = rows[0]
    assert (point["causal"], direction) == (False, "fwd") and slowest < 1 - spread


def test_bench_compare_pairs_old_files_without_group_and_keeps_gqa_apart(tmp_path):
    """Runs from before --group (no group field) pair with group 1; a GQA point has no old twin."""
    base = {"dtype": "bf16", "head_dim": 128, "causal": False, "batch": 4, "heads": 16, "seqlen": 4096}

    def run(name, points):
        path = tmp_path / name
        path.write_text(json.dumps({"results": [{"impl": "flashgen", "direction": "fwd", "point": p, "tflops": t}
                                                for p, t in points]}))
        return tool.load(str(path), "flashgen")

    old = run("old.json", [(base, 400)])  # before --group: no group field
    new = run("new.json", [(dict(base, group=1), 380), (dict(base, group=4), 500)])
    rows = tool.compare([new], [old])
    assert [(round(r[0], 3), r[2]["group"]) for r in rows] == [(0.95, 1)]  # the GQA point has no old twin
    assert len(new) == 2


def test_bench_compare_summarises_each_direction_when_runs_hold_both(tmp_path, capsys):
    """A/B runs time both directions; the untouched one's ratios are the floor, so each gets a line."""
    point = {"dtype": "bf16", "head_dim": 64, "causal": True, "seqlen": 512}
    paths = []
    for name, fwd, bwd in (("new", [110, 220], [100, 200]), ("old", [100, 200], [101, 202])):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"results": [
            {"impl": "flashgen", "direction": d, "point": dict(point, seqlen=512 * (i + 1)), "tflops": t}
            for d, ts in (("fwd", fwd), ("bwd", bwd)) for i, t in enumerate(ts)]}))
        paths.append(str(path))
    assert tool.main(paths + ["--show", "0"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("4 points:")
    assert lines[1] == "  bwd (2): median 0.990, 0.990-0.990; fwd (2): median 1.100, 1.100-1.100"
    one_direction = tmp_path / "fwd_only.json"
    one_direction.write_text(json.dumps({"results": [r for r in json.loads(Path(paths[0]).read_text())["results"]
                                                     if r["direction"] == "fwd"]}))
    tool.main([str(one_direction), str(one_direction), "--show", "0"])
    assert len(capsys.readouterr().out.splitlines()) == 1  # nothing to split
    assert tool.main(paths + ["--show", "1"]) == 0  # the fwd points gained 10%, beyond the old runs' spread (0)
    lines = capsys.readouterr().out.splitlines()
    assert "faster: 2" in lines[0] and lines[3] == "  faster:" and lines[4].startswith("  1.100 (old spread 0.0%)")
    assert len(lines) == 5
