"""The runtime's first-fit selection and its explanations, and the backward's key-split count and
workspace size, over fake manifests (tests/runtime_fakes.py), without a GPU and without CuPy."""
from __future__ import annotations

import math

import pytest

from flashgen.errors import UnsupportedError
from flashgen.runtime import select
from flashgen.runtime.arch import DeviceInfo
from flashgen.runtime.registry import Registry
from flashgen.runtime.select import Selector, num_splits_key, rejection, workspace_bytes
from flashgen.spec.mem_eff_bwd import MemEffBwd

from runtime_fakes import (
    A100, ACCUM, BWD_PRIORITY, F16_K128, F16_K128_BIG, F16_K128_DROP, F16_K64, F16_K64_DROP, F16_K65536,
    F16_K65536_DROP, F16_UNALIGNED, F32_K64, F32_K65536, FWD_K128, FWD_K64, FWD_K64_DROP, FWD_UNALIGNED, H100,
    K128, K128_BIG, K64, RTX3090, RTX4090, binary, bwd, constants, fake_binary, req, write_build,
)

pytestmark = pytest.mark.usefixtures("cupy_is_never_imported", "block_cupy")


# === selection ============================================================================

@pytest.mark.parametrize("device,spec,target", [(H100, F16_K128_BIG, "sm90"), (A100, F16_K128_BIG, "sm80"),
                                                (RTX3090, F16_K128, "sm80"), (RTX4090, F16_K128, "sm80")],
                         ids=["H100", "A100", "RTX3090", "RTX4090"])
def test_head_dim_128_takes_the_largest_tile_that_fits(reg, device, spec, target):
    got = Selector(reg).select(req(head_dim=128, device=device))
    assert (got.name, got.target) == (spec.name, target)


def test_explain_says_why_the_big_tile_was_skipped_on_sm86(reg):
    rows = Selector(reg).explain(req(head_dim=128, device=RTX3090))
    assert [name for name, _, _ in rows] == [k.name for k in BWD_PRIORITY]
    verdict = {name: why for name, _, why in rows}
    assert verdict[F16_K128.name] == "selected"
    big = verdict[F16_K128_BIG.name]
    assert "shared memory" in big and "154112" in big and "101376" in big and RTX3090.name in big
    assert "kMaxK 64 < head dim 128" in verdict[F16_K64.name]
    assert "dtype f32" in verdict[F32_K64.name] and "f16" in verdict[F32_K64.name]
    assert verdict[F16_K65536.name].startswith("not tried")  # would fit, but comes later
    assert [why for *_, why in rows].count("selected") == 1


@pytest.mark.parametrize("K,Kv", [(256, 256), (160, 64), (64, 160), (128, 129)])
def test_large_head_dims_take_the_k65536_kernel(reg, K, Kv):
    for device in (H100, RTX3090):
        assert Selector(reg).select(req(head_dim=K, head_dim_value=Kv, device=device)).spec == F16_K65536


def test_small_head_dim_takes_the_k64_kernel(reg):
    for K in (1, 8, 63, 64):
        assert Selector(reg).select(req(head_dim=K)).spec == F16_K64
    assert Selector(reg).select(req(head_dim=65)).spec == F16_K128_BIG


def test_alignment_4_skips_the_aligned_kernels(reg):
    sel = Selector(reg)
    r = req(head_dim=64, alignment=4)
    assert sel.select(r).spec == F16_UNALIGNED
    verdict = {name: why for name, _, why in sel.explain(r)}
    for k in (F16_K64, F16_K128_BIG, F16_K128, F16_K65536):
        assert "needs 8-element alignment" in verdict[k.name] and "has 4" in verdict[k.name]
    assert verdict[F16_UNALIGNED.name] == "selected"
    assert select.required_alignment(binary(reg, F16_K64)) == 8
    assert select.required_alignment(binary(reg, F16_UNALIGNED)) == 4
    # f32 kernels only ever need 4 elements (16 bytes)
    assert sel.select(req(dtype="f32", head_dim=64, alignment=4)).spec == F32_K64


@pytest.mark.parametrize("K,spec", [(64, F16_K64_DROP), (128, F16_K128_DROP), (200, F16_K65536_DROP)])
def test_dropout_requests_skip_kernels_without_dropout(reg, K, spec):
    sel = Selector(reg)
    r = req(head_dim=K, dropout=True)
    assert sel.select(r).spec == spec
    verdict = {name: why for name, _, why in sel.explain(r)}
    for k in (F16_K64, F16_K128_BIG, F16_K128, F16_K65536, F16_UNALIGNED):
        if k.max_k >= K:
            assert verdict[k.name] == "built without dropout"
    assert rejection(binary(reg, F16_K64), req(head_dim=64, dropout=True)) == "built without dropout"
    assert rejection(binary(reg, F16_K64_DROP), req(head_dim=64, dropout=False)) is None


