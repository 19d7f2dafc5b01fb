"""The Ampere backward (sm80_bwd) without a GPU: its spec and pruning, instances, targets,
selection on faked 8.x devices (sm80's 163 KB, sm86/sm89's 99 KB of opt-in shared memory), its
refusals and its place in dispatch.  Nothing here imports CuPy (tests/runtime_fakes.py's fakes stand
in for arrays)."""
from __future__ import annotations

import sys

import pytest

from flashgen import generator
from flashgen.errors import UnsupportedError
from flashgen.runtime import families, tuning, validate
from flashgen.runtime.families import sm80_bwd, sm90_common
from flashgen.runtime.registry import Registry
from flashgen.runtime.select import Request, Selector
from flashgen.spec.sm80_bwd import A100_SHARED, SM86_SHARED, Sm80Bwd, shared_bytes
from runtime_fakes import A100, H100, RTX3090, RTX4090, T4, FakeArray, qkv, write_build

SM86_OPTIN = 101376  # cudaDevAttrMaxSharedMemoryPerBlockOptin on sm86/sm89: 99 KB


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    """`import cupy` raises ImportError inside every test, even where CuPy is installed."""
    monkeypatch.setitem(sys.modules, "cupy", None)


def constants(k: Sm80Bwd) -> dict:
    known = dict(threads_per_block=32 * k.warps, min_blocks_per_sm=1,
                 shared_memory_bytes=shared_bytes(k.max_k, k.block_m, k.block_n, k.warps),
                 block_m=k.block_m, block_n=k.block_n, max_k=k.max_k, alignment=8,
                 params_bytes=Sm80Bwd.params_dtype().itemsize, aux_threads=128)
    return {c.name: known[c.name] for c in Sm80Bwd.CONSTANTS}


# === the spec ===================================================================================

def test_dispatch_order_puts_it_after_the_hopper_backward_and_before_example41(monkeypatch):
    monkeypatch.delenv("FLASHGEN_FAMILIES", raising=False)
    assert [f.name for f in families.serving("bwd")] == ["sm90_bwd", "sm80_bwd", "mem_eff_bwd"]
    monkeypatch.setenv("FLASHGEN_FAMILIES", "sm80_fwd,sm80_bwd")
    assert [f.name for f in families.serving("bwd")] == ["sm80_bwd"]
    assert [f.name for f in families.serving("fwd")] == ["sm80_fwd"]


def test_default_set_has_per_tier_a_tile_within_sm86s_shared_memory():
    kernels = [k for k in Sm80Bwd.default_set() if not k.dropout and not k.bias]  # (twins: test_sm80_dropout_cpu.py, test_sm80_bias_cpu)
    assert [k.name for k in kernels if k.dtype == "f16"] == [
        "sm80_bwd_f16_k64_q128x128_sm80", "sm80_bwd_f16_k64_q64x128_sm80", "sm80_bwd_f16_k128_q64x128_sm80",
        "sm80_bwd_f16_k128_q32x64_sm80",
        "sm80_bwd_f16_k192_q64x64_sm80", "sm80_bwd_f16_k192_q32x32_w4_sm80",
        "sm80_bwd_f16_k256_q32x64_sm80", "sm80_bwd_f16_k256_q32x32_w4_sm80"]
    assert len(kernels) == 16
    for dtype in ("f16", "bf16"):
        for tier in (64, 128, 192, 256):
            tiles = [k for k in kernels if k.dtype == dtype and k.max_k == tier]
            sizes = [shared_bytes(k.max_k, k.block_m, k.block_n, k.warps) for k in tiles]
            assert min(sizes) <= SM86_SHARED, (dtype, tier)  # one tile per tier for 99 KB parts ...
            assert max(sizes) <= A100_SHARED, (dtype, tier)  # ... and none beyond an A100 block
            assert len(tiles) == 1 + (max(sizes) > SM86_SHARED), (dtype, tier)  # one per shared-memory class
    # the sizes the kernels' SharedStorage has (the build reads kSharedBytes back; tests on a GPU compare)
    assert shared_bytes(64, 64, 128) == 99328 and shared_bytes(128, 64, 128) == 164864
    assert shared_bytes(128, 32, 64) == 74240 and SM86_SHARED <= SM86_OPTIN < shared_bytes(128, 64, 128)
    assert shared_bytes(192, 64, 64) == 164864 and shared_bytes(192, 32, 32, 4) == 78336
    assert shared_bytes(256, 32, 64) == 139776
    # 4 warps at head dim 256: one dS^T buffer (100.5 KB); two would be 102912 B, past sm86/sm89's 101376
    assert shared_bytes(256, 32, 32, 4) == 102912 - 2 * 32 * 32 == 100864 <= SM86_OPTIN
    assert shared_bytes(192, 32, 32, 8) == shared_bytes(192, 32, 32, 4), "two dS^T buffers where they fit"
    assert kernels[0].cpp_type == "flashgen::sm80::BwdKernel<cutlass::half_t, 64, 128, 128, 8, false, false>"
    assert kernels[5].cpp_type == "flashgen::sm80::BwdKernel<cutlass::half_t, 192, 32, 32, 4, false, false>"


