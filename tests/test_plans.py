"""Launch plans (flashgen/runtime/plans.py): a repeated call must launch exactly what the full path would.

The CPU part checks the Params bytes a plan writes; the GPU part runs the same
signature through the full path and through its plan and compares results with
each other (bitwise) and with the float64 reference.
"""
from __future__ import annotations

import ctypes
import types

import numpy as np
import pytest

from flashgen.runtime import plans
from flashgen.spec.mem_eff_bwd import MemEffBwd
from flashgen.spec.mem_eff_fwd import MemEffFwd
from flashgen.spec.sm90_bwd import Sm90Bwd


class RecordingLauncher:
    """Stands in for cuLaunchKernel: reads the Params bytes through the argument array, as the driver does."""

    def __init__(self, size):
        self.size, self.calls = size, []

    def __call__(self, handle, gx, gy, gz, bx, by, bz, shared_memory, stream, argv, extra):
        assert extra == 0
        params_address = ctypes.c_void_p.from_address(argv).value  # kernelParams[0]
        self.calls.append((handle, (gx, gy, gz), (bx, by, bz), ctypes.string_at(params_address, self.size),
                           shared_memory, stream))


def filled(spec, **fields):
    p = np.zeros(1, dtype=spec.params_dtype())
    for name, value in fields.items():
        p[name] = value
    return p


@pytest.mark.parametrize("spec, pointers", [
    (MemEffFwd, ("query_ptr", "key_ptr", "value_ptr", "output_ptr", "output_accum_ptr", "logsumexp_ptr")),
    (MemEffBwd, ("query_ptr", "key_ptr", "value_ptr", "logsumexp_ptr", "output_ptr", "grad_output_ptr", "delta_ptr",
                 "grad_query_ptr", "grad_key_ptr", "grad_value_ptr", "workspace")),
])
def test_plan_writes_pointers_and_rng_and_keeps_every_other_field(spec, pointers):
    first = filled(spec, scale=0.125, head_dim=64, num_heads=3, **{name: 1000 + i for i, name in enumerate(pointers)},
                   rng_engine_inputs_seed=5, rng_engine_inputs_offset=6)
    fn = RecordingLauncher(spec.params_dtype().itemsize)
    plan = plans.LaunchPlan.from_params(77, 0, (2, 3, 4), (128, 1, 1), 4096, first, pointers, True, {}, fn)
    new_pointers = [2**40 + 256 * i for i in range(len(pointers))]
    plan.launch(new_pointers, 2**63 + 1, 77, 1234)
    (handle, grid, block, raw, smem, stream), = fn.calls
    assert (handle, grid, block, smem, stream) == (77, (2, 3, 4), (128, 1, 1), 4096, 1234)
    got = np.frombuffer(raw, dtype=spec.params_dtype())[0]
    want = filled(spec, scale=0.125, head_dim=64, num_heads=3, **dict(zip(pointers, new_pointers)),
                  rng_engine_inputs_seed=2**63 + 1, rng_engine_inputs_offset=77)[0]
    assert got.tobytes() == want.tobytes()
    # every launch starts again from the first call's fields
    plan.launch([0] * len(pointers), 0, 0, 0)
    again = np.frombuffer(fn.calls[1][3], dtype=spec.params_dtype())[0]
    assert again["scale"] == np.float32(0.125) and again["head_dim"] == 64 and again[pointers[0]] == 0
    assert again["rng_engine_inputs_seed"] == 0


def test_plan_without_dropout_leaves_rng_fields_alone():
    p = filled(MemEffFwd, rng_engine_inputs_seed=0)
    fn = RecordingLauncher(MemEffFwd.params_dtype().itemsize)
    plan = plans.LaunchPlan.from_params(1, 0, (1, 1, 1), (32, 4, 1), 0, p, ("query_ptr",), False, {}, fn)
    plan.launch([8], 123, 456, 0)
    got = np.frombuffer(fn.calls[0][3], dtype=MemEffFwd.params_dtype())[0]
    assert got["rng_engine_inputs_seed"] == 0 and got["rng_engine_inputs_offset"] == 0 and got["query_ptr"] == 8


