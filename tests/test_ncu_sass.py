"""tools/ncu_sass.py on a hand-made ncu source-page CSV: per-opcode sums, offsets, kernels picked by name."""
from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "ncu_sass.py"
spec = importlib.util.spec_from_file_location("ncu_sass", TOOL)
ncu_sass = importlib.util.module_from_spec(spec)
sys.modules["ncu_sass"] = ncu_sass  # its dataclasses look their module up there
spec.loader.exec_module(ncu_sass)

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
          "L1 Wavefronts Shared Excessive", "L1 Wavefronts Shared", "stall_barrier", "stall_wait",
          "stall_wait (Not Issued)"]
MINE = [["0x7f00", "      LDC R1, c[0x0][0x28]", "5", "100", "0", "0", "0", "5", "99"],
        ["0x7f10", "  @!P1  STS.128 [R2], R4", "10", "2,000", "300", "500", "1", "9", "0"],
        ["0x7f20", "      STS.128 [R3], R8", "20", "2,000", "100", "300", "15", "5", "0"],
        ["0x7f30", "      WARPGROUP.DEPBAR.LE gsb0, 0x0", "65", "50", "-", "-", "60", "5", "0"]]
THEIRS = [["0xa000", "      HGMMA.64x64x16.F32.BF16 R0, gdesc[UR4], R0", "7", "10", "0", "0", "0", "7", "0"]]
AGAIN = [["0x9000", "      LDC R1, c[0x0][0x28]", "999", "999", "999", "999", "999", "0", "0"]]


def write(tmp_path, blocks):
    path = tmp_path / "sass.csv"
    with open(path, "w", newline="") as f:
        out = csv.writer(f)
        for name, rows in blocks:
            out.writerow(["Kernel Name", name, ""])
            out.writerow(HEADER)
            out.writerows(rows)
    return str(path)


BLOCKS = [("mine", MINE), ("theirs_bprop", THEIRS), ("mine", AGAIN)]


def section(out: str, title: str):
    lines = out.split(title, 1)[1].splitlines()[1:]
    return [line.split() for line in lines[:next((i for i, x in enumerate(lines) if not x.strip()), len(lines))]]


def test_opcodes_summed_offsets_from_the_first_instruction_and_the_first_launch_only(tmp_path, capsys):
    assert ncu_sass.main([write(tmp_path, BLOCKS), "--kernel", "mine"]) == 0
    out = capsys.readouterr().out
    assert out.count("== ") == 1  # the second launch of "mine" (all 999s) is left out
    assert "instructions executed 0.00 M, stall samples 100, shared wavefronts 0.8 k of which beyond ideal 0.4 k" in out
    opcodes = {row[0]: row[1:] for row in section(out, "excess (k)")}
    assert opcodes["STS.128"] == ["0.00", "30.0", "0.4"]  # predicated and not: one opcode, 30 of 100 samples
    assert list(opcodes)[0] == "WARPGROUP.DEPBAR.LE"  # most samples first
    top = section(out, "top instructions by stall samples")
    assert top[0][:3] == ["000030", "65.0", "barrier"]
    assert top[2][:3] == ["000010", "10.0", "wait"]  # all-samples reasons, not the "(Not Issued)" column
    conflicts = section(out, "top instructions by shared wavefronts beyond ideal")
    assert [row[0] for row in conflicts] == ["000010", "000020"] and conflicts[0][1:3] == ["0.3", "0.5"]


def test_every_kernel_once_without_names_and_a_kernel_without_conflicts_says_so(tmp_path, capsys):
    ncu_sass.main([write(tmp_path, BLOCKS), "--top", "1"])
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("== ")] == ["== mine", "== theirs_bprop"]
    assert "no shared-memory wavefronts beyond ideal" in out.split("== theirs_bprop")[1]
    assert len(section(out.split("== theirs_bprop")[0], "top instructions by stall samples")) == 1


def test_wrong_input_is_an_error_that_says_what_to_export(tmp_path):
    with pytest.raises(SystemExit, match="no kernel name contains 'cudnn'; names: mine, theirs_bprop"):
        ncu_sass.main([write(tmp_path, BLOCKS), "--kernel", "cudnn"])
    raw = tmp_path / "raw.csv"
    raw.write_text('"ID","Kernel Name"\n"0","mine"\n')
    with pytest.raises(SystemExit, match="not an ncu source-page CSV"):
        ncu_sass.main([str(raw)])
    no_source = tmp_path / "nosource.csv"
    no_source.write_text('"Kernel Name","mine"\n"Address","Instructions Executed"\n"0x0","1"\n')
    with pytest.raises(SystemExit, match="--page source --print-source sass"):
        ncu_sass.main([str(no_source)])
    with pytest.raises(SystemExit):
        ncu_sass.main([write(tmp_path, BLOCKS), "--top", "0"])