def test_every_pruned_candidate_names_its_rule():
    reasons = {k.name: k.pruned_by().reason for k in Sm80Bwd.candidates() if k.pruned_by() is not None}
    assert reasons["sm80_bwd_f16_k64_q64x32_sm80"].startswith("the template's warps")
    assert reasons["sm80_bwd_f16_k128_q64x128_w4_sm80"].startswith("the template's warps")
    assert reasons["sm80_bwd_f16_k128_q128x128_sm80"].startswith("128-query steps")
    assert reasons["sm80_bwd_f16_k64_q32x128_sm80"].startswith("128-key CTAs take 64-query steps")
    assert reasons["sm80_bwd_f16_k192_q64x128_sm80"].startswith("128-key CTAs up to head dim 128")
    assert reasons["sm80_bwd_f16_k64_q64x64_sm80"].startswith("64-key CTAs only where")
    assert reasons["sm80_bwd_f16_k128_q64x64_sm80"].startswith("64-key CTAs take the larger query step")
    assert reasons["sm80_bwd_f16_k256_q64x64_sm80"].startswith("64-key CTAs take the larger query step")  # 209 KB
    assert reasons["sm80_bwd_f16_k192_q32x64_sm80"].startswith("64-key CTAs take the larger query step")
    assert reasons["sm80_bwd_f16_k128_q32x32_w4_sm80"].startswith("4-warp CTAs only where")
    assert reasons["sm80_bwd_f16_k192_q64x32_w4_sm80"].startswith("4-warp CTAs take the larger query step")


def test_built_for_plain_targets_from_sm80_on_not_sm90a():
    for k in Sm80Bwd.default_set():
        for target in ("sm80", "sm_86", "sm89", "sm90", "sm100", "sm120"):
            assert k.runs_on(target), target
        for target in ("sm75", "sm90a", "sm100a"):
            assert not k.runs_on(target), target


def test_instances_are_generated_and_current():
    kernels = Sm80Bwd.default_set()
    assert generator.check(generator.INSTANCES_DIR, kernels) == {}
    source = generator.render(kernels[0])
    assert "__CUDA_ARCH__ >= 800 && __CUDA_ARCH__ < 1300" in source
    for entry in ("_prep", "", "_convert"):
        assert f"{kernels[0].name}{entry}(const __grid_constant__ Params p)" in source
    assert "static_assert(sizeof(FlashgenAbiCheck_sm80_bwd<Params>) > 0," in source


def test_params_mirror_the_c_struct():
    dtype = Sm80Bwd.params_dtype()
    assert dtype.fields["q_stride_b"][1] == 15 * 8  # after fifteen pointers
    assert dtype.fields["q_stride_m"][1] == 22 * 8  # after seven int64 batch strides
    assert dtype.fields["scale"][1] == 22 * 8 + 26 * 4  # after 26 int32 fields
    assert dtype.fields["dbias_ptr"][1] == 296  # appended: after softcap_out, the last of the plain fields
    assert dtype.fields["bias_ptr"][1] == 312 and dtype.fields["bias_stride_m"][1] == 336
    assert dtype.fields["dropout_seed"][1] == 344  # after bias_stride_m (336), 8-aligned
    assert dtype.itemsize == 368


# === selection on faked devices ==================================================================