def test_sm90_backward_plan_launches_helpers_around_the_main_kernel_and_reencodes_moved_maps(monkeypatch):
    """prep, main, convert with one Params; a tensor map is re-pointed only when its address moved."""
    replaced = []
    monkeypatch.setattr(plans.tensormap, "replace_addresses",
                        lambda base, offsets, pointers: replaced.extend(zip(offsets, pointers)))
    maps = ("q_map", "k_map", "v_map", "do_map")
    pointers = ("out_ptr", "dq_ptr")
    p = filled(Sm90Bwd, scale=0.5, num_heads=4, out_ptr=1, dq_ptr=2)
    fn = RecordingLauncher(Sm90Bwd.params_dtype().itemsize)
    plan = plans.LaunchPlan.from_params(10, 0, (8, 4, 2), (384, 1, 1), 166912, p, pointers, False, {}, fn, maps,
                                        before=[(11, (4, 4, 2), (128, 1, 1))], after=[(12, (4, 4, 2), (128, 1, 1))])
    offsets = [Sm90Bwd.params_dtype().fields[m][1] for m in maps]
    plan.launch((100, 200, 300, 400, 5, 6), 0, 0, 99)
    assert [(c[0], c[4], c[5]) for c in fn.calls] == [(11, 0, 99), (10, 166912, 99), (12, 0, 99)]
    assert len({c[3] for c in fn.calls}) == 1, "the three kernels must see the same Params bytes"
    got = np.frombuffer(fn.calls[0][3], dtype=Sm90Bwd.params_dtype())[0]
    assert (got["out_ptr"], got["dq_ptr"], got["scale"], got["num_heads"]) == (5, 6, np.float32(0.5), 4)
    assert replaced == list(zip(offsets, (100, 200, 300, 400)))
    replaced.clear()
    plan.launch((100, 201, 300, 400, 7, 8), 0, 0, 99)  # only k moved
    assert replaced == [(offsets[1], 201)]


def test_plan_cache_is_bounded_and_evicts_the_oldest(monkeypatch):
    monkeypatch.setattr(plans, "_plans", {})
    monkeypatch.setattr(plans, "_MAX_PLANS", 3)
    for i in range(5):
        plans.remember(("k", i), i)
    assert [plans.lookup(("k", i)) for i in range(5)] == [None, None, 2, 3, 4]
    plans.clear()
    assert plans.lookup(("k", 4)) is None


class FakeArray:
    """What plans.signature reads of a CuPy array."""

    def __init__(self, shape, ptr, device=0):
        self.shape, self.strides, self.dtype = shape, tuple(8 for _ in shape), np.dtype(np.float16)
        self.data = types.SimpleNamespace(ptr=ptr, device_id=device)


def fake_signature(arrays):
    """What CupyMemory.signature does, over fake CuPy arrays."""
    return plans.signature(arrays, FakeArray)


def test_find_keys_apart_what_launches_apart(monkeypatch):
    monkeypatch.setattr(plans, "_plans", {})
    arrays = (FakeArray((2, 3), 4096), FakeArray((2, 3), 8192))
    key, plan = plans.find(fake_signature, "fwd", arrays, (None, 0.5))
    assert key is not None and plan is None
    plans.remember(key, "the plan")
    assert plans.find(fake_signature, "fwd", (FakeArray((2, 3), 128), FakeArray((2, 3), 64)), (None, 0.5)) == \
        (key, "the plan")  # other pointers with the same 64-byte alignment
    for other in [("bwd", arrays, (None, 0.5)), ("fwd", arrays, (None, 1)),
                  ("fwd", (FakeArray((2, 3), 4096), FakeArray((2, 3), 8200)), (None, 0.5)),  # 8-byte aligned
                  ("fwd", (FakeArray((2, 3), 4096), FakeArray((2, 3), 8192, device=1)), (None, 0.5)),
                  ("fwd", (FakeArray((2, 3), 4096), FakeArray((3, 2), 8192)), (None, 0.5))]:
        other_key, other_plan = plans.find(fake_signature, *other)
        assert other_key is not None and other_key != key and other_plan is None
    assert plans.find(fake_signature, "fwd", arrays, (None, True)) != plans.find(fake_signature, "fwd", arrays,
                                                                                      (None, 1))
    # not plannable: an unhashable option (a window given as a list), an input that is not a CuPy array
    assert plans.find(fake_signature, "fwd", arrays, ([3, 4], 0.5)) == (None, None)
    assert plans.find(fake_signature, "fwd", (np.zeros((2, 3)),) + arrays[1:], (None, 0.5)) == (None, None)


# === on a GPU: the plan against the full path ====================================================