def test_dtype_mismatch_is_a_rejection(reg):
    assert rejection(binary(reg, F32_K64), req(dtype="f16")) == "dtype f32, call is f16"
    assert rejection(binary(reg, F16_K64), req(dtype="f32")) == "dtype f16, call is f32"
    assert Selector(reg).select(req(dtype="f32", head_dim=64)).spec == F32_K64
    assert Selector(reg).select(req(dtype="f32", head_dim=100)).spec == F32_K65536
    with pytest.raises(UnsupportedError) as e:
        Selector(reg).select(req(dtype="bf16"))
    assert str(e.value).count("dtype f16, call is bf16") == 8
    assert str(e.value).count("dtype f32, call is bf16") == 2


def test_rejection_reasons_each_name_their_limit(reg):
    b = binary(reg, F16_K128_BIG)
    assert rejection(b, req(head_dim=128)) is None
    assert rejection(b, req(head_dim=128, head_dim_value=136)) == "kMaxK 128 < head dim 136"
    assert "4-element" not in rejection(b, req(head_dim=128, alignment=4))
    tiny = DeviceInfo(0, "tiny", 90, 1, 154111)
    assert rejection(b, req(head_dim=128, device=tiny)) == \
        "needs 154112 B of shared memory; tiny allows 154111 B per block"
    assert rejection(b, req(head_dim=128, device=DeviceInfo(0, "exact", 90, 1, 154112))) is None


def test_nothing_fits_lists_every_candidate_and_hints_at_padding(reg):
    r = req(head_dim=64, alignment=2, device=RTX3090)
    with pytest.raises(UnsupportedError) as e:
        Selector(reg).select(r)
    msg = str(e.value)
    assert "mem_eff_bwd" in msg and "alignment 2" in msg and RTX3090.name in msg and "sm_86" in msg
    lines = msg.splitlines()
    for name, target, why in Selector(reg).explain(r):
        assert why != "selected"
        assert f"  {name} ({target}): {why}" in lines
    assert sum(1 for line in lines if line.startswith("  mem_eff_bwd_")) == len(BWD_PRIORITY)
    assert "pad the head dim" in msg
    # a call that fails for another reason gets no padding hint
    with pytest.raises(UnsupportedError) as e:
        Selector(reg).select(req(dtype="bf16"))
    assert "pad" not in str(e.value)


def test_explain_marks_exactly_one_selected(reg):
    sel = Selector(reg)
    for r in (req(head_dim=64), req(head_dim=128, device=RTX3090), req(head_dim=512, dropout=True),
              req(alignment=4), req(dtype="f32", head_dim=32)):
        rows = sel.explain(r)
        verdicts = [why for *_, why in rows]
        assert verdicts.count("selected") == 1
        chosen = rows[verdicts.index("selected")]
        assert (chosen[0], chosen[1]) == (sel.select(r).name, sel.select(r).target)
        # everything before the chosen one was rejected for a reason
        assert all(not v.startswith("not tried") for v in verdicts[:verdicts.index("selected")])
    assert [why for *_, why in sel.explain(req(alignment=2))].count("selected") == 0


def test_decisions_are_cached_per_request(reg, monkeypatch):
    sel = Selector(reg)
    first = sel.select(req(head_dim=128))
    again = sel.select(req(head_dim=128))  # an equal, separately built request
    assert again is first

    def gone(*args, **kwargs):
        raise AssertionError("the cache should have answered")

    monkeypatch.setattr(reg, "for_device", gone)
    assert sel.select(req(head_dim=128)) is first
    with pytest.raises(AssertionError, match="cache"):
        sel.select(req(head_dim=128, device=RTX3090))  # a different device is a different request


def test_forward_selection(reg):
    sel = Selector(reg)
    fam = dict(family="mem_eff_fwd", bias=True)
    assert sel.select(req(head_dim=64, **fam)).spec == FWD_K64
    assert sel.select(req(head_dim=100, **fam)).spec == FWD_K128
    assert sel.select(req(head_dim=300, **fam)).spec == FWD_UNALIGNED
    assert sel.select(req(head_dim=64, alignment=4, **fam)).spec == FWD_UNALIGNED
    assert sel.select(req(head_dim=64, dropout=True, **fam)).spec == FWD_K64_DROP
    assert select.required_alignment(binary(reg, FWD_K64)) == 8
    assert select.required_alignment(binary(reg, FWD_UNALIGNED)) == 4


