"""Hostile inputs on the CPU: the table (hostile_cases.py) over fake arrays and a fake CuPy, which fails
the test on anything but validation, and the validation helpers' limits directly."""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from flashgen.errors import UnsupportedError
from flashgen.runtime import arrays, limits, select, validate
from flashgen.runtime.arch import DeviceInfo

from hostile_cases import CASES, call_of
from hostile_fakes import FAKE_PTR, INT32_MAX, CpuBackend, CudaOnlyTensor, DLPackProducer, FakeDevArray, make_fake_cupy


@pytest.fixture
def fake_cupy(monkeypatch):
    m = make_fake_cupy()
    monkeypatch.setitem(sys.modules, "cupy", m)
    return m


# === (a) CPU: the table over fake arrays and a fake CuPy =====================================

@pytest.mark.parametrize("case", [c for c in CASES if c.where != "gpu"], ids=lambda c: c.id)
def test_rejected_before_any_gpu_work(case, fake_cupy):
    _, call = call_of(CpuBackend(), case)
    with pytest.raises(case.exc, match=case.match) as e:
        call()
    assert type(e.value) is case.exc  # not merely a subclass


def common(q, k, v, causal=None, dropout_p=0.0, seed=None, cu_q=None, cu_k=None):
    return validate.problem(q, k, v, causal, None, dropout_p, seed, 0, cu_q, cu_k)


def fake_broadcast(shape, dtype=np.float16):
    return FakeDevArray(shape, dtype, strides=(0, 0, 0, 1))