try:
    import cupy
    HAVE_GPU = cupy.cuda.runtime.getDeviceCount() > 0
except Exception:  # no CuPy or no driver: the CPU tests above still run
    HAVE_GPU = False
gpu = pytest.mark.skipif(not HAVE_GPU, reason="needs a CUDA GPU")

if HAVE_GPU:
    import flashgen
    from attention_reference import (BWD_TOL, FWD_TOL, lse_err, make_bias, poisoned_allocations, randn, reference,
                                     rel_err)


def run(dtype, B, M, N, H, K, seed=None, causal=None, dropout_p=0.0, offset_elems=0, r=None):
    q = randn(r, (B * M * H * K + offset_elems,), dtype)[offset_elems:].reshape(B, M, H, K)
    k, v, do = (randn(r, shape, dtype) for shape in ((B, N, H, K), (B, N, H, K), (B, M, H, K)))
    opts = dict(causal=causal, dropout_p=dropout_p, seed=seed)
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, **opts)
        grads = flashgen.attention_backward(do, q, k, v, out, lse, **opts)
    cupy.cuda.runtime.deviceSynchronize()
    return (q, k, v, do), (out, lse) + tuple(grads)


CASES = [  # dtype, B, M, N, H, K: one key block per split (B*H small), f32 (delta computed outside), odd sizes
    ("f16", 1, 256, 1000, 2, 64),
    ("bf16", 2, 128, 129, 3, 128),
    ("f32", 1, 7, 300, 1, 32),
    ("f16", 3, 1, 7, 2, 96),
]


@gpu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("causal", [None, "top_left"])
def test_planned_calls_match_the_full_path_and_the_reference(case, causal):
    dtype = case[0]
    r = np.random.default_rng(7)
    plans.clear()
    inputs, full = run(*case, causal=causal, r=r)  # full path; leaves plans
    (q, k, v, do) = inputs
    assert {key[0] for key in plans._plans} == {"fwd", "bwd"}, "the full path left no forward or backward plan"
    # same signature, new data: the planned path
    q2, k2, v2, do2 = (x.copy() for x in inputs)
    for x in (q2, k2, v2, do2):
        x[...] = randn(r, x.shape, dtype)
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q2, k2, v2, causal=causal)
        grads = flashgen.attention_backward(do2, q2, k2, v2, out, lse, causal=causal)
    ref_out, ref_lse, ref_grads = reference(q2, k2, v2, causal=causal, grad_out=do2)
    assert rel_err(out, ref_out) < FWD_TOL[dtype] and lse_err(lse, ref_lse) < FWD_TOL[dtype]
    for g, want in zip(grads, ref_grads):
        assert rel_err(g, want) < BWD_TOL[dtype]
    # and bitwise what the full path computes for the same data
    plans.clear()
    with poisoned_allocations():
        out_f, lse_f = flashgen.attention_forward(q2, k2, v2, causal=causal)
        grads_f = flashgen.attention_backward(do2, q2, k2, v2, out_f, lse_f, causal=causal)
    for planned, fresh in zip((out, lse) + tuple(grads), (out_f, lse_f) + tuple(grads_f)):
        assert planned.shape == fresh.shape and planned.strides == fresh.strides
    # the forward is deterministic; split-key backwards add dQ parts in any order (the reference checked them)
    np.testing.assert_array_equal(cupy.asnumpy(out), cupy.asnumpy(out_f))
    np.testing.assert_array_equal(cupy.asnumpy(lse), cupy.asnumpy(lse_f))


@gpu
def test_planned_dropout_uses_each_calls_seed():
    r = np.random.default_rng(3)
    inputs, _ = run("f16", 1, 64, 64, 2, 64, seed=1, dropout_p=0.5, r=r)
    q, k, v, _ = inputs
    planned = [flashgen.attention_forward(q, k, v, dropout_p=0.5, seed=s)[0] for s in (1, 2, 1)]
    plans.clear()
    fresh = flashgen.attention_forward(q, k, v, dropout_p=0.5, seed=2)[0]
    a, b, c, f = (cupy.asnumpy(x) for x in planned + [fresh])
    assert not np.array_equal(a, b)  # a new seed draws a new mask
    np.testing.assert_array_equal(a, c)
    np.testing.assert_array_equal(b, f)
    with pytest.raises(ValueError, match="seed"):
        flashgen.attention_forward(q, k, v, dropout_p=0.5, seed=-1)  # validated on the planned path too
    with pytest.raises(ValueError, match="seed"):
        flashgen.attention_forward(q, k, v, dropout_p=0.5)