@pytest.mark.parametrize("M,N,varlen,expected", [
    (256, 256, False, (128, 128)),
    (256, 192, False, (128, 64)),
    (200, 256, False, (8, 128)),
    (7, 1, False, (1, 1)),
    (256, 256, True, (0, 0)),  # cu_seqlens: the kernels see per-sequence lengths
])
def test_seq_multiples(M, N, varlen, expected):
    assert select.seq_multiples(M, N, varlen) == expected


def test_block_aligned_kernels_only_serve_block_multiples(tmp_path):
    aligned_twin = MemEffBwd(arch="sm80", dtype="f16", aligned=True, dropout=False, preload=True, block_i=128,
                             block_j=64, max_k=128, block_aligned=True)
    general = bwd(block_i=128, block_j=64, max_k=128)
    write_build(tmp_path, [(s, {"sm90": constants(s, 91648)}) for s in (general, aligned_twin)])
    sel = Selector(Registry([tmp_path]))
    assert sel.select(req(head_dim=128, seq_multiples=(128, 64))).spec == aligned_twin  # first in priority
    assert sel.select(req(head_dim=128, seq_multiples=(128, 128))).spec == aligned_twin
    for multiples in ((64, 128), (128, 32), (0, 0)):  # M % 128, N % 64 or varlen: the general kernel
        r = req(head_dim=128, seq_multiples=multiples)
        assert sel.select(r).spec == general
        assert "block-aligned: needs M % 128 == N % 64 == 0" in rejection(binary(Registry([tmp_path]), aligned_twin),
                                                                             r)


# === split keys and workspace =============================================================

def test_constants_are_what_the_fixture_claims():
    assert (K64.constants["needs_accum_grad_k"], K64.constants["needs_accum_grad_v"]) == (0, 0)
    assert (ACCUM.constants["needs_accum_grad_k"], ACCUM.constants["needs_accum_grad_v"]) == (1, 1)
    assert K128_BIG.constants["min_blocks_per_sm"] == 0


@pytest.mark.parametrize("b,bh,expected", [
    (K64, 396, 1),       # 132 SMs * 3 blocks: B*H already fills the GPU
    (K64, 400, 1),
    (K64, 5000, 1),
    (K64, 395, 16384),   # one block short of a full wave: every key block gets a block
    (K64, 1, 16384),     # 2^20 keys / 64
    (K128, 132, 1),      # 1 block/SM
    (K128, 131, 16384),
    (K128_BIG, 1, 8192),  # 2^20 keys / 128; kMinBlocksPerSm 0 still counts one block per SM
    (K128_BIG, 200, 1),
])
def test_split_keys_fill_the_device(b, bh, expected):
    assert num_splits_key(b, bh, 1, 1 << 20, H100) == expected
    assert num_splits_key(b, 1, bh, 1 << 20, H100) == expected  # only B*H matters


@pytest.mark.parametrize("N,expected", [(1, 1), (64, 1), (65, 2), (1000, 16), (1024, 16), (1025, 17)])
def test_split_keys_never_exceed_the_key_blocks(N, expected):
    assert num_splits_key(K64, 1, 1, N, H100) == expected
    assert num_splits_key(ACCUM, 1, 1, N, H100) == expected
    assert num_splits_key(K128_BIG, 1, 1, N, H100) == min(expected, math.ceil(N / 128))


def test_split_keys_follow_the_device():
    # 100 (batch, head) pairs fill an RTX 3090 (82 SMs, 1 block each) but not an H100 (132)
    assert num_splits_key(K128, 100, 1, 4096, RTX3090) == 1
    assert num_splits_key(K128, 100, 1, 4096, H100) == 64  # 4096 keys / 64


@pytest.mark.parametrize("bh,capped", [
    (1, 200),   # 200 // 1 caps the dK/dV workspace
    (2, 100),
    (20, 10),   # 200 // 20
    (150, 1),   # 200 // 150 = 1
    (300, 1),   # 200 // 300 = 0 -> still one block per (batch, head)
])
def test_split_keys_are_capped_when_dk_dv_use_the_workspace(bh, capped):
    # N = 2^16 keys: the int32 workspace cap (below) allows 511 splits at head dim 64, so it never binds here
    assert num_splits_key(ACCUM, bh, 1, 1 << 16, H100, 64, 64) == capped
    assert num_splits_key(K64, bh, 1, 1 << 16, H100) == 1024  # no dK/dV workspace: no cap