@pytest.mark.parametrize("shape,strides,ok", [
    ((1, 2, 1, 8), (0, INT32_MAX, 8, 1), True),            # row offset 1 * (2**31 - 1): the largest that fits
    ((1, 2, 1, 8), (0, 2**31, 8, 1), False),
    ((1, 3, 1, 8), (0, 2**30 - 1, 8, 1), True),
    ((1, 3, 1, 8), (0, 2**30, 8, 1), False),               # each field fits, the product does not
    ((1, 4, 3, 8), (0, 8, INT32_MAX // 2, 1), True),        # head offset 2 * (2**30 - 1)
    ((1, 4, 3, 8), (0, 8, 2**30, 1), False),
    ((1, 1, 1, 8), (0, 2**40, 2**40, 1), True),            # one row, one head: no offset is ever formed
])
def test_input_offset_limits(shape, strides, ok):
    x = FakeDevArray(shape, strides=strides)
    other = fake_broadcast(shape)
    for args in ((x, other, other), (other, x, other), (other, other, x)):
        if ok:
            common(*args)
        else:
            with pytest.raises(ValueError, match=r"^[qkv]_stride[MH]: .*overflows the kernels' 32-bit offset"):
                common(*args)


@pytest.mark.parametrize("B,H,M,N,ok", [
    (1, 32, 8192, 8192, True),    # (H - 1) * M * N = 31 * 2**26 fits int32: one batch element of 32 heads is fine
    (2, 32, 8192, 8192, False),   # H * M * N = 2**31: the backward's int32 product (kernel_backward.h:783) wraps
    (2, 31, 8192, 8192, True),
    (1, 33, 8192, 8192, False),   # head * M * N reaches 32 * 2**26 = 2**31 (kernel_backward.h:784)
    (4, 16, 8192, 8192, True),    # (B * H - 1) * M * N = 63 * 2**26 < 2**32
    (5, 16, 8192, 8192, False),   # 79 * 2**26 > 2**32 - 1: the forward's uint32 sum (kernel_forward.h:241) wraps
    (1, 1, 46341, 46341, False),  # row * N + col reaches M * N - 1 = 2147488280 (kernel_backward.h:1703)
    (1, 1, 46340, 46341, True),
])
def test_dropout_offset_limits(B, H, M, N, ok, monkeypatch):
    monkeypatch.setenv("FLASHGEN_FAMILIES", "mem_eff_fwd,mem_eff_bwd")  # example 41's stream, on any machine
    q, k = fake_broadcast((B, M, H, 8)), fake_broadcast((B, N, H, 8))
    if ok:
        common(q, k, k, dropout_p=0.1, seed=1)
    else:
        with pytest.raises(ValueError, match=r"^dropout_batch_head_rng_offset: "):
            common(q, k, k, dropout_p=0.1, seed=1)
    common(q, k, k)  # without dropout the same shapes are fine


def test_dropout_offsets_past_example_41s_are_left_to_flashgens_pairs(monkeypatch):
    """Where one of flashgen's pairs may draw the mask (its stream has no such limits), validation lets a call
    past example 41's offsets through, and the example-41 families refuse it themselves with the same reason."""
    from flashgen.runtime import dropout
    from flashgen.runtime.families import mem_eff_fwd
    q, k = fake_broadcast((2, 8192, 32, 8)), fake_broadcast((2, 8192, 32, 8))
    monkeypatch.setattr(dropout, "may_draw", lambda p: True)
    c = common(q, k, k, dropout_p=0.1, seed=1)
    assert limits.dropout_offsets_refusal(c).startswith("dropout_batch_head_rng_offset: ")
    monkeypatch.setattr(dropout, "drawing_pair", lambda call: (None, "no dropout kernel (a bias, say)"))
    call = SimpleNamespace(p=c, bias=None, block_mask=None)
    assert mem_eff_fwd.unfit_example41(call) == limits.dropout_offsets_refusal(c)
    monkeypatch.setattr(dropout, "may_draw", lambda p: False)
    with pytest.raises(ValueError, match=r"^dropout_batch_head_rng_offset: "):
        common(q, k, k, dropout_p=0.1, seed=1)


@pytest.mark.parametrize("error", [ImportError("no module named cupy"), RuntimeError("cudaErrorNoDevice"),
                                   UnsupportedError("no sm80_fwd kernel can run on GPU 0")])
def test_dropout_offsets_where_no_gpu_answers_are_judged_by_example_41s_limits(monkeypatch, error):
    """No CuPy, no CUDA device or no kernels to ask whether a pair may draw: example 41's limits apply."""
    from flashgen.runtime import dropout

    def may_draw(p):
        raise error

    monkeypatch.setattr(dropout, "may_draw", may_draw)
    q, k = fake_broadcast((2, 8192, 32, 8)), fake_broadcast((2, 8192, 32, 8))
    with pytest.raises(ValueError, match=r"^dropout_batch_head_rng_offset: "):
        common(q, k, k, dropout_p=0.1, seed=1)


def test_a_bug_in_asking_whether_a_pair_may_draw_is_not_taken_for_a_missing_gpu(monkeypatch):
    from flashgen.runtime import dropout

    monkeypatch.setattr(dropout, "may_draw", lambda p: None.attribute)
    q, k = fake_broadcast((2, 8192, 32, 8)), fake_broadcast((2, 8192, 32, 8))
    with pytest.raises(AttributeError):
        common(q, k, k, dropout_p=0.1, seed=1)


def test_size_limits_right_at_the_bound():
    # lse offsets (kernel_forward.h:315, uint32): batch * heads * lse_dim == 2**32 is the last that fits
    common(*(fake_broadcast((2**15, 64, 2**11, 8)) for _ in range(3)))
    with pytest.raises(ValueError, match=r"^logsumexp_ptr: "):
        common(*(fake_broadcast((2**15, 65, 2**11, 8)) for _ in range(3)))  # lse_dim 96
    # 65535 heads / batch elements is the grid's limit, not past it
    common(*(fake_broadcast((1, 4, 65535, 8)) for _ in range(3)))
    common(*(fake_broadcast((65535, 4, 1, 8)) for _ in range(3)))
    # rows: the last accepted count (head dim 1, so no other offset gets near int32)
    big = fake_broadcast((1, limits.MAX_ROWS, 1, 1))
    common(fake_broadcast((1, 4, 1, 1)), big, big)
    common(big, fake_broadcast((1, 4, 1, 1)), fake_broadcast((1, 4, 1, 1)))
    past = fake_broadcast((1, limits.MAX_ROWS + 1, 1, 1))
    with pytest.raises(ValueError, match=r"^num_queries = 2143289345 is too large"):
        common(past, fake_broadcast((1, 4, 1, 1)), fake_broadcast((1, 4, 1, 1)))
    # the contiguous outputs: (M - 1) * H * Kv == 2**31 - 1 fits, one more row does not
    kv = fake_broadcast((1, 4, 1000, 1))
    common(fake_broadcast((1, 2147484, 1000, 1)), kv, kv)  # 2147483 * 1000 = 2147483000
    with pytest.raises(ValueError, match=r"^o_strideM: .* = 2147484 \* 1000 = 2147484000 overflows"):
        common(fake_broadcast((1, 2147485, 1000, 1)), kv, kv)


def test_empty_problems_skip_the_launch_limits():
    # M = 0 or N = 0 never launches: the grid and offset limits do not apply, the call is valid
    huge_heads = (1, 0, 70000, 8)
    c = common(fake_broadcast(huge_heads), fake_broadcast((1, 4, 70000, 8)), fake_broadcast((1, 4, 70000, 8)))
    assert c.M == 0 and c.H == 70000
    c = common(fake_broadcast((70000, 4, 1, 8)), fake_broadcast((70000, 0, 1, 8)), fake_broadcast((70000, 0, 1, 8)))
    assert c.N == 0


@pytest.mark.parametrize("M,H,causal,refused", [
    (1, 4, None, True), (33, 2, None, True), (65, 2, "bottom_right", True), (2, 4, None, False),
    (40, 2, "top_left", False), (64, 8, None, False), (1, 1, None, False), (1, 1, "bottom_right", False),
    (1, 1, "top_left", True),
])
def test_heads_broadcast_is_refused_only_where_the_fast_path_fires(M, H, causal, refused):
    q = FakeDevArray((2, M, H, 64))
    kv = FakeDevArray((2, 48, H, 64), strides=(48 * 64, 64, 0, 1))
    if refused:
        with pytest.raises(UnsupportedError, match=r"^k and v are both broadcast over heads"):
            common(q, kv, kv, causal=causal)
    else:
        common(q, kv, kv, causal=causal)
    # one of them materialised (head stride != 0): the fast path is off
    common(q, kv, FakeDevArray((2, 48, H, 64)), causal=causal)


def test_check_int32_multiplies_row_strides_by_rows():
    limits.check_int32(q_strideM=2**30 - 1, num_queries=3)  # 2 * (2**30 - 1) fits
    with pytest.raises(ValueError, match=r"^q_strideM: the last row offset \(num_queries - 1\) \* q_strideM = "
                                         r"2 \* 1073741824 = 2147483648 overflows"):
        limits.check_int32(q_strideM=2**30, num_queries=3)
    # dbias rows (backward): (M - 1) * gB_strideM, and the keys' strides go with num_keys
    with pytest.raises(ValueError, match=r"^gB_strideM: "):
        limits.check_int32(gB_strideM=65536, num_queries=32769, num_keys=65536)
    with pytest.raises(ValueError, match=r"^v_strideM: .*\(num_keys - 1\)"):
        limits.check_int32(v_strideM=2**20, num_queries=2, num_keys=2**11 + 1)
    limits.check_int32(k_strideH=2**30, num_keys=2**20)  # head strides are checked by _check_bmhk, with H
    limits.check_int32(q_strideM=2**30)  # no row count given: only the field itself


def test_alignment_of_offset_views():
    """What the misaligned GPU cases feed the selector: f16 views 1 or 2 elements in have alignment
    1 or 2 (no kernel: every one needs 4); 4 elements in is 4 (the unaligned kernels serve it)."""
    ok = FakeDevArray((2, 40, 2, 64))
    for elems, expected in ((1, 1), (2, 2), (3, 1), (4, 4), (8, 8)):
        x = CpuBackend().offset((2, 40, 2, 64), elems)
        assert arrays.alignment([x, ok, ok], (64, 64)) == expected
    f32 = CpuBackend().offset((2, 48, 2, 64), 1, "f32")
    assert arrays.alignment([FakeDevArray((2, 40, 2, 64), np.float32), f32], (64, 64)) == 1
    odd_byte = FakeDevArray((2, 40, 2, 64), ptr=FAKE_PTR + 1)  # not even a whole element in
    assert arrays.alignment([odd_byte], (64, 64)) == 1


def _varlen(cu, name, total, device):
    """cu_seqlens as _common reads them: (device offsets, longest sequence)."""
    cu, host = validate.read_offsets(cu, name, total)
    return validate.offsets_on_device(cu, host, device), int(np.diff(host).max())


def test_varlen_copies_what_the_kernel_cannot_read(fake_cupy):
    packed = FakeDevArray((3,), np.int32, host=np.array([0, 20, 40], np.int32))
    dev, longest = _varlen(packed, "cu_seqlens_q", 40, 0)
    assert dev is packed and longest == 20  # used in place: no copy
    strided = FakeDevArray((3,), np.int32, strides=(2,), host=np.array([0, 20, 40], np.int32))
    dev, _ = _varlen(strided, "cu_seqlens_q", 40, 0)
    assert dev is not strided and dev.flags.c_contiguous and list(dev.host) == [0, 20, 40]
    elsewhere = FakeDevArray((3,), np.int32, device=1, host=np.array([0, 20, 40], np.int32))
    assert _varlen(elsewhere, "cu_seqlens_q", 40, 0)[0] is not elsewhere
    # a GPU tensor of another library (np.asarray refuses it) is read through as_array
    dev, longest = _varlen(CudaOnlyTensor([0, 7, 40]), "cu_seqlens_k", 40, 0)
    assert list(dev.host) == [0, 7, 40] and longest == 33


def test_as_array(fake_cupy):
    x = FakeDevArray((2, 4, 1, 8))
    assert arrays.as_array(x, "q") is x
    view = FakeDevArray((2, 4, 1, 8))
    assert arrays.as_array(DLPackProducer(2, fake_view=view), "q") is view  # a CUDA producer: viewed
    assert arrays.as_array(DLPackProducer(13, fake_view=view), "q") is view  # managed memory too
    with pytest.raises(TypeError, match=r"^q is on pinned host memory, not a CUDA GPU"):
        arrays.as_array(DLPackProducer(3), "q")
    with pytest.raises(TypeError, match=r"^v is on DLPack device type 14, not a CUDA GPU"):
        arrays.as_array(DLPackProducer(14), "v")
    with pytest.raises(TypeError, match=r"^lse must be a CuPy array .*, not float$"):
        arrays.as_array(1.0, "lse")
    # a size-1 dim may have any stride, negative included: it is never multiplied by anything but 0
    one = FakeDevArray((1, 4, 1, 8), strides=(-5, 8, -3, 1))
    assert arrays.as_array(one, "q") is one


def test_explicit_seed_and_scale_values_that_are_accepted():
    q, k, v = (FakeDevArray((1, 4, 1, 8)) for _ in range(3))
    assert validate.problem(q, k, v, None, np.float32(0.25), 0.0, None, 0, None, None).scale == 0.25
    assert validate.problem(q, k, v, None, 0, 0.0, None, 0, None, None).scale == 0.0  # uniform attention: legal
    assert validate.problem(q, k, v, None, -2, 0.0, None, 0, None, None).scale == -2.0
    c = validate.problem(q, k, v, "top_left", None, 0.5, np.uint64(2**64 - 1), np.int64(3), None, None)
    assert (c.seed, c.offset, c.mask) == (2**64 - 1, 3, 1)
    assert validate.problem(q, k, v, np.str_("bottom_right"), None, 0.0, None, 0, None, None).mask == 2


# The backward's dK/dV workspace: Params::workspace_elements_gk() is
#   num_splits_key * align_up(num_keys, kBlockSizeJ) * align_up(head_dim, kBlockSizeI)
# in int32 (kernel_backward.h:876, and :883 for dV); the runtime sizes the buffer in Python
# (select.workspace_bytes) but the kernel's per-(batch, head) offsets wrap.  Only select.py can
# fix it (cap num_splits_key so the product fits); this pins the bug until then.
def test_split_key_workspace_fits_int32():
    k65536 = SimpleNamespace(constants=dict(block_i=64, block_j=64, enable_split_keys=1, min_blocks_per_sm=3,
                                            needs_accum_grad_k=1, needs_accum_grad_v=1))
    h200 = DeviceInfo(index=0, name="NVIDIA H200", cc=90, multiprocessors=132, shared_memory_optin=232448)
    N, K = 65536, 256  # f16, B * H = 1: 200 splits
    splits = select.num_splits_key(k65536, 1, 1, N, h200, K, K)
    assert splits > 1  # the cap bites, but still splits
    assert splits * select._align_up(N, 64) * select._align_up(K, 64) <= INT32_MAX