@gpu
def test_pointer_alignment_is_part_of_the_signature():
    """A 4-element offset pointer after an aligned call of the same shape must not reuse the
    aligned kernel's plan (it needs the unaligned kernel)."""
    r = np.random.default_rng(5)
    run("f16", 1, 33, 40, 2, 64, r=r)
    inputs, (out, lse, dq, dk, dv) = run("f16", 1, 33, 40, 2, 64, offset_elems=4, r=r)
    q, k, v, do = inputs
    assert q.data.ptr % 16 == 8
    ref_out, ref_lse, ref_grads = reference(q, k, v, grad_out=do)
    assert rel_err(out, ref_out) < FWD_TOL["f16"]
    for g, want in zip((dq, dk, dv), ref_grads):
        assert rel_err(g, want) < BWD_TOL["f16"]


BIAS_CASES = [  # dtype, B, M, N, H, K, the bias's broadcast dims, causal
    ("f16", 2, 256, 384, 2, 64, "", None),
    ("bf16", 1, 129, 200, 4, 128, "B", "top_left"),
    ("f16", 3, 7, 1000, 2, 64, "BM", None),      # one row for every query
    ("bf16", 2, 300, 136, 2, 128, "H", "bottom_right"),
]


def bias_inputs(r, case):
    """q, k, v, dO and a bias of a BIAS_CASES case, random."""
    dtype, B, M, N, H, K, broadcast, _ = case
    q, k, v, do = (randn(r, shape, dtype) for shape in ((B, M, H, K), (B, N, H, K), (B, N, H, K), (B, M, H, K)))
    return q, k, v, do, make_bias(r, dtype, B, H, M, N, broadcast)


def bias_call(case, q, k, v, do, bias, **backward):
    """Forward and backward with the bias, in a poisoned pool: (out, lse, the gradients)."""
    causal = case[-1]
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, attn_bias=bias, causal=causal)
        grads = flashgen.attention_backward(do, q, k, v, out, lse, attn_bias=bias, causal=causal, **backward)
    return (out, lse) + tuple(grads)


@gpu
@pytest.mark.parametrize("case", BIAS_CASES, ids=lambda c: "-".join(map(str, c)))
def test_bias_calls_take_plans_that_match_the_full_path(case):
    """A repeated call with attn_bias replays a plan (sm90_fwd/sm90_bwd make them) with the new
    bias's address: new data gives the reference's results, bitwise the full path's forward."""
    dtype, causal = case[0], case[-1]
    r = np.random.default_rng(11)
    plans.clear()
    first = bias_inputs(r, case)
    bias_call(case, *first)  # the full path
    made = {key[0]: plan.family for key, plan in plans._plans.items()}
    served = {d: next(n for n, _, w in flashgen.explain(*first[:3], attn_bias=first[4], causal=causal,
                                                          backward=d == "bwd") if w == "selected")
              for d in ("fwd", "bwd")}
    for direction, family in (("fwd", "sm90_fwd"), ("bwd", "sm90_bwd")):  # the families that plan bias calls
        assert (made.get(direction) == family) == served[direction].startswith(family + "_"), (made, served)
    args = bias_inputs(r, case)
    planned = bias_call(case, *args)
    ref_out, ref_lse, ref_grads = reference(*args[:3], bias=args[4], causal=causal, grad_out=args[3])
    assert rel_err(planned[0], ref_out) < FWD_TOL[dtype] and lse_err(planned[1], ref_lse) < FWD_TOL[dtype]
    for g, want in zip(planned[2:], ref_grads):
        assert rel_err(g, want) < BWD_TOL[dtype]
    plans.clear()
    fresh = bias_call(case, *args)
    np.testing.assert_array_equal(cupy.asnumpy(planned[0]), cupy.asnumpy(fresh[0]))
    np.testing.assert_array_equal(cupy.asnumpy(planned[1]), cupy.asnumpy(fresh[1]))


