"""The Ampere forward (sm80_fwd) without a GPU: its spec, instances, targets, selection on faked
devices, its refusals, and the FLASHGEN_FAMILIES switch that forces families for tests and
benchmarks.  Nothing here imports CuPy (tests/runtime_fakes.py's fakes stand in for arrays)."""
from __future__ import annotations

import sys

import numpy as np
import pytest

from flashgen import generator
from flashgen.errors import UnsupportedError
from flashgen.runtime import families, plans, validate
from flashgen.runtime.families import sm80_fwd, sm90_common
from flashgen.runtime.registry import Registry
from flashgen.runtime.select import Request, Selector
from flashgen.spec import FAMILIES
from flashgen.spec.sm80_fwd import CTA_SHARED_BUDGET, Sm80Fwd, ring_slots
from flashgen.spec.sm80_fwd import shared_bytes as spec_shared_bytes
from runtime_fakes import A100, H100, RTX3090, RTX4090, T4, FakeArray, qkv, write_build

SM86_OPTIN = 101376  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm86/sm89: 99 KB


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    """`import cupy` raises ImportError inside every test, even where CuPy is installed."""
    monkeypatch.setitem(sys.modules, "cupy", None)


def shared_bytes(k: Sm80Fwd) -> int:
    """FwdKernel::kSharedBytes: the Q tile, the ring of K/V tiles and a bias instance's ceil(stages / 2)
    bias tiles (a real build reads it back)."""
    return 2 * k.max_k * (k.block_m + k.stages * k.block_n) + k.bias * 2 * k.block_m * k.block_n * ((k.stages + 1) // 2)


def constants(k: Sm80Fwd, smem=None) -> dict:
    known = dict(threads_per_block=128, min_blocks_per_sm=1, shared_memory_bytes=smem or shared_bytes(k),
                 block_m=k.block_m, block_n=k.block_n, max_k=k.max_k, stages=k.stages, alignment=8,
                 params_bytes=Sm80Fwd.params_dtype().itemsize)
    return {c.name: known[c.name] for c in Sm80Fwd.CONSTANTS}


# === the spec ===================================================================================

def test_dispatch_order_puts_it_between_the_hopper_and_the_example41_forward():
    assert list(FAMILIES) == ["sm90_fwd", "sm90_bwd", "sm80_fwd", "sm80_bwd", "mem_eff_fwd", "mem_eff_bwd"]


def test_default_set_has_one_tile_per_tier_that_fits_sm86():
    kernels = [k for k in Sm80Fwd.default_set() if not k.dropout and not k.bias]  # (twins: test_sm80_dropout_cpu.py, test_sm80_bias_cpu)
    for dtype in ("f16", "bf16"):
        assert sorted(k.max_k for k in kernels if k.dtype == dtype) == [64, 128, 192, 256]
    for k in kernels:
        assert shared_bytes(k) == spec_shared_bytes(k.max_k, k.block_m, k.block_n, k.stages)
        assert shared_bytes(k) <= CTA_SHARED_BUDGET <= SM86_OPTIN, k.name
        assert 2 * (shared_bytes(k) + 1024) <= A100.shared_memory_optin + 1024, "two CTAs per A100 SM"
    assert [k.name for k in kernels if k.dtype == "f16"] == [
        "sm80_fwd_f16_k64_q128x128_s4_sm80", "sm80_fwd_f16_k128_q128x64_s3_sm80", "sm80_fwd_f16_k192_q64x64_s2_sm80",
        "sm80_fwd_f16_k256_q64x32_s3_sm80"]
    assert kernels[0].cpp_type == "flashgen::sm80::FwdKernel<cutlass::half_t, 64, 128, 128, 4, false, false>"
    # past head dim 128: 64 query rows (16 a warp); 72 KB at 192 (64 keys, 2 slots), 80 KB at 256 (32 keys, 3)
    assert [shared_bytes(k) for k in kernels[2:4]] == [73728, 81920]


def test_every_pruned_candidate_names_its_rule():
    reasons = {k.name: k.pruned_by().reason for k in Sm80Fwd.candidates() if k.pruned_by() is not None}
    assert reasons["sm80_fwd_f16_k128_q128x128_s2_sm80"].startswith("128-key tiles only for the plain head-dim-64")
    assert reasons["sm80_fwd_f16_k64_q128x128_s2_dropout_sm80"].startswith("128-key tiles only for the plain")
    assert reasons["sm80_fwd_f16_k64_q128x64_s4_sm80"].startswith("the plain head-dim-64 instance takes 128 keys")
    assert reasons["sm80_fwd_f16_k192_q128x32_s2_sm80"].startswith("128 query rows up to head dim 128")
    assert reasons["sm80_fwd_f16_k128_q64x64_s4_sm80"].startswith("64 query rows only past head dim 128")
    assert reasons["sm80_fwd_f16_k192_q64x32_s4_sm80"].startswith("32-key tiles only where")
    assert reasons["sm80_fwd_f16_k192_q64x64_s3_sm80"].startswith("one ring depth per tile")
    assert reasons["sm80_fwd_f16_k256_q64x64_s2_sm80"].startswith("the tile within 80 KB")


def test_ring_depth_fills_the_budget_between_two_and_four_slots():
    assert ring_slots(64, 128, 64) == 4      # 16 KB Q + 4 x 8 KB
    assert ring_slots(128, 128, 64) == 3     # 32 KB Q + 3 x 16 KB = 80 KB
    assert ring_slots(128, 128, 128) == 2    # nothing fits: the minimum, one K and one V tile
    assert ring_slots(256, 64, 64) == 2     # 32 KB Q + 2 x 32 KB: over 80 KB, so 256 takes 32-key tiles
    assert ring_slots(192, 64, 64) == 2     # 24 KB Q + 2 x 24 KB = 72 KB
    assert ring_slots(256, 64, 32) == 3     # 32 KB Q + 3 x 16 KB = 80 KB


def test_built_for_plain_targets_from_sm80_on_not_sm90a():
    for k in Sm80Fwd.default_set():
        for target in ("sm80", "sm_86", "sm89", "sm90", "sm100", "sm120"):
            assert k.runs_on(target), target
        for target in ("sm75", "sm90a", "sm100a"):
            assert not k.runs_on(target), target


def test_instances_are_generated_and_current():
    kernels = Sm80Fwd.default_set()
    assert generator.check(generator.INSTANCES_DIR, kernels) == {}
    source = generator.render(kernels[0])
    assert "__CUDA_ARCH__ >= 800 && __CUDA_ARCH__ < 1300" in source
    assert f"{kernels[0].name}(const __grid_constant__ Params p)" in source
    assert "static_assert(sizeof(FlashgenAbiCheck_sm80_fwd<Params>) > 0," in source


def test_params_mirror_the_c_struct():
    dtype = Sm80Fwd.params_dtype()
    assert dtype.fields["q_stride_b"][1] == 56  # after seven pointers
    assert dtype.fields["q_stride_m"][1] == 88  # after four int64 batch strides
    assert dtype.fields["bias_ptr"][1] == 184  # appended: after softcap_out, the last of the plain fields
    assert dtype.fields["bias_stride_m"][1] == 208
    assert dtype.fields["dropout_seed"][1] == 216  # after bias_stride_m (208), 8-aligned
    assert dtype.itemsize == 240


# === selection on faked devices ==================================================================

BIG = Sm80Fwd("sm80", "f16", 128, 128, 128, 3, False, False)  # a tile only an A100 or H100 fits: 128 KB


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    d = tmp_path_factory.mktemp("sm80_kernels")
    kernels = [k for k in Sm80Fwd.default_set() if not k.bias] + [BIG]
    write_build(d, [(k, {t: constants(k) for t in ("sm80", "sm90")}) for k in kernels])
    return Registry([d])


def request(device, head_dim=128, alignment=8, dtype="f16"):
    return Request("sm80_fwd", dtype, head_dim, head_dim, alignment, False, False, device)


def test_sm86_skips_tiles_above_its_shared_memory_with_the_reason(registry):
    sel = Selector(registry)
    assert shared_bytes(BIG) == 131072 and BIG.priority < Sm80Fwd("sm80", "f16", 128, 128, 64, 3, False, False).priority
    for device in (RTX3090, RTX4090):
        verdicts = {name: why for name, _, why in sel.explain(request(device))}
        assert verdicts[BIG.name] == f"needs 131072 B of shared memory; {device.name} allows {SM86_OPTIN} B per block"
        assert verdicts["sm80_fwd_f16_k128_q128x64_s3_sm80"] == "selected"
        assert sel.select(request(device)).target == "sm80"
    assert sel.select(request(A100)).spec == BIG  # 163 KB: the bigger tile
    assert sel.select(request(H100)).target == "sm90"  # plain sm90 SASS runs on a 9.0 GPU


def test_selection_by_tier_alignment_and_dtype(registry):
    sel = Selector(registry)
    assert sel.select(request(RTX3090, head_dim=40)).name == "sm80_fwd_f16_k64_q128x128_s4_sm80"
    assert sel.select(request(RTX3090, head_dim=96)).name == "sm80_fwd_f16_k128_q128x64_s3_sm80"
    assert sel.select(request(RTX3090, head_dim=80, dtype="bf16")).name == "sm80_fwd_bf16_k128_q128x64_s3_sm80"
    assert sel.find(request(RTX3090, head_dim=264)) is None
    verdicts = {why for _, _, why in sel.explain(request(RTX3090, alignment=4))}
    assert "needs 8-element alignment of pointers, strides and head dims; the call has 4" in verdicts
    with pytest.raises(UnsupportedError, match="no sm80_fwd kernel can run on GPU 2"):
        sel.select(request(T4))


@pytest.mark.parametrize("head_dim,tier", [(136, 192), (160, 192), (192, 192), (200, 256), (256, 256)])
@pytest.mark.parametrize("device", [A100, RTX3090, RTX4090, H100], ids=lambda d: d.sm)
def test_head_dims_past_128_take_the_next_tier_on_every_device(registry, device, head_dim, tier):
    """Head dims 129-256 pad to tier 192 or 256, whose single tiles (at most 80 KB) every 8.x and
    9.0 device holds: selected everywhere, not left to example 41."""
    for dtype in ("f16", "bf16"):
        chosen = Selector(registry).select(request(device, head_dim=head_dim, dtype=dtype))
        assert (chosen.spec.max_k, chosen.spec.dtype) == (tier, dtype)
        assert chosen.constants["shared_memory_bytes"] <= device.shared_memory_optin
        assert chosen.target == ("sm90" if device.cc == 90 else "sm80")


# === the runtime's refusals ======================================================================

def call_of(arrays=None, bias=None, registry=None, **options):
    q, k, v = arrays or qkv()
    c = validate.problem(q, k, v, options.get("causal"), None, options.get("dropout_p", 0.0), options.get("seed"), 0,
                         None, None, window=options.get("window"), softcap=options.get("softcap", 0.0))
    return validate.Call("fwd", c, q, k, v, bias, {"registry": registry, **options}, None)


def test_refuses_what_only_example41_has_with_the_reason(monkeypatch, registry):
    monkeypatch.setattr(sm90_common, "device_info", lambda index: RTX3090)
    runtime = sm80_fwd.RUNTIME
    assert runtime.unfit(call_of(window=(4, 4), softcap=3.0)) is None
    assert runtime.unfit(call_of(bias=FakeArray((2, 3, 5, 8)))) is None  # bias instances: test_sm80_bias_cpu
    for call, why in ((call_of(dropout_p=0.1, seed=1, softcap=3.0), "dropout without attn_bias, block masks or softcap"),
                      (call_of(arrays=qkv(dtype=np.float32)), "float32"),
                      (call_of(arrays=qkv(K=64, Kv=32)), "equal q/v head dims only; the call has 64 and 32")):
        assert why in runtime.unfit(call)
        assert why in runtime.refusal(call)
    monkeypatch.setattr(sm90_common, "device_info", lambda index: T4)
    assert runtime.unfit(call_of()) == "a GPU of compute capability 8.0 or newer; GPU 0 is Tesla T4 (sm_75)"


def test_refuses_calls_none_of_its_kernels_takes(monkeypatch, registry):
    monkeypatch.setattr(sm90_common, "device_info", lambda index: RTX3090)
    runtime = sm80_fwd.RUNTIME
    assert runtime.refusal(call_of(registry=registry, causal="top_left", window=(8, None), softcap=2.0)) is None
    req = runtime.request(call_of(registry=registry, window=(8, None), softcap=2.0))
    assert (req.band, req.softcap, req.alignment, req.device) == (True, True, 8, RTX3090)
    wide = runtime.refusal(call_of(arrays=qkv(K=264), registry=registry))
    assert wide.startswith("none of its kernels accepts the call: ") and "kMaxK 256 < head dim 264" in wide
    skewed = (FakeArray((2, 5, 3, 64), ptr=0x7F2A00000008),) + qkv()[1:]
    assert "needs 8-element alignment" in runtime.refusal(call_of(arrays=skewed, registry=registry))
    grouped = qkv()[:1] + (FakeArray((2, 7, 1, 64)), FakeArray((2, 7, 1, 64)))  # three q heads per k/v head
    assert runtime.refusal(call_of(arrays=grouped, registry=registry)) is None


# === FLASHGEN_FAMILIES ===========================================================================

def test_families_switch_limits_dispatch_to_the_named_families(monkeypatch):
    monkeypatch.delenv("FLASHGEN_FAMILIES", raising=False)
    assert [f.name for f in families.serving("fwd")] == ["sm90_fwd", "sm80_fwd", "mem_eff_fwd"]
    monkeypatch.setenv("FLASHGEN_FAMILIES", "")
    assert [f.name for f in families.serving("fwd")] == ["sm90_fwd", "sm80_fwd", "mem_eff_fwd"]
    monkeypatch.setenv("FLASHGEN_FAMILIES", " sm80_fwd , sm90_bwd,")
    assert families.forced_families() == ("sm80_fwd", "sm90_bwd")
    assert [f.name for f in families.serving("fwd")] == ["sm80_fwd"]
    assert [f.name for f in families.serving("bwd")] == ["sm90_bwd"]
    monkeypatch.setenv("FLASHGEN_FAMILIES", "mem_eff_fwd,sm80_fwd")  # dispatch keeps the spec's order
    assert [f.name for f in families.serving("fwd")] == ["sm80_fwd", "mem_eff_fwd"]
    assert families.serving("bwd") == []


def test_families_switch_refuses_unknown_names(monkeypatch):
    monkeypatch.setenv("FLASHGEN_FAMILIES", "sm80_fwd,sm70_bwd")
    with pytest.raises(ValueError, match=r"FLASHGEN_FAMILIES='sm80_fwd,sm70_bwd' names no family 'sm70_bwd'; "
                                         r"known: sm90_fwd, sm90_bwd, sm80_fwd, sm80_bwd, mem_eff_fwd, mem_eff_bwd"):
        families.serving("fwd")


def test_families_switch_names_itself_when_nothing_serves(monkeypatch):
    monkeypatch.setattr(sm90_common, "device_info", lambda index: T4)
    monkeypatch.setenv("FLASHGEN_FAMILIES", "sm80_fwd")
    with pytest.raises(UnsupportedError, match=r"(?s)no kernel family serves this call:\n  sm80_fwd: .*8\.0 or newer"
                                               r".*\n  \(FLASHGEN_FAMILIES allows only sm80_fwd\)"):
        families.dispatch(call_of())


def test_launch_plans_are_kept_apart_by_the_families_switch(monkeypatch):
    """A plan replays the family that made it: one made under another setting must not answer."""
    signature = lambda arrays: tuple(x.shape for x in arrays)  # noqa: E731
    arrays = qkv()
    plans.clear()
    monkeypatch.delenv("FLASHGEN_FAMILIES", raising=False)
    key, plan = plans.find(signature, "fwd", arrays, (None, 0.5))
    assert plan is None
    plans.remember(key, "made by the first family that served it")
    assert plans.find(signature, "fwd", arrays, (None, 0.5))[1] is not None
    monkeypatch.setenv("FLASHGEN_FAMILIES", "sm80_fwd")
    forced_key, forced = plans.find(signature, "fwd", arrays, (None, 0.5))
    assert forced is None and forced_key != key
    plans.clear()


def test_tune_offers_a_plain_call_the_plain_tiles_only(tmp_path, monkeypatch):
    """The head-dim-128 bias twin has a tile of its own (64 rows, 3 slots): tune must not time a plain
    call on it (the launch would refuse a bias instance without a bias), nor on a dropout twin."""
    from flashgen import tune
    from flashgen.bench import Point

    monkeypatch.setenv("FLASHGEN_FAMILIES", "sm80_fwd,sm80_bwd")
    write_build(tmp_path, [(k, {"sm80": constants(k)}) for k in Sm80Fwd.default_set() if k.dtype == "f16"])
    reg = Registry([tmp_path])
    assert any(k.bias and (k.block_m, k.stages) == (64, 3) for k in Sm80Fwd.default_set() if k.max_k == 128)
    labels = [label for label, _ in tune.candidates(reg, A100, Point("f16", 128, False, 4, 16, 4096), "fwd")]
    # (max_k, block_m, block_n, stages); the 192 and 256 tiers' kernels take head dim 128 too, on zeros: not timed
    assert labels[0] == "128_128_64_3" and "128_64_64_3" not in labels
    assert {label.split("_")[0] for label in labels} == {"128"}
