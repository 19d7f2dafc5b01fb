"""The Ampere families' compiled-in attention bias without a GPU: which instances the default sets
build and why the others are pruned, which one serves a bias call on each faked 8.x/9.0 device (and
that a call no bias instance takes is refused with the reason, for example 41), the launch guard,
the Params fields a bias fills, and where a bias's pointer sits in a launch plan.  Nothing here
imports CuPy (tests/runtime_fakes.py's fakes stand in for arrays); tests/test_sm80_bias_layout.py checks
the kernels' fragment addressing, tests/test_sm80_bias_gpu.py the results."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from flashgen.runtime.families import sm80_bwd, sm80_fwd, sm90_bwd, sm90_common
from flashgen.runtime.registry import Registry
from flashgen.runtime.select import Request, Selector
from flashgen.spec import sm80_bwd as bwd_spec
from flashgen.spec import sm80_fwd as fwd_spec
from flashgen.spec.sm80_bwd import Sm80Bwd
from flashgen.spec.sm80_fwd import Sm80Fwd
from runtime_fakes import A100, H100, RTX3090, RTX4090, FakeArray, fake_call, qkv, write_build

SM86_OPTIN = 101376


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    """`import cupy` raises ImportError inside every test, even where CuPy is installed."""
    monkeypatch.setitem(sys.modules, "cupy", None)


def smem(k) -> int:
    if isinstance(k, Sm80Fwd):
        return fwd_spec.shared_bytes(k.max_k, k.block_m, k.block_n, k.stages, k.bias)
    return bwd_spec.shared_bytes(k.max_k, k.block_m, k.block_n, k.warps)


# === the spec ===================================================================================

def test_forward_bias_twins_per_dtype_on_tiers_64_and_128_within_80_kb():
    """A block's bias tile lands with its K tile in a ring of ceil(stages / 2) slots, counted in the 80 KB
    budget: at 64 the plain tile's four K/V slots stay, at 128 the twin takes 64 rows and three slots."""
    biased = [k for k in Sm80Fwd.default_set() if k.bias]
    assert [k.name for k in biased] == [
        "sm80_fwd_f16_k64_q128x64_s4_bias_sm80", "sm80_fwd_f16_k128_q64x64_s3_bias_sm80",
        "sm80_fwd_bf16_k64_q128x64_s4_bias_sm80", "sm80_fwd_bf16_k128_q64x64_s3_bias_sm80"]
    assert biased[0].cpp_type == "flashgen::sm80::FwdKernel<cutlass::half_t, 64, 128, 64, 4, true, false>"
    assert [smem(k) for k in biased[:2]] == [16384 + 4 * 8192 + 2 * 16384, 16384 + 3 * 16384 + 2 * 8192] == [81920] * 2
    assert fwd_spec.shared_bytes(128, 128, 64, 3, bias=True) > fwd_spec.CTA_SHARED_BUDGET
    assert fwd_spec.ring_slots(128, 128, 64, bias=True) == 2 and fwd_spec.ring_slots(128, 128, 64) == 3
    assert all(smem(k) <= fwd_spec.CTA_SHARED_BUDGET <= SM86_OPTIN for k in biased)


def test_backward_bias_twins_share_their_plain_tiles_shared_memory():
    """The bias goes through the dS^T buffers, so each twin has its plain tile's bytes: the 64 tier's
    (which sm86/sm89 hold) and the 128 tier's two, the 72.5 KB one for 99 KB parts."""
    biased = [k for k in Sm80Bwd.default_set() if k.bias]
    assert [k.name for k in biased if k.dtype == "f16"] == [
        "sm80_bwd_f16_k64_q64x128_bias_sm80", "sm80_bwd_f16_k128_q64x128_bias_sm80",
        "sm80_bwd_f16_k128_q32x64_bias_sm80"]
    assert len(biased) == 6
    assert biased[0].cpp_type == "flashgen::sm80::BwdKernel<cutlass::half_t, 64, 64, 128, 8, true, false>"
    plain = {(k.dtype, k.max_k, k.block_m, k.block_n, k.warps) for k in Sm80Bwd.default_set() if not k.bias}
    assert all((k.dtype, k.max_k, k.block_m, k.block_n, k.warps) in plain for k in biased)
    assert [smem(k) for k in biased[:3]] == [99328, 164864, 74240]


