"""The family declarations: enumeration, every pruning rule, priority order, names, ABI dtype."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from flashgen.spec import FAMILIES, default_kernels, family
from flashgen.spec.core import normalize_target, target_cc
from flashgen.spec.mem_eff_bwd import MemEffBwd
from flashgen.spec.mem_eff_fwd import MemEffFwd
from flashgen.spec.sm80_bwd import Sm80Bwd
from flashgen.spec.sm80_fwd import Sm80Fwd
from flashgen.spec.sm90_bwd import Sm90Bwd
from flashgen.spec.sm90_fwd import Sm90Fwd

ALL_RULES = [(cls, rule) for cls in FAMILIES.values() for rule in cls.RULES]


def test_candidates_are_the_full_cross_product():
    for cls in FAMILIES.values():
        expected = int(np.prod([len(v) for v in cls.AXES.values()]))
        candidates = list(cls.candidates())
        assert len(candidates) == expected == len(set(candidates))
        assert list(cls.AXES) == [f.name for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("cls,rule", ALL_RULES, ids=[f"{c.FAMILY}:{r.reason[:40]}" for c, r in ALL_RULES])
def test_every_rule_is_the_only_reason_some_candidate_is_dropped(cls, rule):
    """Each rule must matter: some candidate is kept if (and only if) that rule is removed."""
    others = [r for r in cls.RULES if r is not rule]
    rescued = [k for k in cls.candidates() if rule.applies(k) and not any(r.applies(k) for r in others)]
    assert rescued, f"rule never decides anything on its own: {rule.reason}"
    assert rule.reason and len(rule.reason) < 200


def test_default_sets_match_the_declared_rules():
    for cls in FAMILIES.values():
        kept = cls.default_set()
        assert all(k.pruned_by() is None for k in kept)
        assert len(kept) == sum(1 for k in cls.candidates() if k.pruned_by() is None)


def test_default_set_sizes_are_what_the_readme_says():
    assert len(MemEffFwd.default_set()) == 40
    assert len(MemEffBwd.default_set()) == 56
    assert len(Sm80Fwd.default_set()) == 8 + 4 + 4  # 2 dtypes x tiers 64, 128, 192, 256; + bias, + dropout: 2 dtypes x 64, 128
    # 2 dtypes x (64, 128, 192, 256 each with a 99 KB tile beside); + bias, + dropout: 2 dtypes x (64; 128 and its 99 KB tile)
    assert len(Sm80Bwd.default_set()) == 16 + 6 + 6
    # example 41 on plain 8.x+ targets: f32, and f16/bf16 at kMaxK 65536 only (the sm80 pair takes the rest)
    sm80 = [k for k in default_kernels() if k.runs_on("sm80")]
    assert len(sm80) == 30 + 16 + 28
    # + bias: 2 dtypes x (tiers 64, 128 x band, and q192 at 64); + sparse: 2 dtypes x tiers 64, 128;
    # + staged O: the unmasked k128 s2 tile's twin, 2 dtypes (the band one is built staged only);
    # + dropout and ALiBi: each 2 dtypes x tiers 64, 128 x band; + the unmasked k128 176-key tile, 2 dtypes
    assert len(Sm90Fwd.default_set()) == 40 + 10 + 4 + 2 + 8 + 8 + 2
    # + 80-query steps: 2 dtypes x 2 bands at 128; + the split head dim at 192: 2 dtypes x band x softcap
    assert len(Sm90Bwd.default_set()) == 24 + 4 + 12 + 4 + 8 + 8 + 8
    # + bias: 2 dtypes x 2 bands x (64, 128, 128 + softcap); + sparse: 2 dtypes x tiers 64, 128; + dropout and
    # ALiBi: each 2 dtypes x tiers 64, 128 x band
    # sm90a: the wgmma families beside example 41; the sm80 ones are not built there (sm90_* serve their calls)
    assert len([k for k in default_kernels() if k.runs_on("sm90a")]) == 68 + 74 + 68  # example 41, sm90_fwd, sm90_bwd
    assert len([k for k in default_kernels() if k.runs_on("sm90")]) == 30 + 16 + 28, "plain sm90 cannot build wgmma code"


@pytest.mark.parametrize("target", ["sm80", "sm86", "sm89", "sm90", "sm120"])
def test_plain_targets_from_sm80_on_build_only_the_catch_all_half_precision_example_41_kernels(target):
    """The sm80 pair serves aligned f16/bf16 there; what it does not take runs on kMaxK 65536."""
    for spec in (MemEffFwd, MemEffBwd):
        for k in spec.default_set():
            if k.arch != "sm80":
                continue
            wanted = k.dtype == "f32" or k.max_k == 65536
            assert k.runs_on(target) is wanted, (k.name, target)
            assert k.runs_on("sm90a"), k.name  # Hopper builds keep every tier: sm90_* take no bias with dropout


def test_sm90_forward_covers_dtypes_head_dims_and_masks():
    kernels = Sm90Fwd.default_set()
    for dtype in ("f16", "bf16"):
        for band in (False, True):
            assert {k.max_k for k in kernels if k.dtype == dtype and k.band == band} == {64, 96, 128, 192, 256}
            # head dims above 128: one key tile, the widest that fits shared memory with two stages
            assert {(k.max_k, k.block_n, k.stages) for k in kernels if k.max_k > 128 and k.dtype == dtype
                    and k.band == band} == {(192, 112, 2), (256, 80, 2)}
    assert all(k.runs_on("sm90a") and not k.runs_on("sm90") and not k.runs_on("sm80") for k in kernels)


def test_sm90_backward_covers_dtypes_head_dims_masks_and_softcap():
    """Head dim 96 runs on the 128 tier (TMA zero-fills the missing columns); each tier keeps the
    one query-step size whose dQ split and registers work out (the rules say why), and head dim 128
    an 80-query one beside it (plain instances only: dQ leaves transposed)."""
    kernels = Sm90Bwd.default_set()
    for dtype in ("f16", "bf16"):
        for band in (False, True):
            for softcap in (False, True):
                tiles = {(k.max_k, k.block_m, k.block_n) for k in kernels
                         if k.dtype == dtype and k.band == band and k.softcap == softcap}
                assert tiles == ({(64, 128, 128), (128, 64, 128), (192, 64, 64), (256, 64, 64)}
                                 | (set() if softcap else {(128, 80, 128)}))
    assert all(not (k.bias or k.sparse or k.dropout or k.score_mod) for k in kernels if k.block_m == 80)
    assert all(k.runs_on("sm90a") and not k.runs_on("sm90") for k in kernels)
    assert Sm90Bwd.params_dtype().itemsize == 1408, "the 128-byte-aligned tensor maps round Params up to 128"


def test_sm90_bias_instances_are_the_tiles_the_plain_calls_pick():
    """Bias is compiled in on the tiles the plain calls select, tiers 64 and 128 only, with and
    without the band mask (head dim 64: the 128-row tile, and the 192-row one without a band, whose
    band twin spills)."""
    for cls in (Sm90Fwd, Sm90Bwd):
        for dtype in ("f16", "bf16"):
            for band in (False, True):
                biased = [k for k in cls.default_set() if k.bias and k.dtype == dtype and k.band == band]
                assert {k.max_k for k in biased} == {64, 128}
                for k in biased:
                    twin = dataclasses.replace(k, bias=False)
                    staged = getattr(k, "staged_o", None) is not None and dataclasses.replace(twin, staged_o=True)
                    assert twin in cls.default_set() or staged in cls.default_set(), f"{k.name} has no plain twin"
    fwd = {(k.max_k, k.block_m, k.block_n, k.stages) for k in Sm90Fwd.default_set() if k.bias}
    assert fwd == {(64, 128, 128, 2), (64, 192, 128, 2), (128, 128, 128, 2)}
    assert not any(k.bias and k.band and k.block_m == 192 for k in Sm90Fwd.default_set())
    bwd = {(k.max_k, k.softcap) for k in Sm90Bwd.default_set() if k.bias}
    assert bwd == {(64, False), (128, False), (128, True)}
    assert "sm90_fwd_f16_k64_q128x128_s2_band_bias_sm90a" in [k.name for k in Sm90Fwd.default_set()]
    assert "sm90_bwd_bf16_k128_q64x128_s2_band_softcap_bias_sm90a" in [k.name for k in Sm90Bwd.default_set()]
    bias = Sm90Bwd.default_set()[-1]
    assert bias.cpp_type.endswith(", true, true, true, false, false, flashgen::sm90::NoScoreMod>")
    assert bias.name.endswith("_band_softcap_bias_sm90a")


def test_sm90_alibi_instances_are_the_default_tile_of_each_tier_and_band():
    """ALiBi is compiled in on tiers 64 and 128, both bands and dtypes, on the first tile of a plain call of
    the tier that a mod may take (the backward's 80-query tile may not), never beside bias, block-mask
    lists or soft-capping; its name carries the mod."""
    for cls in (Sm90Fwd, Sm90Bwd):
        modded = [k for k in cls.default_set() if k.score_mod]
        assert {k.score_mod for k in modded} == {"alibi"} and len(modded) == 8
        assert {(k.dtype, k.max_k, k.band) for k in modded} == {(d, t, b) for d in ("f16", "bf16") for t in (64, 128)
                                                                for b in (False, True)}
        assert not any(k.bias or k.sparse or getattr(k, "softcap", False) for k in modded)
        for k in modded:
            plain = dataclasses.replace(k, score_mod="")
            staged = hasattr(k, "staged_o") and dataclasses.replace(plain, staged_o=True)
            assert plain in cls.default_set() or staged in cls.default_set(), k.name
            first = next(p for p in cls.default_set() if (p.dtype, p.max_k, p.band) == (k.dtype, k.max_k, k.band)
                         and not (p.bias or p.sparse or getattr(p, "softcap", False) or p.score_mod or p.dropout)
                         and p.block_m != 80)
            assert (first.block_m, first.block_n, first.stages) == (k.block_m, k.block_n, k.stages)
            assert "_mod_alibi_" in k.name and k.name.replace("_mod_alibi", "") == plain.name
            assert k.cpp_type.endswith(", ScoreMod_alibi>") and plain.cpp_type.endswith(", flashgen::sm90::NoScoreMod>")


@pytest.mark.parametrize("cls", [MemEffFwd, MemEffBwd])
def test_default_set_covers_dtypes_head_dims_and_dropout_on_sm80(cls):
    kernels = [k for k in cls.default_set() if k.arch == "sm80"]
    for dtype in ("f32", "f16", "bf16"):
        for dropout in (False, True):
            tiers = {k.max_k for k in kernels if k.dtype == dtype and k.dropout == dropout and k.aligned}
            assert 65536 in tiers and min(tiers) <= 64, (dtype, dropout, tiers)
            assert any(not k.aligned for k in kernels if k.dtype == dtype and k.dropout == dropout)


def test_backward_half_tiers_and_sm86_fallback():
    """f16/bf16 backward has kMaxK 32/64/96/128/65536; kMaxK 128 has both the 128x128 tile and
    a 128x64 fallback (the one that fits sm86/sm89's 99 KB, checked against the compiler in test_build)."""
    for dtype in ("f16", "bf16"):
        for dropout in (False, True):
            ks = [k for k in MemEffBwd.default_set()
                  if k.arch == "sm80" and k.dtype == dtype and k.dropout == dropout and k.aligned
                  and not k.block_aligned]
            assert sorted({k.max_k for k in ks}) == [32, 64, 96, 128, 65536]
            k128 = sorted((k.block_i, k.block_j) for k in ks if k.max_k == 128)
            assert k128 == [(128, 64), (128, 128)]
            # preload wherever the template allows it
            assert all(k.preload == (k.max_k <= k.block_i) for k in ks)
            # and a block-aligned twin of every preload kernel for the training fast path (no dropout)
            twins = {(k.block_i, k.block_j, k.max_k) for k in MemEffBwd.default_set()
                     if k.arch == "sm80" and k.dtype == dtype and k.dropout == dropout and k.block_aligned}
            assert twins == (set() if dropout else {(k.block_i, k.block_j, k.max_k) for k in ks if k.preload})


def test_rules_encode_the_templates_static_asserts():
    bad_preload = MemEffBwd("sm80", "f32", True, False, True, 64, 64, 64, False)
    assert "static_assert" in bad_preload.pruned_by().reason
    no_bf16_on_turing = MemEffFwd("sm75", "bf16", True, 64, 64, 64, False, True)
    assert "bf16" in no_bf16_on_turing.pruned_by().reason


def test_priority_order():
    ks = [k for k in MemEffBwd.default_set() if k.arch == "sm80" and k.dtype == "f16"]
    pos = {k.name: i for i, k in enumerate(ks)}
    first_unaligned = min(pos[k.name] for k in ks if not k.aligned)
    assert all(pos[k.name] < first_unaligned for k in ks if k.aligned)
    aligned = [k for k in ks if k.aligned]
    general = [k for k in aligned if not k.block_aligned]
    first_dropout = min(i for i, k in enumerate(general) if k.dropout)
    assert not any(k.dropout for k in general[:first_dropout])
    # block-aligned kernels first (the runtime offers them only calls with M % I == N % J == 0)
    first_general = min(i for i, k in enumerate(aligned) if not k.block_aligned)
    assert all(k.block_aligned for k in aligned[:first_general])
    assert not any(k.block_aligned for k in aligned[first_general:])
    for block_aligned in (True, False):
        no_dropout = [k for k in aligned if not k.dropout and k.block_aligned == block_aligned]
        assert [k.max_k for k in no_dropout] == sorted(k.max_k for k in no_dropout)
        k128 = [(k.block_i, k.block_j) for k in no_dropout if k.max_k == 128]
        assert k128 == [(128, 128), (128, 64)]  # larger tile first; the runtime skips it where smem is short


def test_names_are_unique_readable_and_stable():
    names = [k.name for k in default_kernels()]
    assert len(names) == len(set(names))
    assert "mem_eff_bwd_f16_aligned_b128x64_k128_preload_dropout_sm80" in names
    assert "mem_eff_fwd_bf16_aligned_q32x128_k65536_dropout_bias_sm80" in names
    assert all(n.isidentifier() for n in names)


def test_cpp_type_spells_the_template():
    k = MemEffBwd("sm80", "bf16", True, True, True, 128, 64, 96, False)
    assert k.cpp_type == ("AttentionBackwardKernel<cutlass::arch::Sm80, cutlass::bfloat16_t, "
                          "true, true, true, 128, 64, 96, false>")
    f = MemEffFwd("sm75", "f32", False, 32, 128, 65536, True, True)
    assert f.cpp_type == "AttentionKernel<float, cutlass::arch::Sm75, false, 32, 128, 65536, true, true>"


def test_arch_ranges():
    k75 = MemEffFwd("sm75", "f16", True, 64, 64, 64, False, True)
    k80 = MemEffFwd("sm80", "f32", True, 64, 64, 64, False, True)  # (f16 below kMaxK 65536: sm90a only)
    assert k75.runs_on("sm75") and not k75.runs_on("sm80")
    for t in ("sm80", "sm_86", "sm89", "sm90", "sm90a", "sm100", "sm120", "sm121"):
        assert k80.runs_on(t), t
    assert not k80.runs_on("sm75")
    assert target_cc("sm_90a") == 90 and normalize_target("SM_90A") == "sm90a"
    with pytest.raises(ValueError, match="not an SM target"):
        target_cc("ampere")


def test_params_dtype_mirrors_c_layout():
    fwd, bwd = MemEffFwd.params_dtype(), MemEffBwd.params_dtype()
    # Sizes measured with the compiler (NOTES: 224 / 400 bytes without HAS_PYTORCH; the Philox
    # state adds 16).  test_build compiles static_asserts on every offset against CUTLASS.
    assert fwd.itemsize == 240 and bwd.itemsize == 416
    assert fwd.fields["causal_diagonal_offset"][1] == 56      # u32 after 7 pointers
    assert fwd.fields["output_ptr"][1] == 64                  # realigned to 8
    assert bwd.fields["rng_engine_inputs_seed"][1] == 192     # after the int8 multiplier at 188
    assert bwd.fields["num_splits_key"][0] == np.dtype("<i2")


def test_family_lookup():
    assert family("mem_eff_fwd") is MemEffFwd
    with pytest.raises(ValueError, match="unknown kernel family 'nope'"):
        family("nope")


def test_sm90_staged_o_instances_are_the_plain_k128_tiles():
    """Staged O only on the plain two-stage 128-row tiles of head dim 128: unmasked ones beside a
    twin without the path (which serves calls of more key blocks), the band one alone."""
    kernels = Sm90Fwd.default_set()
    staged = [k for k in kernels if k.staged_o]
    assert {(k.dtype, k.max_k, k.block_m, k.block_n, k.stages, k.band) for k in staged} == {
        (d, 128, 128, 128, 2, band) for d in ("f16", "bf16") for band in (False, True)}
    assert not any(k.bias or k.sparse or k.dropout for k in staged)
    for k in staged:
        twin = dataclasses.replace(k, staged_o=False)
        assert (twin in kernels) == (not k.band), k.name
        assert k.name.endswith("_staged_o_sm90a") and k.cpp_type.endswith(", false, true, false, flashgen::sm90::NoScoreMod>")
        if not k.band:
            assert kernels.index(k) < kernels.index(twin), "the staged tile is tried before its twin"
    assert "staged_max_key_blocks" in [c.name for c in Sm90Fwd.CONSTANTS]
