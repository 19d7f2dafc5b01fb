"""tools/kernel_ab.py: the mirrored run order, variant parsing, and the comparison of finished runs."""
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import kernel_ab  # noqa: E402


def test_run_order_mirrors_so_each_variant_sits_at_the_same_mean_position():
    order = kernel_ab.run_order(["old", "a", "b"], rounds=2)
    assert [n for n, _ in order] == ["old", "a", "b", "b", "a", "old"] * 2
    for name in ("old", "a", "b"):
        places = [i for i, (n, _) in enumerate(order) if n == name]
        assert sum(places) / len(places) == (len(order) - 1) / 2
        assert [i for n, i in order if n == name] == [0, 1, 2, 3]


@pytest.mark.parametrize("text", ["old", "=a", "old=", "a/b=x"])
def test_bad_variants_are_refused(text):
    with pytest.raises(Exception, match="variant"):
        kernel_ab.parse_variant(text)


def test_parse_variant_keeps_the_whole_kernel_path():
    assert kernel_ab.parse_variant("cz=/k/cz:/k/main") == ("cz", "/k/cz:/k/main")


def _run(path, tflops):
    """A bench JSON with flashgen at bf16 head dim 64, unmasked, seqlens 512 and 2048, both directions."""
    results = [{"impl": "flashgen", "direction": d, "tflops": t,
                "point": {"dtype": "bf16", "head_dim": 64, "causal": False, "batch": 1, "heads": 32,
                          "seqlen": s, "group": 1, "mask": "", "score_mod": ""}}
               for (s, d), t in tflops.items()]
    path.write_text(json.dumps({"results": results}))


def test_no_run_compares_the_runs_in_out(tmp_path, capsys):
    old = {(512, "fwd"): 100.0, (2048, "fwd"): 200.0, (512, "bwd"): 50.0, (2048, "bwd"): 80.0}
    _run(tmp_path / "old_0.json", old)
    _run(tmp_path / "old_1.json", {k: v * 1.02 for k, v in old.items()})
    _run(tmp_path / "new_0.json", {**old, (2048, "fwd"): 220.0})
    _run(tmp_path / "new_1.json", {**old, (2048, "fwd"): 224.4})
    assert kernel_ab.main(["--variant", "old=x", "--variant", "new=y", "--out", str(tmp_path), "--no-run",
                           "--table"]) == 0
    out = capsys.readouterr().out
    assert "== new / old" in out
    # fwd 2048: median new 222.2 over median old 202.0 = 1.100; 512: 100 / 101 = 0.990
    assert "| bf16 | 64 | none | 1 | 0.990 | 1.100 |" in out
    assert "bwd (2): median 0.990" in out


def test_no_run_names_missing_runs(tmp_path):
    _run(tmp_path / "old_0.json", {(512, "fwd"): 1.0})
    with pytest.raises(SystemExit, match="new_0.json"):
        kernel_ab.main(["--variant", "old=x", "--variant", "new=y", "--out", str(tmp_path), "--no-run"])


def test_dry_run_prints_each_run_with_its_kernel_path(tmp_path, capsys):
    assert kernel_ab.main(["--variant", "old=/k/main", "--variant", "cz=/k/cz:/k/main", "--out",
                           str(tmp_path / "ab"), "--dry-run", "--", "--dtype", "bf16"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == ("FLASHGEN_KERNEL_PATH=/k/cz:/k/main python -m flashgen bench --impl flashgen --dtype bf16 "
                        f"--json {tmp_path / 'ab' / 'cz_0.json'}")
    assert len(lines) == 4 and not (tmp_path / "ab").exists()


def test_bench_arguments_may_not_set_impl_or_json(tmp_path):
    with pytest.raises(SystemExit):
        kernel_ab.main(["--variant", "a=x", "--variant", "b=y", "--out", str(tmp_path), "--", "--impl", "fa4"])


def test_a_tree_goes_first_on_pythonpath_for_its_variant_only(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/base")
    assert kernel_ab.main(["--variant", "old=/k/main", "--variant", "pb=/k/pb", "--tree", "pb=/src/pb", "--out",
                           str(tmp_path), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("FLASHGEN_KERNEL_PATH=/k/main python -m")
    assert lines[1].startswith("cd /src/pb && FLASHGEN_KERNEL_PATH=/k/pb PYTHONPATH=/src/pb:/base python -m")
    assert lines[1].endswith(f"--json {tmp_path.resolve() / 'pb_0.json'}")


def test_a_tree_needs_its_variant(tmp_path):
    with pytest.raises(SystemExit):
        kernel_ab.main(["--variant", "a=x", "--variant", "b=y", "--tree", "c=/src", "--out", str(tmp_path)])