def test_pruned_bias_candidates_name_their_rule():
    fwd = {k.name: k.pruned_by().reason for k in Sm80Fwd.candidates() if k.pruned_by() is not None}
    assert fwd["sm80_fwd_f16_k128_q128x64_s2_bias_sm80"].startswith("a bias at head dim 128 takes 64 query rows")
    assert fwd["sm80_fwd_f16_k192_q64x64_s2_bias_sm80"].startswith("bias on tiers 64 and 128 only")
    assert fwd["sm80_fwd_f16_k64_q128x64_s3_bias_sm80"].startswith("one ring depth per tile")
    bwd = {k.name: k.pruned_by().reason for k in Sm80Bwd.candidates() if k.pruned_by() is not None}
    assert bwd["sm80_bwd_f16_k192_q64x64_bias_sm80"].startswith("bias on tiers 64 and 128 only")
    assert bwd["sm80_bwd_f16_k256_q32x32_w4_bias_sm80"].startswith("bias on tiers 64 and 128 only")


# === selection on faked devices ==================================================================

def constants(k) -> dict:
    known = dict(threads_per_block=32 * getattr(k, "warps", 4), min_blocks_per_sm=1, shared_memory_bytes=smem(k),
                 block_m=k.block_m, block_n=k.block_n, max_k=k.max_k, stages=getattr(k, "stages", 0), alignment=8,
                 params_bytes=type(k).params_dtype().itemsize, aux_threads=128)
    return {c.name: known[c.name] for c in type(k).CONSTANTS}


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    d = tmp_path_factory.mktemp("sm80_bias_kernels")
    kernels = Sm80Fwd.default_set() + Sm80Bwd.default_set()
    write_build(d, [(k, {t: constants(k) for t in ("sm80", "sm90")}) for k in kernels])
    return Registry([d])


def request(family, device, bias, head_dim=64):
    return Request(family, "f16", head_dim, head_dim, 8, False, bias, device, compiled_bias=True)


@pytest.mark.parametrize("device", [A100, RTX3090, RTX4090, H100], ids=lambda d: d.name)
def test_a_bias_call_takes_a_bias_instance_and_a_plain_call_a_plain_one(registry, device):
    sel = Selector(registry)
    for family in ("sm80_fwd", "sm80_bwd"):
        for head_dim, tier in ((40, 64), (64, 64), (96, 128), (128, 128)):
            biased = sel.select(request(family, device, True, head_dim))
            plain = sel.select(request(family, device, False, head_dim))
            assert biased.spec.bias and not plain.spec.bias and biased.spec.max_k == plain.spec.max_k == tier
            assert biased.constants["shared_memory_bytes"] <= device.shared_memory_optin
            assert biased.target == ("sm90" if device.cc == 90 else "sm80")


def test_the_99_kb_parts_take_the_smaller_bias_backward_at_128_with_the_reason(registry):
    sel = Selector(registry)
    assert sel.select(request("sm80_bwd", A100, True, 128)).name == "sm80_bwd_f16_k128_q64x128_bias_sm80"
    for device in (RTX3090, RTX4090):
        verdicts = {name: why for name, target, why in sel.explain(request("sm80_bwd", device, True, 128))
                    if target == "sm80"}
        assert verdicts["sm80_bwd_f16_k128_q64x128_bias_sm80"] == \
            f"needs 164864 B of shared memory; {device.name} allows {SM86_OPTIN} B per block"
        assert verdicts["sm80_bwd_f16_k128_q32x64_bias_sm80"] == "selected"
        assert verdicts["sm80_bwd_f16_k128_q64x128_sm80"] == \
            "built without bias"  # a plain kernel never serves a bias call
    rows = {name: why for name, target, why in sel.explain(request("sm80_fwd", A100, False, 64)) if target == "sm80"}
    assert rows["sm80_fwd_f16_k64_q128x64_s4_bias_sm80"].startswith("built with bias (compiled in)")


def test_a_bias_call_past_the_bias_tiers_is_refused_with_each_kernels_reason(monkeypatch, registry):
    """Head dim 192 has no bias instance: both families refuse (example 41 takes the call next)."""
    monkeypatch.setattr(sm90_common, "device_info", lambda index: A100)
    bias = FakeArray((2, 3, 5, 8))
    for runtime, direction in ((sm80_fwd.RUNTIME, "fwd"), (sm80_bwd.RUNTIME, "bwd")):
        wide = fake_call(direction, bias=bias, arrays=qkv(K=192), registry=registry)
        why = runtime.refusal(wide)
        assert why.startswith("none of its kernels accepts the call: ") and "built without bias" in why, why
        assert runtime.refusal(fake_call(direction, bias=bias, registry=registry)) is None


