"""The Hopper families' compiled-in attention bias without a GPU: which instances serve a bias call,
that a bias instance is never launched without a bias (nor a plain one with one), and how the bias
reaches the kernels (its tensor map and steps, dbias's row pitch).  Nothing here imports CuPy
(tests/runtime_fakes.py's fakes stand in for arrays)."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from flashgen.runtime import tensormap, validate
from flashgen.runtime.arrays import elem_strides
from flashgen.runtime.families import sm90_bwd, sm90_common, sm90_fwd
from flashgen.runtime.select import Request, rejection
from flashgen.spec.sm90_bwd import Sm90Bwd
from flashgen.spec.sm90_fwd import Sm90Fwd
from runtime_fakes import H100, FakeArray, fake_call


@pytest.fixture(autouse=True)
def block_cupy(monkeypatch):
    """`import cupy` raises ImportError inside every test, even where CuPy is installed."""
    monkeypatch.setitem(sys.modules, "cupy", None)


def binary(spec):
    """What selection and the launch guard read of a built kernel."""
    return SimpleNamespace(spec=spec, name=spec.name, constants={
        "max_k": spec.max_k, "alignment": 8, "shared_memory_bytes": 200 * 1024})


def request(family, bias, K=64, softcap=False):
    return Request(family, "f16", K, K, 8, False, bias, H100, softcap=softcap, compiled_bias=True)


def first(kernels, req):
    return next((b.name for b in kernels if rejection(b, req) is None), None)


def test_forward_bias_is_compiled_in_and_matched_both_ways():
    """A Hopper call with a bias takes only a bias instance, one without only a plain one, and a bias
    call beyond the bias tiers (head dim 256) is refused with the reason, so example 41 takes it."""
    kernels = [binary(k) for k in Sm90Fwd.default_set() if k.dtype == "f16" and not k.band]
    assert first(kernels, request("sm90_fwd", True)) == "sm90_fwd_f16_k64_q192x128_s2_bias_sm90a", \
        "the plain calls' 192-row tile"
    assert first(kernels, request("sm90_fwd", False)) == "sm90_fwd_f16_k64_q192x128_s2_sm90a"
    band = [binary(k) for k in Sm90Fwd.default_set() if k.dtype == "f16" and k.band]
    assert first(band, Request("sm90_fwd", "f16", 64, 64, 8, False, True, H100, band=True, compiled_bias=True)) == \
        "sm90_fwd_f16_k64_q128x128_s2_band_bias_sm90a", "the 192-row band tile spills with a bias"
    assert first(kernels, request("sm90_fwd", True, K=96)) == "sm90_fwd_f16_k128_q128x128_s2_bias_sm90a", \
        "96 runs on the 128 tier"
    plain = next(b for b in kernels if not b.spec.bias)
    assert rejection(plain, request("sm90_fwd", True)) == "built without bias"
    biased = next(b for b in kernels if b.spec.bias)
    assert "built with bias" in rejection(biased, request("sm90_fwd", False))
    assert first(kernels, request("sm90_fwd", True, K=256)) is None, "no bias instance above head dim 128"
    # example 41's bias kernels (a null-pointer branch) still serve calls without one
    assert Request("mem_eff_fwd", "f16", 64, 64, 8, False, False, H100).compiled_bias is False


def test_backward_bias_with_softcapping_at_head_dim_64_runs_on_the_128_tier():
    """No backward instance has both at head dim 64 (spec: it spilled); the 128 tier's takes the call
    (TMA reads zeros past head dim 64), so such a call is served, not refused."""
    kernels = [binary(k) for k in Sm90Bwd.default_set() if k.dtype == "f16" and not k.band]
    assert first(kernels, request("sm90_bwd", True)) == "sm90_bwd_f16_k64_q128x128_s2_bias_sm90a"
    assert first(kernels, request("sm90_bwd", True, softcap=True)) == "sm90_bwd_f16_k128_q64x128_s2_softcap_bias_sm90a"
    assert first(kernels, request("sm90_bwd", False, softcap=True)) == "sm90_bwd_f16_k64_q128x128_s2_softcap_sm90a"
    assert first(kernels, request("sm90_bwd", True, K=192)) is None


@pytest.mark.parametrize("family,runtime", [(Sm90Fwd, sm90_fwd.RUNTIME), (Sm90Bwd, sm90_bwd.RUNTIME)])
def test_a_bias_instance_is_never_launched_without_a_bias(family, runtime):
    """Launching a kernel by hand (tests, benchmarks) with the other kind of call is a ValueError
    before anything touches the GPU: a bias instance would read through a missing bias."""
    biased = binary(next(k for k in family.default_set() if k.bias))
    plain = binary(next(k for k in family.default_set() if not k.bias))
    direction = family.DIRECTION
    with pytest.raises(ValueError, match=rf"^{biased.name} is built with an attention bias \(compiled in\); "
                                         r"the call has none$"):
        runtime.launch(fake_call(direction), biased)
    with pytest.raises(ValueError, match=rf"^{plain.name} is built without an attention bias \(compiled in\); "
                                         r"the call has one$"):
        runtime.launch(fake_call(direction, bias=FakeArray((2, 3, 5, 7))), plain)


@pytest.mark.parametrize("broadcast", ["", "B", "H", "M", "BH", "BM", "HM", "BHM"])
def test_the_bias_tensor_map_cuts_broadcast_dims_to_one_row_read_at_coordinate_zero(broadcast):
    """Validation leaves a broadcast dim with stride 0, which no TMA stride can be: the map gets extent 1
    there (bias_view, as [batch, query rows, heads, keys]) and the kernel a step of 0, so it always
    reads coordinate 0 of that dim; other dims keep their extent, stride and a step of 1."""
    B, H, M, N = 2, 3, 5, 7
    pitch = 8  # validation's rows: padded to 8 elements
    strides = [H * M * pitch, M * pitch, pitch, 1]
    for dim in broadcast:
        strides["BHM".index(dim)] = 0
    bias = FakeArray((B, H, M, N), strides=strides)
    view = tensormap.bias_view(bias)
    assert view.shape == tuple(1 if dim in broadcast else n for dim, n in zip("BMHN", (B, M, H, N)))
    assert view.strides == tuple(2 * strides["BHMN".index(dim)] for dim in "BMHN")
    assert tensormap.bmhk_problem(view) == ""
    assert sm90_common.bias_fields(bias) == {f"bias_{name}_step": int(dim not in broadcast)
                                             for dim, name in zip("BHM", ("batch", "head", "row"))}
    assert sm90_common.bias_fields(None) == {}


def test_a_bias_tma_cannot_read_is_refused_with_the_reason(monkeypatch):
    """Validation pads bias rows to 16 bytes, so this cannot happen through the API; a bias whose
    rows are not 16-byte aligned would be refused, the reason in explain, not read wrong."""
    monkeypatch.setattr(sm90_common, "device_info", lambda index: H100)
    hopper = sm90_fwd.RUNTIME
    assert hopper.unfit(fake_call(bias=FakeArray((2, 3, 5, 8)))) is None
    odd_rows = FakeArray((2, 3, 5, 7), strides=(3 * 5 * 7, 5 * 7, 7, 1))
    assert hopper.unfit(fake_call(bias=odd_rows)) == ("TMA cannot read attn_bias: its sequence stride is 7 elements; "
                                                      "TMA needs a positive multiple of 8 elements below 2**40 bytes")


def test_dbias_is_described_by_its_row_pitch():
    """The kernel derives the batch and head strides of its own dbias allocation from the row pitch."""
    B, H, M, N = 2, 3, 5, 7
    dbias = FakeArray((B, H, M, N), strides=(H * M * 8, M * 8, 8, 1), ptr=0x7F2A00001000)
    assert sm90_common.dbias_fields(dbias) == {"dbias_ptr": 0x7F2A00001000, "dbias_row_stride": 8}
    assert sm90_common.dbias_fields(None) == {}


def test_dbias_leaves_through_its_own_tensor_map_in_the_bias_boxes_as_wide_as_its_pitch(monkeypatch):
    """The backward's bias instances store dbias by TMA (BwdParams::dbias_map): the map describes the
    array the main kernel writes, [batch, query rows, heads, keys] at its row pitch and as wide as it
    (the masked keys' zeros fill the padding past N, which _dbias_sum reads), in the boxes and swizzle
    of the bias's map, and lands in dbias_map's bytes, not bias_map's."""
    encoded = []
    monkeypatch.setattr(tensormap, "encode_bmhk", lambda out, view, dtype, cols, rows, swizzle: encoded.append(
        (out.ctypes.data, view.shape, view.strides, view.data, dtype, cols, rows, swizzle)))
    params = np.zeros(1, dtype=Sm90Bwd.params_dtype())
    B, H, M, N = 2, 3, 5, 7
    dbias = FakeArray((B, H, M, N), strides=(H * M * 8, M * 8, 8, 1))
    problem = SimpleNamespace(dtype="f16")
    sm90_common.encode_dbias_map(params, dbias, problem)
    sm90_common.encode_dbias_map(params, None, problem)  # not wanted: nothing encoded
    at = params.ctypes.data + params.dtype.fields["dbias_map"][1]
    assert encoded == [(at, (B, M, H, 8), (2 * H * M * 8, 2 * 8, 2 * M * 8, 2), dbias.data, "f16",
                        sm90_common.BIAS_BOX, sm90_common.BIAS_BOX, sm90_common.BIAS_SWIZZLE_BYTES)]
    assert params.dtype.fields["dbias_map"][1] != params.dtype.fields["bias_map"][1]


@pytest.mark.parametrize("causal,zeroes,packed,allocator", [
    (None, 0, False, "empty"),          # no band: the kernels visit every (query, key)
    ("top_left", 0, False, "zeros"),    # kernels without the constant (sm80_bwd's): the runtime clears
    ("top_left", 1, False, "empty"),    # band bias instances write the hidden zeros themselves
    ("top_left", 1, True, "zeros"),     # ... for fixed-length batches only
])
def test_band_dbias_is_cleared_only_where_the_kernels_leave_holes(monkeypatch, causal, zeroes, packed, allocator):
    """dbias outside the band is zero: a band call's dbias is cleared first unless the kernels' constant
    zeroes_hidden_dbias says their main kernel writes those zeros (fixed-length batches)."""
    made = []

    def allocate(name):
        return lambda shape, dtype: made.append((name, shape)) or np.empty(shape, dtype=np.float16)

    monkeypatch.setattr(sm90_bwd, "cupy_module", lambda: SimpleNamespace(zeros=allocate("zeros"),
                                                                          empty=allocate("empty")))
    call = fake_call("bwd", bias=FakeArray((2, 3, 5, 7)), causal=causal, bias_requires_grad=True)
    if packed:
        call.p.seqstart_q = FakeArray((3,))
    dbias = sm90_bwd.RUNTIME.dbias(call, {"zeroes_hidden_dbias": zeroes} if zeroes else {})
    assert made == [(allocator, (call.p.B, call.p.H, call.q.shape[1], -(-call.k.shape[1] // 8) * 8))]
    assert dbias.shape[-1] == call.k.shape[1]
    call.options["bias_requires_grad"] = False
    assert sm90_bwd.RUNTIME.own_outputs(call, {"zeroes_hidden_dbias": 1}) == ((), {}, ())


FOLDS = [((2, 3, 5, 7), (1, 1)), ((1, 3, 5, 7), (2, 1)), ((3, 5, 7), (2, 1)), ((2, 1, 1, 7), (1, 3)), ((5, 7), (2, 3)),
         ((1, 1, 5, 7), (2, 3)), ((2, 3, 1, 7), (1, 1))]


@pytest.mark.parametrize("bias_shape,folds", FOLDS)
def test_dbias_folds_follow_the_extents_of_the_callers_bias(bias_shape, folds):
    """dbias is summed over the batch (heads) where the bias has extent 1 there or lacks the dim; a
    broadcast query dim is not summed."""
    assert validate.dbias_folds(FakeArray(bias_shape), 2, 3) == folds


class DeviceLike(np.ndarray):
    """numpy arrays with CuPy's ``.data.ptr`` (their address), for the launch fields."""

    @property
    def data(self):
        return SimpleNamespace(ptr=self.__array_interface__["data"][0])


@pytest.mark.parametrize("bias_shape,folds", FOLDS)
def test_sm90_sums_dbias_where_the_bias_broadcasts_and_sm80_leaves_it_to_the_api(monkeypatch, bias_shape, folds):
    """sm90_bwd returns the sum (its _dbias_sum kernel reads the kernels' per-(batch, head) dbias, kept
    to the launch); sm80_bwd, without such a kernel, returns dbias per (batch, head)."""
    def allocate(shape, dtype):
        return np.empty(shape, dtype=dtype).view(DeviceLike)

    monkeypatch.setattr(sm90_bwd, "cupy_module", lambda: SimpleNamespace(empty=allocate, zeros=allocate))
    call = fake_call("bwd", bias=FakeArray((2, 3, 5, 7)), attn_bias=FakeArray(bias_shape), bias_requires_grad=True)
    (dbias,), fields, kept = sm90_bwd.RUNTIME.own_outputs(call, {})
    batches, heads = folds
    assert dbias.shape == (2 // batches, 3 // heads, 5, 7) and elem_strides(dbias)[2] == 8  # the kernels' pitch
    if folds == (1, 1):
        assert kept == () and "dbias_sum_ptr" not in fields and fields["dbias_ptr"] == dbias.data.ptr
    else:
        (full,) = kept
        assert full.shape == (2, 3, 5, 7) and fields["dbias_ptr"] == full.data.ptr
        assert (fields["dbias_sum_ptr"], fields["dbias_sum_batch"], fields["dbias_sum_heads"]) == (
            dbias.data.ptr, batches, heads)
    from flashgen.runtime.families import sm80_bwd

    (per_plane,), fields, kept = sm80_bwd.RUNTIME.own_outputs(call, {})
    assert per_plane.shape == (2, 3, 5, 7) and kept == () and "dbias_sum_ptr" not in fields


@pytest.mark.parametrize("bias_shape,folds,expanded", [f + (False,) for f in FOLDS] + [((2, 1, 5, 7), (1, 3), True)])
@pytest.mark.parametrize("deterministic", [False, True])
def test_kernels_that_add_dbias_get_the_zeroed_sum_unless_the_order_must_repeat(monkeypatch, bias_shape, folds,
                                                                                expanded, deterministic):
    """Instances with the constant adds_dbias add their tiles into the gradient of the bias's shape
    (dbias_add): the runtime allocates only that, zeroed, and keeps no per-plane workspace for
    _dbias_sum.  deterministic=True keeps the planes and the sum (TMA reduce-adds come in no fixed
    order); a bias that folds nothing needs no adds; nor does one the caller expanded over the batch at
    stride 0 (the kernels would add every batch's tile into the plane they read, batch 0)."""
    made = []

    def allocator(name):
        def allocate(shape, dtype):
            made.append((name, shape))
            return np.zeros(shape, dtype=dtype).view(DeviceLike)
        return allocate

    monkeypatch.setattr(sm90_bwd, "cupy_module", lambda: SimpleNamespace(empty=allocator("empty"),
                                                                          zeros=allocator("zeros")))
    batches, heads = folds
    read_once = (batches > 1 or expanded, heads > 1)  # validation broadcasts these dims at stride 0
    bias = FakeArray((2, 3, 5, 7), strides=(0 if read_once[0] else 105, 0 if read_once[1] else 35, 7, 1))
    call = fake_call("bwd", bias=bias, attn_bias=FakeArray(bias_shape), bias_requires_grad=True,
                     deterministic=deterministic)
    (dbias,), fields, kept = sm90_bwd.RUNTIME.own_outputs(call, {"adds_dbias": 1})
    assert dbias.shape == (2 // batches, 3 // heads, 5, 7) and elem_strides(dbias)[2] == 8
    adds = folds != (1, 1) and not deterministic and not expanded
    assert fields.get("dbias_add", 0) == int(adds)
    if adds:
        assert kept == () and made == [("zeros", (2 // batches, 3 // heads, 5, 8))]
        assert fields["dbias_ptr"] == dbias.data.ptr and "dbias_sum_ptr" not in fields
    else:  # the kernels' per-plane dbias: the result itself, or (folds) the workspace _dbias_sum reads
        assert [full.shape for full in kept] == ([] if folds == (1, 1) else [(2, 3, 5, 7)])


def test_the_api_folds_what_the_kernels_left_per_plane_in_float32():
    rng = np.random.default_rng(0)
    full = (rng.standard_normal((2, 3, 5, 7)) * 100).astype(np.float16)
    batch = validate.fold_dbias(np, full, FakeArray((1, 3, 5, 7)), 2, 3)
    assert batch.shape == (1, 3, 5, 7) and batch.dtype == np.float16
    assert np.array_equal(batch, full.astype(np.float32).sum(0, keepdims=True).astype(np.float16))
    both = validate.fold_dbias(np, full, FakeArray((5, 7)), 2, 3)
    assert np.array_equal(both, full.astype(np.float32).sum((0, 1), keepdims=True).astype(np.float16))
    assert validate.fold_dbias(np, batch, FakeArray((1, 3, 5, 7)), 2, 3) is batch  # summed by sm90's kernel
    assert validate.fold_dbias(np, full, FakeArray((2, 3, 1, 7)), 2, 3) is full  # no broadcast batch or heads


@pytest.mark.parametrize("family,bias_shape,kc,options,recipe", [
    ("sm90_bwd", (1, 3, 5, 7), {"adds_dbias": 1}, {}, ((1, 3, 5, 8), True, None)),       # added into: zeroed
    ("sm90_bwd", (2, 3, 5, 7), {}, {}, ((2, 3, 5, 8), False, None)),                     # every tile stored
    ("sm90_bwd", (2, 3, 5, 7), {}, {"causal": "top_left"}, ((2, 3, 5, 8), True, None)),  # band holes to clear
    ("sm90_bwd", (1, 3, 5, 7), {"adds_dbias": 1}, {"deterministic": True},               # planes _dbias_sum adds
     ((2, 3, 5, 8), False, (1, 3, 5, 8))),
    ("sm90_bwd", (1, 1, 5, 7), {}, {"causal": "top_left"}, ((2, 3, 5, 8), True, (1, 1, 5, 8))),  # kernels before adds
    ("sm80_bwd", (1, 3, 5, 7), {}, {}, None),                                            # planes the API folds
    ("sm80_bwd", (2, 3, 5, 7), {}, {}, ((2, 3, 5, 8), False, None)),
    ("sm90_bwd", (1, 3, 5, 7), {"adds_dbias": 1}, {"bias_requires_grad": False}, None),
])
def test_a_replay_remakes_dbias_only_where_the_launch_leaves_it_final(monkeypatch, family, bias_shape, kc, options,
                                                                    recipe):
    """A dbias call is planned (``replayable_dbias``) where what its launches leave is the gradient the
    API returns: the kernels' one array, added into (zeroed) or stored whole, or the sum _dbias_sum
    writes of their planes; not where the API folds planes itself."""
    from flashgen.runtime.families import sm80_bwd

    runtime = {"sm90_bwd": sm90_bwd, "sm80_bwd": sm80_bwd}[family].RUNTIME
    allocate = lambda shape, dtype: np.zeros(shape, dtype=dtype).view(DeviceLike)  # noqa: E731
    monkeypatch.setattr(sm90_bwd, "cupy_module", lambda: SimpleNamespace(empty=allocate, zeros=allocate))
    folded = tuple(0 if n == 1 else s for n, s in zip(bias_shape, (105, 35, 7, 1)))
    options = dict(dict(bias_requires_grad=True, deterministic=False), **options)
    call = fake_call("bwd", bias=FakeArray((2, 3, 5, 7), strides=folded), attn_bias=FakeArray(bias_shape), **options)
    extra, fields, workspace = runtime.own_outputs(call, kc)
    assert runtime.replayable_dbias(call, kc, extra, fields, workspace) == recipe


class ReplayMemory:
    """numpy stand-ins for a caller's memory: carved arrays and zeroed ones, each at its own address."""

    def __init__(self):
        self.zeroed = []

    ptr = staticmethod(lambda x: x.data.ptr)

    def empty(self, shape, near):
        return np.full(shape, np.nan, dtype=np.float16).view(DeviceLike)

    def zeros(self, shape, near, stream):
        self.zeroed.append((shape, stream))
        return np.zeros(shape, dtype=np.float16).view(DeviceLike)

    def carve(self, pieces, workspace_at, total, stream):
        return [self.empty(shape, near) for _, shape, near in pieces], 0x1000, None

    def stream(self, stream, device):
        return 77


@pytest.mark.parametrize("remade", [((1, 3, 5, 8), True, None), ((2, 3, 5, 8), False, None),
                                    ((2, 3, 5, 8), True, (1, 3, 5, 8))])
def test_a_replay_points_the_dbias_map_after_the_bias_and_its_pointer_last(monkeypatch, remade):
    """The plan's tensor maps are (q, k, v, dO, bias, dbias) and its pointers end with dbias_ptr (then
    dbias_sum_ptr) after any trailing arrays' (``launch``'s order): the replay hands the kernels'
    dbias address to both, zeroes it on the launch's stream only where the recipe says, and returns
    it -- or the sum of its planes -- N keys wide."""
    import contextlib

    monkeypatch.setattr(sm90_bwd, "on_device", lambda cupy, device: contextlib.nullcontext())
    monkeypatch.setattr(sm90_bwd, "cupy_module", lambda: None)
    launched = []
    plan = SimpleNamespace(sizes={"layout": (0,) * 7, "trailing": 1, "dbias": remade}, device=0,
                           launch=lambda pointers, seed, offset, stream: launched.append((pointers, stream)))
    shapes = [(2, 5, 3, 64), (2, 5, 3, 64), (2, 7, 3, 64), (2, 7, 3, 64), (2, 5, 3, 64), (2, 3, 8), (1, 3, 5, 8), (4,)]
    arrays = [np.zeros(s, dtype=np.float16).view(DeviceLike) for s in shapes]
    grad_out, q, k, v, out, lse, bias, mask = arrays
    memory = ReplayMemory()
    *_, dbias = sm90_bwd.RUNTIME.replay(plan, memory, arrays, None, 0, None)
    (pointers, stream), = launched
    ptr = memory.ptr
    shape, zeroed, sum_shape = remade
    assert dbias.shape == (sum_shape or shape)[:3] + (7,) and stream == 77
    assert memory.zeroed == ([(shape, 77)] if zeroed else [])
    assert pointers[6:9] == (ptr(out), ptr(grad_out), ptr(lse))
    if sum_shape is None:
        assert pointers[:6] == (ptr(q), ptr(k), ptr(v), ptr(grad_out), ptr(bias), ptr(dbias))
        assert pointers[-2:] == (ptr(mask), ptr(dbias))
    else:  # the kernels write planes (the map's and dbias_ptr's address), _dbias_sum the result
        assert pointers[:5] == (ptr(q), ptr(k), ptr(v), ptr(grad_out), ptr(bias)) and pointers[5] != ptr(dbias)
        assert pointers[-3] == ptr(mask) and pointers[-2] == pointers[5] and pointers[-1] == ptr(dbias)
