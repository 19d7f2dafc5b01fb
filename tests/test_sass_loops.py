"""tools/sass_loops.py on nvdisasm-shaped text (no cubin, no nvdisasm): roles cut at USETMAXREG, loops
from a label to its last backward branch, ptxas's retry stubs after the last EXIT left out, and the
old -> new table."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import sass_loops  # noqa: E402


def sass(body: str) -> str:
    """nvdisasm -c's layout: a .text section per function, labels at column 0, instructions after
    their /*offset*/."""
    lines, offset = [], 0
    for item in body.strip().splitlines():
        item = item.strip()
        if item.startswith((".L_x_", ".text.")):
            lines.append(item)
        else:
            lines.append(f"        /*{offset:04x}*/                   {item} ;")
            offset += 16
    return "\n".join(lines)


KERNEL = sass("""
.text.kern:
MOV R1, c[0x0][0x28]
USETMAXREG.DEALLOC.CTAPOOL 0x18
.L_x_1:
UTMALDG.2D [UR8], [UR4]
SYNCS.ARRIVE.TRANS64 RZ, [UR6], RZ
@P1 BRA `(.L_x_1)
EXIT
USETMAXREG.TRY_ALLOC.CTAPOOL 0xf0
.L_x_2:
R2UR UR5, R2
.L_x_3:
HGMMA.64x80x16.F32.BF16 R24, gdesc[UR4], R24
STL [R1], R3
@P2 BRA `(.L_x_2)
LDL R3, [R1]
HGMMA.64x80x16.F32.BF16 R24, gdesc[UR4], R24
@P0 BRA `(.L_x_3)
BSSY B0, `(.L_x_4)
@P3 BRA `(.L_x_2)
EXIT
.L_x_4:
@!P0 BRA `(.L_x_3)
BRA `(.L_x_2)
.text.other:
MOV R2, R3
""")


def test_roles_and_loops_innermost_first():
    blocks = sass_loops.analyse(sass_loops.function_text(KERNEL, "kern"), min_loop=2)
    assert set(blocks) == {"setup", "producer", "producer loop 1", "consumer", "consumer loop 1", "consumer loop 2"}
    assert blocks["setup"].opcodes == ["MOV"]
    producer = blocks["producer loop 1"].counts()
    assert producer["instructions"] == 3 and producer["U*"] == 1  # UTMALDG .. the BRA back to .L_x_1
    inner, outer = blocks["consumer loop 1"].counts(), blocks["consumer loop 2"].counts()
    # .L_x_3 .. its BRA: HGMMA, STL, BRA, LDL, HGMMA, BRA
    assert (inner["instructions"], inner["HGMMA"], inner["LDL/STL"], inner["R2UR"]) == (6, 2, 2, 0)
    # .L_x_2 .. its last backward branch (the one after BSSY; the retries after EXIT are not edges)
    assert (outer["instructions"], outer["HGMMA"], outer["R2UR"], outer["BSSY"]) == (9, 2, 1, 1)
    assert blocks["consumer"].counts()["instructions"] == 13  # the role's retries after EXIT included


def test_a_missing_function_is_named():
    with pytest.raises(ValueError, match="no function 'absent'"):
        sass_loops.function_text(KERNEL, "absent")


def test_the_table_reads_old_to_new():
    new = sass_loops.analyse(sass_loops.function_text(KERNEL, "kern"), min_loop=2)
    old = {"consumer": sass_loops.Block("consumer", ["HGMMA", "R2UR"])}
    lines = sass_loops.table(new, old).splitlines()
    assert lines[0] == "| block | instructions | HGMMA | R2UR | U* | LDL/STL | BSSY | SHFL |"
    consumer = next(line for line in lines if line.startswith("| consumer |"))
    assert consumer.startswith("| consumer | 2 -> 13 | 1 -> 2 | 1 -> 1 |")
    assert any(line.startswith("| consumer loop 1 | - -> 6 |") for line in lines)