@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    d = tmp_path_factory.mktemp("sm80_bwd_kernels")
    kernels = [k for k in Sm80Bwd.default_set() if not k.bias]
    write_build(d, [(k, {t: constants(k) for t in ("sm80", "sm90")}) for k in kernels])
    return Registry([d])


def request(device, head_dim=128, alignment=8, dtype="f16"):
    return Request("sm80_bwd", dtype, head_dim, head_dim, alignment, False, False, device)


def test_sm86_and_sm89_skip_the_tile_above_their_shared_memory_with_the_reason(registry):
    sel = Selector(registry)
    for device in (RTX3090, RTX4090):
        verdicts = {name: why for name, _, why in sel.explain(request(device))}
        assert verdicts["sm80_bwd_f16_k128_q64x128_sm80"] == \
            f"needs 164864 B of shared memory; {device.name} allows {SM86_OPTIN} B per block"
        assert verdicts["sm80_bwd_f16_k128_q32x64_sm80"] == "selected"
        assert sel.select(request(device, head_dim=64)).name == "sm80_bwd_f16_k64_q64x128_sm80"
        verdicts = {name: why for name, _, why in sel.explain(request(device, head_dim=64))}
        assert verdicts["sm80_bwd_f16_k64_q128x128_sm80"] == \
            f"needs 165888 B of shared memory; {device.name} allows {SM86_OPTIN} B per block"
    assert sel.select(request(A100)).name == "sm80_bwd_f16_k128_q64x128_sm80"  # 163 KB: the bigger tile
    assert sel.select(request(A100, head_dim=64)).name == "sm80_bwd_f16_k64_q128x128_sm80"  # 162 KB
    hopper = sel.select(request(H100))
    assert hopper.name == "sm80_bwd_f16_k128_q64x128_sm80" and hopper.target == "sm90"  # plain sm90 SASS


@pytest.mark.parametrize("head_dim,tier", [(160, 192), (192, 192), (200, 256), (256, 256)])
def test_head_dims_past_128_take_a_tile_each_device_holds(registry, head_dim, tier):
    """An A100 (163 KB a block) and Hopper take the tier's larger tile; sm86/sm89 (99 KB) skip it with
    the shared-memory reason and take the 4-warp 32 x 32 one."""
    big = {192: "q64x64", 256: "q32x64"}[tier]
    sel = Selector(registry)
    for dtype in ("f16", "bf16"):
        large, small = f"sm80_bwd_{dtype}_k{tier}_{big}_sm80", f"sm80_bwd_{dtype}_k{tier}_q32x32_w4_sm80"
        assert sel.select(request(A100, head_dim=head_dim, dtype=dtype)).name == large
        assert sel.select(request(H100, head_dim=head_dim, dtype=dtype)).name == large
        for device in (RTX3090, RTX4090):
            verdicts = {name: why for name, target, why in sel.explain(request(device, head_dim, dtype=dtype))
                        if target == "sm80"}
            need = shared_bytes(*{192: (192, 64, 64), 256: (256, 32, 64)}[tier])
            assert verdicts[large] == f"needs {need} B of shared memory; {device.name} allows {SM86_OPTIN} B per block"
            assert verdicts[small] == "selected"
            chosen = sel.select(request(device, head_dim=head_dim, dtype=dtype))
            assert chosen.name == small and chosen.constants["shared_memory_bytes"] <= device.shared_memory_optin
            assert chosen.constants["threads_per_block"] == 128
        if tier == 256:  # the 192 tier's kernels are refused by head dim, not tried
            rows = {name: why for name, _, why in sel.explain(request(RTX3090, head_dim, dtype=dtype))}
            assert rows[f"sm80_bwd_{dtype}_k192_q32x32_w4_sm80"] == f"kMaxK 192 < head dim {head_dim}"


