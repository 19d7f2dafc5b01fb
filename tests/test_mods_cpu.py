"""The mods language (flashgen/mods.py): parsing, the C++ and NumPy translations, digests, binding
captured tensors, mods files and the `flashgen mods` command; no GPU."""
from __future__ import annotations

import numpy as np
import pytest
from click.testing import CliRunner

from flashgen.cli import main
from flashgen.mods import BUILTIN_MODS, MaskMod, ModError, ScoreMod, TensorSpec, load_mods
from flashgen.runtime.block_masks import block_mask

RNG = np.random.default_rng(7)


def indices(B, H, M, N):
    return (np.arange(B)[:, None, None, None], np.arange(H)[None, :, None, None],
            np.arange(M)[None, None, :, None], np.arange(N)[None, None, None, :])


def test_builtins_translate_to_cpp():
    assert BUILTIN_MODS["alibi"].cpp() == "(score - (slope(h) * abs((q_idx - kv_idx))))"
    assert BUILTIN_MODS["document"].cpp() == "(doc(b, q_idx) == doc(b, kv_idx))"
    assert BUILTIN_MODS["softcap"].cpp() == "(cap(0) * tanhf((score / cap(0))))"
    assert ScoreMod("score * 0.5 + 1e-3 * kv_idx", grad="0.5").cpp() == "((score * 0.5f) + (1e-3f * kv_idx))"
    assert MaskMod("!(q_idx < kv_idx) ? q_idx % 2 == 0 : 1 > 0").cpp() == \
        "(!((q_idx < kv_idx)) ? ((q_idx % 2) == 0) : (1 > 0))"


def test_builtin_functions_match_numpy_references():
    B, H, M, N = 2, 3, 37, 53
    b, h, q, k = indices(B, H, M, N)
    score = RNG.standard_normal((B, H, M, N))
    slope = RNG.random(H).astype(np.float32)
    got = BUILTIN_MODS["alibi"].function({"slope": slope})(b, h, q, k, score=score)
    np.testing.assert_allclose(got, score - slope[None, :, None, None] * np.abs(np.arange(M)[:, None] - np.arange(N)))
    doc = np.sort(RNG.integers(0, 4, (B, N))).astype(np.int32)
    got = BUILTIN_MODS["document"].function({"doc": doc})(b, h, q, k)
    want = doc[:, None, :M, None] == doc[:, None, None, :]
    assert np.array_equal(np.broadcast_to(got, (B, H, M, N)), np.broadcast_to(want, (B, H, M, N)))
    prefix = np.array([0, 10], dtype=np.int32)
    got = BUILTIN_MODS["prefix_lm"].function({"prefix": prefix})(b, h, q, k)
    want = (np.arange(N) < prefix[:, None, None, None]) | (np.arange(N) <= np.arange(M)[:, None])
    assert np.array_equal(np.broadcast_to(got, want.shape), want)
    cap = np.array([5.0], dtype=np.float32)
    got = BUILTIN_MODS["softcap"].function({"cap": cap})(b, h, q, k, score=score)
    np.testing.assert_allclose(got, 5.0 * np.tanh(score / 5.0), rtol=1e-6)


def test_integer_division_and_remainder_truncate_toward_zero_as_in_c():
    f = MaskMod("(q_idx - kv_idx) / 3 == -1 && (q_idx - kv_idx) % 3 == -2").function(xp=np)
    q, k = np.arange(10)[:, None], np.arange(10)[None, :]
    diff = q - k
    want = (np.trunc(diff / 3) == -1) & (np.fmod(diff, 3) == -2)  # C: -5 / 3 == -1, -5 % 3 == -2
    assert np.array_equal(f(0, 0, q, k), want) and want.any()


@pytest.mark.parametrize("mod,where,message", [
    (MaskMod("q_idx >= kv_idx + foo"), "line 1, column 19", "unknown name 'foo'"),
    (MaskMod("q_idx >=\n  (kv_idx"), "line 2, column 10", "expected ')', found the end"),
    (MaskMod("q_idx >= kv_idx kv_idx"), "line 1, column 17", "expected an operator or the end"),
    (MaskMod("q_idx = kv_idx"), "line 1, column 7", "unexpected character '='"),
    (MaskMod("q_idx >= kv_idx;"), "line 1, column 16", "unexpected character ';'"),
    (MaskMod("doc[b] == 0", tensors={"doc": "i32[B, N]"}), "line 1, column 1", "2 index(es), got 1"),
    (MaskMod("doc == 0", tensors={"doc": "i32[B, N]"}), "line 1, column 1", "index it, doc[...]"),
    (MaskMod("max(q_idx) > 0"), "line 1, column 1", "max takes 2 argument(s), got 1"),
    (MaskMod("q_idx + kv_idx"), "line 1, column 1", "a mask mod must be boolean"),
    (MaskMod("score > 0"), "line 1, column 1", "unknown name 'score'"),
    (ScoreMod("score % 2", grad="1"), "line 1, column 1", "% takes integers"),
    (ScoreMod("score *", grad="1"), "line 1, column 8", "expected a number, a name or '('"),
])
def test_malformed_expressions_are_rejected_with_line_and_column(mod, where, message):
    with pytest.raises(ModError) as e:
        mod.cpp("m")
    assert where in str(e.value) and message in str(e.value)
    assert str(e.value).splitlines()[-1].strip() == "^"  # the caret under the place