@gpu
@pytest.mark.parametrize("case", BIAS_CASES, ids=lambda c: "-".join(map(str, c)))
def test_bias_gradients_replay_plans_that_remake_dbias(case):
    """A repeated call with bias_requires_grad replays a plan that remakes dbias (zeroed where the
    kernels add into it or leave a band's holes) in a poisoned pool: new data gives the reference's
    gradients, each of the full path's shape and strides."""
    dtype, broadcast, causal = case[0], case[6], case[-1]
    r = np.random.default_rng(13)
    plans.clear()
    first = bias_inputs(r, case)
    bias_call(case, *first, bias_requires_grad=True)  # the full path
    made = [plan for key, plan in plans._plans.items() if key[0] == "bwd"]
    served = next(n for n, _, w in flashgen.explain(*first[:3], attn_bias=first[4], causal=causal, backward=True)
                  if w == "selected")
    if served.startswith("sm90_bwd_"):
        assert [plan.sizes.get("dbias") is not None for plan in made] == [True], "no plan remakes dbias"
    args = bias_inputs(r, case)
    planned = bias_call(case, *args, bias_requires_grad=True)[2:]
    ref_grads = reference(*args[:3], bias=args[4], causal=causal, grad_out=args[3])[2]
    dbias = planned[3].sum(axis=2, keepdims=True) if "M" in broadcast else planned[3]  # the API keeps M whole
    for g, want in zip(planned[:3] + (dbias,), ref_grads):
        assert rel_err(g, want) < BWD_TOL[dtype]
    plans.clear()
    fresh = bias_call(case, *args, bias_requires_grad=True)[2:]
    for a, b in zip(planned, fresh):
        assert a.shape == b.shape and a.strides == b.strides


@gpu
def test_bias_copies_leave_no_plan():
    """A bias whose rows validation re-pads (7 keys a row: not 16-byte rows) is a per-call copy: the
    call leaves no backward plan, and stays right."""
    r = np.random.default_rng(12)
    q, do = randn(r, (2, 40, 2, 64), "f16"), randn(r, (2, 40, 2, 64), "f16")
    k, v = randn(r, (2, 7, 2, 64), "f16"), randn(r, (2, 7, 2, 64), "f16")
    bias = make_bias(r, "f16", 2, 2, 40, 7, "B")
    plans.clear()
    for _ in range(2):
        out, lse = flashgen.attention_forward(q, k, v, attn_bias=bias)
        grads = flashgen.attention_backward(do, q, k, v, out, lse, attn_bias=bias, bias_requires_grad=True)
    assert not [key for key in plans._plans if key[0] == "bwd"]
    ref_out, _, ref_grads = reference(q, k, v, bias=bias, grad_out=do)
    assert rel_err(out, ref_out) < FWD_TOL["f16"]
    for g, want in zip(grads, ref_grads):
        assert rel_err(g, want) < BWD_TOL["f16"]


@gpu
@pytest.mark.parametrize("broadcast,causal", [("B", None), ("BH", "top_left")])
def test_deterministic_summed_planes_replay_the_same_bits(broadcast, causal):
    """deterministic=True with a broadcast bias: the kernels write dbias per plane and _dbias_sum adds
    them in a fixed order; a replay remakes the planes (zeroed for a band's holes) and the sum, and
    gives the full path's bits for the same data, and the reference's gradients."""
    r = np.random.default_rng(14)
    case = ("bf16", 3, 130, 136, 4, 64, broadcast, causal)
    args = bias_inputs(r, case)
    plans.clear()
    fresh = bias_call(case, *args, bias_requires_grad=True, deterministic=True)[2:]  # the full path
    made = [plan for key, plan in plans._plans.items() if key[0] == "bwd"]
    served = next(n for n, _, w in flashgen.explain(*args[:3], attn_bias=args[4], causal=causal, backward=True)
                  if w == "selected")
    if served.startswith("sm90_bwd_"):
        assert [plan.sizes["dbias"][2] is not None for plan in made] == [True], "no plan sums dbias's planes"
    planned = bias_call(case, *args, bias_requires_grad=True, deterministic=True)[2:]
    for a, b in zip(planned, fresh):
        assert a.shape == b.shape and a.strides == b.strides
        np.testing.assert_array_equal(cupy.asnumpy(a), cupy.asnumpy(b))
    ref_grads = reference(*args[:3], bias=args[4], causal=causal, grad_out=args[3])[2]
    for g, want in zip(planned, ref_grads):
        assert rel_err(g, want) < BWD_TOL["bf16"]