def test_selection_by_tier_alignment_and_dtype(registry):
    sel = Selector(registry)
    assert sel.select(request(A100, head_dim=8)).name == "sm80_bwd_f16_k64_q128x128_sm80"
    assert sel.select(request(A100, head_dim=96)).name == "sm80_bwd_f16_k128_q64x128_sm80"
    assert sel.select(request(RTX3090, head_dim=80, dtype="bf16")).name == "sm80_bwd_bf16_k128_q32x64_sm80"
    assert sel.find(request(A100, head_dim=264)) is None
    verdicts = {why for _, _, why in sel.explain(request(RTX3090, alignment=4))}
    assert "needs 8-element alignment of pointers, strides and head dims; the call has 4" in verdicts
    with pytest.raises(UnsupportedError, match="no sm80_bwd kernel can run on GPU 2"):
        sel.select(request(T4))


# === the runtime's refusals ======================================================================

def backward_of(arrays=None, bias=None, registry=None, out=None, grad_out=None, **options):
    """A validated backward Call over FakeArrays (what the family's refusal and request read)."""
    q, k, v = arrays or qkv()
    c = validate.problem(q, k, v, options.get("causal"), None, options.get("dropout_p", 0.0), options.get("seed"), 0,
                         None, None, window=options.get("window"), softcap=options.get("softcap", 0.0))
    out = out or FakeArray(q.shape[:3] + v.shape[3:])
    return validate.Call("bwd", c, q, k, v, bias, {"registry": registry, **options}, None, out=out,
                         grad_out=grad_out or FakeArray(out.shape))


def test_refuses_what_only_example41_has_with_the_reason(monkeypatch):
    monkeypatch.setattr(sm90_common, "device_info", lambda index: RTX3090)
    runtime = sm80_bwd.RUNTIME
    assert runtime.unfit(backward_of(window=(4, 4), softcap=3.0)) is None
    assert runtime.unfit(backward_of(bias=FakeArray((2, 3, 5, 8)))) is None  # bias instances: test_sm80_bias_cpu
    for call, why in ((backward_of(dropout_p=0.1, seed=1, softcap=3.0), "dropout without attn_bias, block masks or softcap"),
                      (backward_of(arrays=qkv(dtype="float32")), "float32"),
                      (backward_of(arrays=qkv(K=64, Kv=32)), "equal q/v head dims only; the call has 64 and 32")):
        assert why in runtime.unfit(call)
        assert why in runtime.refusal(call)
    monkeypatch.setattr(sm90_common, "device_info", lambda index: T4)
    assert runtime.unfit(backward_of()) == "a GPU of compute capability 8.0 or newer; GPU 0 is Tesla T4 (sm_75)"


def test_refuses_calls_none_of_its_kernels_takes(monkeypatch, registry):
    monkeypatch.setattr(sm90_common, "device_info", lambda index: RTX3090)
    runtime = sm80_bwd.RUNTIME
    assert runtime.refusal(backward_of(registry=registry, causal="top_left", window=(8, None), softcap=2.0)) is None
    req = runtime.request(backward_of(registry=registry, window=(8, None), softcap=2.0))
    assert (req.family, req.band, req.softcap, req.alignment, req.device) == ("sm80_bwd", True, True, 8, RTX3090)
    wide = runtime.refusal(backward_of(arrays=qkv(K=264), registry=registry))
    assert wide.startswith("none of its kernels accepts the call: ") and "kMaxK 256 < head dim 264" in wide
    grouped = qkv()[:1] + (FakeArray((2, 7, 1, 64)), FakeArray((2, 7, 1, 64)))  # three q heads per k/v head
    assert runtime.refusal(backward_of(arrays=grouped, registry=registry)) is None


def test_out_and_grad_out_are_read_at_the_inputs_alignment(monkeypatch, registry):
    """The prep kernel reads O and dO by 16-byte loads: a grad_out 4-element aligned is refused."""
    monkeypatch.setattr(sm90_common, "device_info", lambda index: RTX3090)
    runtime = sm80_bwd.RUNTIME
    skewed = FakeArray((2, 5, 3, 64), ptr=0x7F2A00000008)  # 4 f16 elements past an aligned address
    assert runtime.request(backward_of(registry=registry, grad_out=skewed)).alignment == 4
    assert "needs 8-element alignment" in runtime.refusal(backward_of(registry=registry, grad_out=skewed))
    assert "needs 8-element alignment" in runtime.refusal(backward_of(registry=registry, out=skewed))
    assert runtime.refusal(backward_of(registry=registry)) is None