@pytest.mark.parametrize("tensors,message", [
    ({"doc": "f33[B]"}, "tensor spec 'f33[B]' is not dtype[dims]"),
    ({"doc": "i32[B, X]"}, "tensor spec 'i32[B, X]'"),
    ({"doc": "i32 B"}, "tensor spec 'i32 B'"),
    ({"q_idx": "i32[B]"}, "must be an identifier that is not an index name"),
    ("doc", "tensors must be a dict"),
])
def test_bad_tensor_declarations(tensors, message):
    with pytest.raises(ModError, match=message.replace("[", r"\[").replace("]", r"\]")):
        MaskMod("q_idx >= kv_idx", tensors=tensors).cpp()


def test_specs_parse_sizes_and_names():
    assert TensorSpec.parse("f16[B, 4, N]", "x") == TensorSpec("f16", ("B", 4, "N"))
    assert str(TensorSpec.parse(" i64[ H ] ", "x")) == "i64[H]"


def test_a_score_mod_needs_its_derivative():
    with pytest.raises(ModError, match="grad= .* is required; gradients into captured tensors are not computed"):
        ScoreMod("score * 2").digest("twice")
    with pytest.raises(ModError, match="ScoreMod twice grad, line 1, column 1: unknown name 'dscore'"):
        ScoreMod("score * 2", grad="dscore").digest("twice")


def test_digests_follow_what_compiles_not_spelling():
    base = ScoreMod("score - slope[h] * abs(q_idx - kv_idx)", tensors={"slope": "f32[H]"}, grad="1")
    assert base.digest() == BUILTIN_MODS["alibi"].digest()
    assert ScoreMod("score-slope[h]*abs(q_idx-kv_idx)", tensors={"slope": "f32[ H ]"}, grad=" 1").digest() == \
        base.digest()
    for other in (ScoreMod("score + slope[h] * abs(q_idx - kv_idx)", tensors={"slope": "f32[H]"}, grad="1"),
                  ScoreMod("score - slope[h] * abs(q_idx - kv_idx)", tensors={"slope": "f16[H]"}, grad="1"),
                  ScoreMod("score - slope[h] * abs(q_idx - kv_idx)", tensors={"slope": "f32[H]"}, grad="1.0")):
        assert other.digest() != base.digest()


def test_captured_tensors_are_checked_before_anything_runs():
    mod = BUILTIN_MODS["document"]
    sizes = dict(B=2, H=4, M=16, N=32)
    ok = np.zeros((2, 32), dtype=np.int32)
    assert mod.bind({"doc": ok}, sizes)["doc"] is ok
    with pytest.raises(ModError, match=r"captures \['doc'\]; got none"):
        mod.bind({}, sizes)
    with pytest.raises(ModError, match=r"captures \['doc'\]; got \['doc', 'extra'\]"):
        mod.bind({"doc": ok, "extra": ok}, sizes)
    with pytest.raises(TypeError, match=r"tensor 'doc' must be int32 \(i32\[B, N\]\), got int64"):
        mod.bind({"doc": ok.astype(np.int64)}, sizes)
    with pytest.raises(ModError, match=r"declared i32\[B, N\] \(B=2, N=32\); got shape \(2, 31\)"):
        mod.bind({"doc": ok[:, :31]}, sizes)


def same_lists(a, b):
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "partial_bits",
                 "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name


def test_a_mask_mod_derives_the_block_mask_of_the_same_mask():
    B, H, M, N = 2, 1, 300, 500
    doc = np.sort(RNG.integers(0, 5, (B, N))).astype(np.int32)
    by_hand = block_mask(lambda b, h, q, k: doc[b, q] == doc[b, k], B, H, M, N, device="cpu")
    same_lists(block_mask(BUILTIN_MODS["document"].function({"doc": doc}), B, H, M, N, device="cpu"), by_hand)
    # the mod itself, by its built-in name or as a declaration, its tensors bound by block_mask
    same_lists(block_mask("document", B, H, M, N, mod_tensors={"doc": doc}, device="cpu"), by_hand)
    same_lists(block_mask(MaskMod("doc[b, q_idx] == doc[b, kv_idx]", tensors={"doc": "i32[B, N]"}), B, H, M, N,
                          mod_tensors={"doc": doc}, device="cpu"), by_hand)