def test_the_backward_refuses_dbias_with_softcapping_only(monkeypatch, registry):
    """dbias leaves the kernel from the dS^T buffer, which holds dS times tanh's slope under soft-capping."""
    monkeypatch.setattr(sm90_common, "device_info", lambda index: A100)
    runtime, bias = sm80_bwd.RUNTIME, FakeArray((2, 3, 5, 8))
    wanted = fake_call("bwd", bias=bias, softcap=5.0, bias_requires_grad=True, registry=registry)
    assert runtime.refusal(wanted).startswith("softcap with bias_requires_grad")
    assert runtime.refusal(fake_call("bwd", bias=bias, softcap=5.0, bias_requires_grad=False, registry=registry)) is None
    assert runtime.refusal(fake_call("bwd", bias=bias, bias_requires_grad=True, registry=registry)) is None
    assert sm80_fwd.RUNTIME.refusal(fake_call("fwd", bias=bias, softcap=5.0, registry=registry)) is None


# === launches and plans ==========================================================================

def binary(spec):
    return SimpleNamespace(spec=spec, name=spec.name, constants=constants(spec))


@pytest.mark.parametrize("family,runtime", [(Sm80Fwd, sm80_fwd.RUNTIME), (Sm80Bwd, sm80_bwd.RUNTIME)])
def test_a_bias_instance_is_never_launched_without_a_bias(family, runtime):
    biased = binary(next(k for k in family.default_set() if k.bias))
    plain = binary(next(k for k in family.default_set() if not k.bias))
    direction = family.DIRECTION
    with pytest.raises(ValueError, match=rf"^{biased.name} is built with an attention bias \(compiled in\); "
                                         r"the call has none$"):
        runtime.launch(fake_call(direction), biased)
    with pytest.raises(ValueError, match=rf"^{plain.name} is built without an attention bias \(compiled in\); "
                                         r"the call has one$"):
        runtime.launch(fake_call(direction, bias=FakeArray((2, 3, 5, 8))), plain)


@pytest.mark.parametrize("broadcast", ["", "B", "H", "M", "BHM"])
def test_the_bias_reaches_the_kernels_by_pointer_and_element_strides(broadcast):
    """A broadcast dim keeps validation's stride 0: the kernels read its row 0 for every index."""
    B, H, M, N, pitch = 2, 3, 5, 7, 8
    strides = [H * M * pitch, M * pitch, pitch, 1]
    for dim in broadcast:
        strides["BHM".index(dim)] = 0
    bias = FakeArray((B, H, M, N), strides=strides, ptr=0x7F2A00004000)
    assert sm90_common.ampere_bias_fields(bias) == {"bias_ptr": 0x7F2A00004000, "bias_stride_b": strides[0],
                                                    "bias_stride_h": strides[1], "bias_stride_m": strides[2]}
    assert sm90_common.ampere_bias_fields(None) == {}
    fields = sm80_bwd.RUNTIME.own_fields(fake_call("bwd", bias=bias))[1]
    assert fields["bias_ptr"] == 0x7F2A00004000 and fields["bias_stride_m"] == strides[2]
    assert not any("bias" in name for part in sm80_bwd.RUNTIME.own_fields(fake_call("bwd")) for name in part)
    assert sm80_bwd.RUNTIME.own_outputs(fake_call("bwd", bias=bias, bias_requires_grad=False), {}) == ((), {}, ())


def test_a_bias_plan_takes_the_bias_where_replay_passes_it():
    """Replays hand the caller's arrays in api.py's signature order (the bias after the family's own):
    the plan's pointer fields must name them in that order, or a replay would read the wrong array."""
    fwd_arrays = ("q", "k", "v", "bias", "out", "lse")  # replay_forward: arrays, then out and lse
    assert sm80_fwd.BIAS_POINTERS == tuple(f"{name}_ptr" for name in fwd_arrays)
    ampere, hopper = sm80_bwd.RUNTIME, sm90_bwd.RUNTIME
    given = ampere.replay_pointers(lambda x: x, "q", "k", "v", "out", "dout", "lse")
    with_bias = given[:ampere.BIAS_AT] + ("bias",) + given[ampere.BIAS_AT:]
    assert ampere.BIAS_POINTERS[:len(with_bias)] == tuple(f"{name}_ptr" for name in with_bias)
    assert ampere.BIAS_POINTERS[len(with_bias):] == ampere.POINTERS[len(given):] and ampere.BIAS_MAPS == ()
    # sm90_bwd: the bias's tensor map after the family's four, its pointers unchanged
    assert hopper.BIAS_MAPS == hopper.MAPS + ("bias_map",) and hopper.BIAS_AT == len(hopper.MAPS)
    assert hopper.BIAS_POINTERS == hopper.POINTERS