def test_explain_shows_the_kernel_a_tuning_table_steers_the_call_to(monkeypatch, registry):
    """A table's tile (here the k192 tier's 64 x 64 for a head-dim-96 call) is the kernel selection runs,
    and flashgen.explain says so: the family's explain marks the same kernel as kernel() picks."""
    monkeypatch.setattr(sm90_common, "device_info", lambda index: A100)
    monkeypatch.setattr(families, "device_info", lambda index: A100)
    call = backward_of(arrays=qkv(K=96), registry=registry, causal="top_left")
    runtime = sm80_bwd.RUNTIME
    req, p = runtime.request(call), call.p
    untuned = runtime.kernel(call, req)
    wide = next(b for b in registry.for_device("sm80_bwd", A100)
                if b.spec.max_k == 192 and b.spec.block_m == 64 and b.spec.dtype == "f16" and not b.spec.dropout)
    bucket = tuning.Bucket.of(req.family, p.dtype, p.K, p.Kv, p.mask != 0, p.M, p.N, p.batches * p.H)
    tuning.use_table(tuning.Table(A100.name, A100.cc, {bucket: tuning.Choice(tuning.tile_of(wide.spec))}, {}))
    try:
        picked = runtime.kernel(call, req)
        selected = [name for name, _, why in runtime.explain(call) if why == "selected"]
    finally:
        tuning.use_table(None)
    assert picked.name == wide.name != untuned.name
    assert selected == [wide.name]
    assert [name for name, _, why in runtime.explain(call) if why == "selected"] == [untuned.name]


def test_packed_and_grouped_query_backwards_take_no_tuning_table_choice(monkeypatch, registry):
    """Tables are measured on fixed-length multi-head calls: a packed batch with the same bucket (its
    longest sequence, sequences x heads) and a grouped-query backward get the priority order."""
    from dataclasses import replace

    monkeypatch.setattr(sm90_common, "device_info", lambda index: A100)
    call = backward_of(arrays=qkv(K=96), registry=registry, causal="top_left")
    req, p = sm80_bwd.RUNTIME.request(call), call.p
    choice = tuning.Choice((("block_m", 64), ("block_n", 64), ("warps", 4)))
    bucket = tuning.Bucket.of(req.family, p.dtype, p.K, p.Kv, p.mask != 0, p.M, p.N, p.batches * p.H)
    tuning.use_table(tuning.Table(A100.name, A100.cc, {bucket: choice}, {}))
    try:
        assert families.tuned(req, p) == choice
        assert families.tuned(req, replace(p, seqstart_q=FakeArray((3,)), seqstart_k=FakeArray((3,)))) is None
        assert families.tuned(req, replace(p, H=4 * p.Hk)) is None  # the same batch x heads, 4 per k/v head
    finally:
        tuning.use_table(None)


def test_explain_names_why_a_99_kb_part_skips_the_larger_tile(monkeypatch, registry):
    """What flashgen.explain lists for this family on an RTX 4090: the 161 KB tile with the shared
    memory it needs, then the 72.5 KB one selected."""
    monkeypatch.setattr(sm90_common, "device_info", lambda index: RTX4090)
    monkeypatch.setattr(families, "device_info", lambda index: RTX4090)
    rows = sm80_bwd.RUNTIME.explain(backward_of(arrays=qkv(K=96), registry=registry, causal="top_left"))
    f16 = [(name, why) for name, target, why in rows if "_f16_" in name and target == "sm80" and "dropout" not in name]
    assert f16[:4] == [("sm80_bwd_f16_k64_q128x128_sm80", "kMaxK 64 < head dim 96"),
                       ("sm80_bwd_f16_k64_q64x128_sm80", "kMaxK 64 < head dim 96"),
                       ("sm80_bwd_f16_k128_q64x128_sm80", f"needs 164864 B of shared memory; {RTX4090.name} allows "
                                                          f"{SM86_OPTIN} B per block"),
                       ("sm80_bwd_f16_k128_q32x64_sm80", "selected")]
    assert [name for name, _ in f16[4:]] == ["sm80_bwd_f16_k192_q64x64_sm80", "sm80_bwd_f16_k192_q32x32_w4_sm80",
                                             "sm80_bwd_f16_k256_q32x64_sm80", "sm80_bwd_f16_k256_q32x32_w4_sm80"]