@pytest.mark.parametrize("M,N,block", [(1, 1, (128, 128)), (7, 129, (16, 32)), (1000, 300, (128, 128))])
def test_every_builtin_mask_mod_against_its_dense_truth(M, N, block):
    B, H = 3, 2
    q, kv = np.arange(M)[:, None], np.arange(N)[None, :]
    prefix = RNG.integers(0, N + 1, B).astype(np.int32)
    window = np.array([max(1, M // 3)], dtype=np.int32)
    cases = {"causal": ({}, np.broadcast_to(kv <= q, (B, H, M, N))),
             "prefix_lm": ({"prefix": prefix},
                           np.broadcast_to((kv < prefix[:, None, None, None]) | (kv <= q), (B, H, M, N))),
             "sliding_window": ({"window": window}, np.broadcast_to((kv <= q) & (q - kv < window[0]), (B, H, M, N)))}
    # a mod of one's own over the head index and a per-(batch, key) tensor
    own = MaskMod("kv_idx % (h + 2) != 0 && keep[b, kv_idx]", tensors={"keep": "bool[B, N]"})
    keep = RNG.random((B, N)) < 0.7
    own_truth = ((kv % (np.arange(H)[None, :, None, None] + 2)) != 0) & keep[:, None, None, :]
    for mod, (tensors, truth) in [*cases.items(), (own, ({"keep": keep}, np.broadcast_to(own_truth, (B, H, M, N))))]:
        bm = block_mask(mod, B, H, M, N, block=block, mod_tensors=tensors, device="cpu")
        dense = bm.to_dense(np.float32) == 0
        assert np.array_equal(dense, truth), mod


class FakeInt32(list):
    """Passes a declaration's dtype and shape checks without being a NumPy array (as a GPU array would)."""

    def __init__(self, a):
        super().__init__(a.tolist())
        self.dtype, self.shape = a.dtype, a.shape


def test_a_mask_mod_in_block_mask_refuses_what_it_cannot_run():
    B, H, M, N = 2, 1, 16, 32
    doc = np.zeros((B, N), dtype=np.int32)
    with pytest.raises(ValueError, match=r"'alibi' is not a built-in mask mod \(causal, document, prefix_lm, "
                                         r"sliding_window\)"):
        block_mask("alibi", B, H, M, N, device="cpu")
    with pytest.raises(ValueError, match="'doc' is not a built-in mask mod"):
        block_mask("doc", B, H, M, N, device="cpu")
    with pytest.raises(TypeError, match="a ScoreMod changes scores.*score_mod="):
        block_mask(BUILTIN_MODS["alibi"], B, H, M, N, device="cpu")
    with pytest.raises(TypeError, match="mod_tensors go with a mask mod"):
        block_mask(lambda b, h, q, k: q >= k, B, H, M, N, mod_tensors={"doc": doc}, device="cpu")
    with pytest.raises(ModError, match=r"captures \['doc'\]; got none"):
        block_mask("document", B, H, M, N, device="cpu")
    with pytest.raises(ModError, match=r"declared i32\[B, N\] \(B=2, N=32\); got shape \(2, 16\)"):
        block_mask("document", B, H, M, N, mod_tensors={"doc": doc[:, :16]}, device="cpu")
    with pytest.raises(TypeError, match=r"tensor 'doc' must be int32"):
        block_mask("document", B, H, M, N, mod_tensors={"doc": doc.astype(np.int64)}, device="cpu")
    with pytest.raises(TypeError, match="with device='cpu' the mod tensors must be NumPy arrays; 'doc' is a FakeInt32"):
        block_mask("document", B, H, M, N, mod_tensors={"doc": FakeInt32(doc)}, device="cpu")


def test_mods_files_load_by_name(tmp_path):
    good = tmp_path / "good.py"
    good.write_text("from flashgen.mods import MaskMod, ScoreMod\n"
                    "shifted = ScoreMod('score + 0.25 * h', grad='1')\n"
                    "causal = MaskMod('kv_idx <= q_idx')  # the built-in's own declaration\n"
                    "not_a_mod = 3\n")
    assert sorted(load_mods(good)) == ["causal", "shifted"]
    clash = tmp_path / "clash.py"
    clash.write_text("from flashgen.mods import MaskMod\ncausal = MaskMod('kv_idx < q_idx')\n")
    with pytest.raises(ModError, match="'causal' is a built-in mod with another declaration"):
        load_mods(clash)
    empty = tmp_path / "empty.py"
    empty.write_text("x = 1\n")
    with pytest.raises(ModError, match="binds no ScoreMod or MaskMod"):
        load_mods(empty)


def test_the_mods_command_shows_a_file_and_reports_errors(tmp_path):
    good = tmp_path / "good.py"
    good.write_text("from flashgen.mods import ScoreMod\nbias2 = ScoreMod('score + 2', grad='1')\n")
    result = CliRunner().invoke(main, ["mods", str(good)])
    assert result.exit_code == 0 and "bias2" in result.output and "(score + 2)" in result.output
    assert ScoreMod("score + 2", grad="1").digest()[:12] in result.output
    bad = tmp_path / "bad.py"
    bad.write_text("from flashgen.mods import MaskMod\nm = MaskMod('q_idx >= kv_idx +')\n")
    result = CliRunner().invoke(main, ["mods", str(bad)])
    assert result.exit_code == 1 and "MaskMod m, line 1, column 18: expected a number" in result.output
    assert "alibi" in CliRunner().invoke(main, ["mods"]).output
