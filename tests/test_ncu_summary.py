"""tools/ncu_summary.py on a hand-made ncu raw-page CSV: units converted, kernels picked by name."""
from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "ncu_summary.py"
spec = importlib.util.spec_from_file_location("ncu_summary", TOOL)
ncu_summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ncu_summary)

HEADER = ["ID", "Kernel Name", "gpu__time_duration.sum", "launch__shared_mem_per_block_dynamic",
          "smsp__inst_executed.sum", "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
          "smsp__average_warps_issue_stalled_wait_per_issue_active.ratio"]
UNITS = ["", "", "ms", "Kbyte/block", "inst", "inst", "inst"]


def write(tmp_path, rows, units=UNITS):
    path = tmp_path / "raw.csv"
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        out.writerow(["==PROF== a line ncu prints before the table"])
        out.writerow(HEADER)
        out.writerow(units)
        out.writerows(rows)
    return str(path)


ROWS = [["0", "mine_prep", "0.075", "0", "1,000,000", "0.0", "1.0"],
        ["1", "mine", "12.5", "232.448", "2,137,000,000", "2.13", "1.58"],
        ["2", "theirs_FlashAttentionBackwardSm90_xyz", "9.75", "232.448", "1,589,000,000", "1.54", "0.95"],
        ["3", "mine", "99.0", "1", "1", "9", "9"]]


def test_picks_exact_names_first_then_substrings_and_converts_units(tmp_path, capsys):
    assert ncu_summary.main([write(tmp_path, ROWS), "mine", "FlashAttentionBackwardSm90"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "[0] mine" and lines[1].startswith("[1] theirs_FlashAttention")
    table = {line.rsplit(None, 2)[0].strip(): [float(v) for v in line.split()[-2:]] for line in lines[3:]}
    assert table["duration (us)"] == [12500.0, 9750.0]  # ms -> us; the first launch of "mine", not the third
    assert table["dynamic smem (KB)"] == [232.45, 232.45]
    assert table["instructions (M)"] == [2137.0, 1589.0]
    assert list(table)[-2:] == ["stall barrier", "stall wait"]  # largest first in the first column


def test_every_kernel_once_without_names(tmp_path, capsys):
    ncu_summary.main([write(tmp_path, ROWS)])
    names = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    assert names == ["[0] mine_prep", "[1] mine", "[2] theirs_FlashAttentionBackwardSm90_xyz"]


def test_an_unknown_unit_or_name_is_an_error_not_a_wrong_number(tmp_path):
    with pytest.raises(SystemExit, match="unit 'furlong'"):
        ncu_summary.main([write(tmp_path, ROWS, ["", "", "furlong"] + UNITS[3:]), "mine"])
    with pytest.raises(SystemExit, match="no kernel name contains 'cudnn'"):
        ncu_summary.main([write(tmp_path, ROWS), "cudnn"])