def test_split_keys_keep_the_kernels_int32_workspace_offsets():
    # workspace_elements_gk/gv = splits * align(N, 64) * align(K, 64) is int32 in the kernel
    assert num_splits_key(ACCUM, 1, 1, 1 << 20, H100, 256, 256) == (2**31 - 1) // ((1 << 20) * 256)  # 7
    assert num_splits_key(ACCUM, 1, 1, 1 << 20, H100) == (2**31 - 1) // ((1 << 20) * 64)             # 31


def test_split_keys_disabled_means_one():
    off = fake_binary(F16_K64, enable_split_keys=0)
    for bh, n in ((1, 1 << 20), (8, 4096), (1000, 64)):
        assert num_splits_key(off, bh, 1, n, H100) == 1
    assert num_splits_key(fake_binary(F16_K65536, enable_split_keys=0), 1, 1, 1 << 20, H100) == 1


def test_split_keys_fit_the_int16_field():
    big = DeviceInfo(0, "huge", 90, 100000, 232448)
    assert num_splits_key(K64, 1, 1, 1 << 30, big) == 32767


# Params::workspace_size() = B * H * align_up(gk + gv + gq, 4) * sizeof(float), with
#   gk = splits * align_up(N, J) * align_up(K, I)    if kNeedsAccumGradK else 0
#   gv = splits * align_up(N, J) * align_up(Kv, I)   if kNeedsAccumGradV else 0
#   gq = ceil(M / I) * ceil(K, GradQ tile N) * sizeof(GradQTempStorage) / sizeof(float)
@pytest.mark.parametrize("b,shape,splits,expected", [
    # 128x64, dQ only: gq = ceil(100/128)=1 * ceil(96/64)=2 * 32784/4 = 16392; 2*3*16392*4
    (K128, (2, 3, 100, 70, 96, 80), 1, 393408),
    (K128, (2, 3, 100, 70, 96, 80), 5, 393408),  # no dK/dV in the workspace: splits do not matter
    # 128x64: M and K exact multiples: 2 blocks * 2 cols * 8196 = 32784; 1*1*32784*4
    (K128, (1, 1, 256, 256, 128, 128), 1, 131136),
    # 128x128 (GradQ tile 128): 3 blocks * 1 col * 65552/4 = 49164; 2*4*49164*4
    (K128_BIG, (2, 4, 300, 200, 128, 128), 2, 1573248),
    # 64x64 with dK/dV: gk = 3*128*64 = 24576 (K=40 -> 64), gv = 3*128*128 = 49152 (Kv=72 -> 128),
    # gq = ceil(130/64)=3 * ceil(40/64)=1 * 16400/4 = 12300; sum 86028; 1*2*86028*4
    (ACCUM, (1, 2, 130, 70, 40, 72), 3, 688224),
    # same with one split: 8192 + 16384 + 12300 = 36876; 1*2*36876*4
    (ACCUM, (1, 2, 130, 70, 40, 72), 1, 295008),
    # 64x64 with dK/dV, exact multiples: gk = gv = 2*128*64 = 16384, gq = 2*1*4100 = 8200; 3*1*40968*4
    (ACCUM, (3, 1, 128, 128, 64, 64), 2, 491616),
    # 64x64 dQ only, M = 1: gq = 1 * ceil(65/64)=2 * 4100 = 8200; 1*1*8200*4
    (K64, (1, 1, 1, 1, 65, 65), 1, 32800),
])
def test_workspace_matches_params_workspace_size(b, shape, splits, expected):
    B, H, M, N, K, Kv = shape
    assert workspace_bytes(b, B, H, M, N, K, Kv, splits) == expected


def test_workspace_rounds_each_batch_head_to_16_bytes():
    # Synthetic GradQTempStorage of 16404 B (real ones are multiples of 16) so that the
    # per-(batch, head) element count is not a multiple of 4: 1 * 1 * 16404 / 4 = 4101 -> 4104.
    odd = fake_binary(F16_K64, grad_q_temp_storage_bytes=16404)
    assert workspace_bytes(odd, 1, 1, 64, 64, 64, 64, 1) == 4104 * 4
    assert workspace_bytes(odd, 2, 3, 64, 64, 64, 64, 1) == 2 * 3 * 4104 * 4
    # C++ multiplies before dividing by sizeof(float): 3 * 16402 / 4 = 12301 -> 12304 (not 3 * 4100)
    odder = fake_binary(F16_K64, grad_q_temp_storage_bytes=16402)
    assert workspace_bytes(odder, 1, 1, 3 * 64, 64, 64, 64, 1) == 12304 * 4


def test_no_accumulation_means_no_workspace():
    none = fake_binary(F16_K64, needs_accum_grad_q=0, needs_accum_grad_k=0, needs_accum_grad_v=0)
    assert workspace_bytes(none, 4, 8, 1000, 1000, 64, 64, 4) == 0