class FakeTensor:
    """The attributes of a torch tensor that ``tensor_signature`` reads."""

    def __init__(self, shape, ptr, is_cuda=True, dtype="torch.float16", device=0):
        self.shape, self._ptr, self.dtype, self._device = shape, ptr, dtype, device if is_cuda else -1

    def get_device(self):
        return self._device

    def size(self):
        return self.shape

    def stride(self):
        return tuple(1 for _ in self.shape)

    def data_ptr(self):
        return self._ptr


def test_torch_tensors_are_keyed_by_shape_strides_dtype_device_and_alignment():
    """Torch callers take plans too; their keys never meet a CuPy call's (another output kind)."""
    sig = lambda *ts: plans.tensor_signature(ts, FakeTensor)  # noqa: E731
    a = sig(FakeTensor((2, 3), 4096), FakeTensor((2, 3), 8192))
    assert a is not None and a[0] == "torch" and a[-1] == 0
    assert sig(FakeTensor((2, 3), 64), FakeTensor((2, 3), 128)) == a  # same 64-byte alignment
    for other in (sig(FakeTensor((2, 3), 4096), FakeTensor((2, 3), 8200)),
                  sig(FakeTensor((2, 3), 4096), FakeTensor((3, 2), 8192)),
                  sig(FakeTensor((2, 3), 4096), FakeTensor((2, 3), 8192, dtype="torch.bfloat16")),
                  sig(FakeTensor((2, 3), 4096), FakeTensor((2, 3), 8192, device=1))):
        assert other is not None and other != a
    assert sig(FakeTensor((2, 3), 4096), FakeTensor((2, 3), 8192, is_cuda=False)) is None
    assert sig(FakeTensor((2, 3), 4096), FakeArray((2, 3), 8192)) is None
    assert plans.signature((FakeArray((2, 3), 4096), FakeArray((2, 3), 8192)), FakeArray) != a


SPIN = (r'extern "C" __global__ void spin(long long cycles) '
        r'{ long long t = clock64(); while (clock64() - t < cycles) {} }')


@gpu
def test_packed_offsets_are_read_by_no_call_and_key_plans_by_their_contents():
    """Offsets built once with flashgen.packed_offsets: the calls give what the same offsets as CuPy
    arrays give (bitwise forward, rows past the last sequence zero in poisoned memory); from the
    second call on they replay plans keyed by the offsets' contents; and a call leaves the GPU's
    queue running, where a CuPy array's offsets are read (waiting for it)."""
    r = np.random.default_rng(21)
    cu_q, cu_k = np.array([0, 50, 50, 180], np.int32), np.array([0, 70, 100, 160], np.int32)
    q, do = randn(r, (1, 200, 4, 64), "bf16"), randn(r, (1, 200, 4, 64), "bf16")
    k, v = randn(r, (1, 170, 2, 64), "bf16"), randn(r, (1, 170, 2, 64), "bf16")
    offsets = dict(cu_seqlens_q=flashgen.packed_offsets(cu_q), cu_seqlens_k=flashgen.packed_offsets(cu_k))
    arrays = dict(cu_seqlens_q=cupy.asarray(cu_q), cu_seqlens_k=cupy.asarray(cu_k))
    plans.clear()
    results = []
    for given in (arrays, offsets, offsets):  # read; not read, leaving plans; replayed
        with poisoned_allocations():
            out, lse = flashgen.attention_forward(q, k, v, causal="top_left", **given)
            grads = flashgen.attention_backward(do, q, k, v, out, lse, causal="top_left", **given)
        results.append((out, lse) + tuple(grads))
    assert {key[0] for key in plans._plans} >= {"fwd", "bwd"}, "packed offsets left no plan"
    reference_run = results[0]
    for run_ in results[1:]:
        np.testing.assert_array_equal(cupy.asnumpy(run_[0]), cupy.asnumpy(reference_run[0]))
        for got, want, end in zip(run_[2:], reference_run[2:], (180, 160, 160)):
            assert bool((got[:, end:] == 0).all()), "rows past the last sequence are not zero"
            assert rel_err(got[:, :end], want[:, :end]) < BWD_TOL["bf16"]
    spin = cupy.RawKernel(SPIN, "spin")
    spin((1,), (1,), (np.int64(2_000_000_000),))  # about a second of one SM's clock
    flashgen.attention_forward(q, k, v, causal="top_left", **offsets)
    assert not cupy.cuda.get_current_stream().done, "the call waited for the GPU"
    cupy.cuda.runtime.deviceSynchronize()
