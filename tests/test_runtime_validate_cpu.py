"""The argument checks that run before anything touches a device, the families' refusals, and the
runtime's independence of CuPy until a call, over fake arrays (tests/runtime_fakes.py)."""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from flashgen.errors import UnsupportedError
from flashgen.runtime import api, arrays, block_fallback, families, limits, validate
from flashgen.runtime.families import sm90_common
from flashgen.runtime.block_masks import block_mask

from runtime_fakes import FakeArray, H100, T4, fake_call, qkv

pytestmark = pytest.mark.usefixtures("cupy_is_never_imported", "block_cupy")


# === validation without a GPU =============================================================


def common(q, k, v, causal=None, scale=None, dropout_p=0.0, seed=None, offset=0):
    return validate.problem(q, k, v, causal, scale, dropout_p, seed, offset, None, None)


def test_valid_inputs():
    q, k, v = qkv(B=2, M=5, N=7, H=3, K=64, Kv=32)
    c = common(q, k, v)
    assert isinstance(c, validate.Problem)
    assert (c.B, c.M, c.N, c.H, c.K, c.Kv) == (2, 5, 7, 3, 64, 32)
    assert (c.dtype, c.device, c.mask, c.dropout_p, c.seed, c.offset) == ("f16", 0, 0, 0.0, 0, 0)
    assert c.scale == pytest.approx(1 / 8)
    assert (c.seqstart_q, c.seqstart_k, c.batches) == (None, None, 2)
    q, k, v = qkv(K=80, Kv=64, dtype=np.float32)
    c = common(q, k, v, causal="bottom_right", dropout_p=0.25, seed=2**64 - 1, offset=7)
    assert c.scale == pytest.approx(1 / math.sqrt(80))  # from K, not Kv
    assert (c.dtype, c.mask, c.dropout_p, c.seed, c.offset) == ("f32", 2, 0.25, 2**64 - 1, 7)
    assert common(q, k, v, causal="top_left", scale=0.5).scale == 0.5
    assert common(q, k, v, causal="top_left").mask == 1
    assert common(q, k, v, seed=np.uint64(3), offset=np.int64(5)).seed == 3
    assert common(*qkv(M=0, N=0)).M == 0  # empty sequences are valid (no launch)


@pytest.mark.parametrize("window,causal,M,N,band", [
    (None, "top_left", 5, 7, (-2**30, 0)),
    (None, "bottom_right", 5, 7, (-2**30, 2)),
    ((3, None), None, 5, 7, (-3, 2**30)),
    ((None, 4), None, 5, 7, (-2**30, 4)),
    ((3, 4), "bottom_right", 5, 7, (2 - 3, 2)),  # the causal mask caps the right side at the diagonal
    ((0, 0), None, 5, 7, (0, 0)),
    ((2**40, 2**40), None, 5, 7, (-2**30, 2**30)),  # clamped to the kernels' unbounded
])
def test_window_becomes_the_kernels_band(window, causal, M, N, band):
    c = validate.problem(*qkv(M=M, N=N), causal, None, 0.0, None, 0, None, None, window=window)
    assert sm90_common.band(c) == band + (0,)
    # packed batches: top-left bounds, and the kernels shift each sequence onto its own diagonal
    packed = dataclasses.replace(c, seqstart_q="offsets", seqstart_k="offsets")
    top_left = sm90_common.band(dataclasses.replace(c, mask=validate.MASKS["top_left"] if causal else 0))
    assert sm90_common.band(packed) == top_left[:2] + (int(causal == "bottom_right"),)


def test_window_and_softcap_are_checked():
    q, k, v = qkv()
    c = validate.problem(q, k, v, None, None, 0.0, None, 0, None, None, window=[None, None], softcap=0)
    assert (c.window, c.softcap) == (None, 0.0), "a window without limits is no window"
    assert validate.problem(q, k, v, None, None, 0.0, None, 0, None, None, window=(np.int64(3), None)).window == (3, None)
    for bad, error in (((1,), TypeError), ((1, 2, 3), TypeError), (5, TypeError), ((1.5, 2), TypeError),
                       ((True, 2), TypeError), ((-1, 2), ValueError), ((2, -3), ValueError)):
        with pytest.raises(error, match="window"):
            validate.problem(q, k, v, None, None, 0.0, None, 0, None, None, window=bad)
    for bad, error in (("5", TypeError), (True, TypeError), (None, TypeError), (-1.0, ValueError),
                       (float("inf"), ValueError), (float("nan"), ValueError)):
        with pytest.raises(error, match="softcap"):
            validate.problem(q, k, v, None, None, 0.0, None, 0, None, None, softcap=bad)
    c = validate.problem(q, k, v, None, 0.25, 0.0, None, 0, None, None, softcap=10)
    fields = sm90_common.band_fields(c)
    assert (fields["softcap_in"], fields["softcap_out"]) == (0.025, 40.0)
    assert "softcap_in" not in sm90_common.band_fields(common(q, k, v)), "0 (off) unless asked for"


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_families_refuse_with_the_reason_and_dispatch_lists_them_all(direction, monkeypatch):
    """Each family says what a call needs that it lacks; with none left, the error names them in order."""
    monkeypatch.setattr(sm90_common, "device_info", lambda index: T4)  # older than every own family's GPU
    serving = families.serving(direction)
    assert [f.name for f in serving] == [f"sm90_{direction}", f"sm80_{direction}", f"mem_eff_{direction}"], \
        "the spec's order"
    hopper, example41 = serving[0], serving[-1]
    windowed = fake_call(direction, window=(4, 4), softcap=3.0)
    assert example41.refusal(windowed).startswith("no sliding window or soft-capping")
    assert "compute-capability 9.0" in hopper.refusal(windowed) and "Tesla T4 (sm_75)" in hopper.refusal(windowed)
    with pytest.raises(UnsupportedError, match=rf"(?s)no kernel family serves this call:\n  sm90_{direction}: .*9\.0.*"
                                               rf"\n  sm80_{direction}: .*8\.0 or newer.*sm_75\)"
                                               rf"\n  mem_eff_{direction}: no sliding window"):
        families.dispatch(windowed)
    assert example41.refusal(fake_call(direction)) is None
    monkeypatch.setattr(sm90_common, "device_info", lambda index: H100)
    assert hopper.unfit(fake_call(direction)) is None
    padded_bias = FakeArray((2, 3, 5, 7), strides=(3 * 5 * 8, 5 * 8, 8, 1))  # as validation leaves it
    assert hopper.unfit(fake_call(direction, bias=padded_bias)) is None, "bias instances take it"
    for call, why in ((fake_call(direction, arrays=qkv(dtype=np.float32)), "float32"),
                      (fake_call(direction, arrays=qkv(K=64, Kv=32)), "equal q/v head dims only; the call has 64 and 32"),
                      (fake_call(direction, arrays=(FakeArray((2, 5, 3, 64), ptr=0x7F2A00000008),) + qkv()[1:]),
                       "TMA cannot read q: its address is not 16-byte aligned")):
        assert why in hopper.unfit(call)
    if direction == "bwd":  # explain's backward call has no out or grad_out yet; a real one is checked too
        assert hopper.unfit(dataclasses.replace(fake_call("bwd"), out=None, grad_out=None)) is None
        skewed = dataclasses.replace(fake_call("bwd"), grad_out=FakeArray((2, 5, 3, 64), ptr=0x7F2A00000004))
        assert hopper.unfit(skewed) == "TMA cannot read grad_out: its address is not 16-byte aligned (4 bytes off)"


@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_a_block_mask_call_itself_goes_only_to_families_that_read_block_masks(direction, monkeypatch):
    """The call with its block mask: the families that do not read block masks refuse it, saying why, and
    sm90_fwd/sm90_bwd, which read them, refuse this one's bias; example 41 would take it as any call with a
    bias.  (The dense fallback, block_fallback.dense_call, leaves the mask out of the call it dispatches,
    so whichever family takes its bias serves it: test_block_mask_gpu.py.)"""
    monkeypatch.setattr(sm90_common, "device_info", lambda index: H100)
    padded_bias = FakeArray((2, 3, 5, 7), strides=(3 * 5 * 8, 5 * 8, 8, 1))
    mask = block_mask(lambda b, h, q, kv: q >= kv, 1, 3, 5, 7, device="cpu")
    call = dataclasses.replace(fake_call(direction, bias=padded_bias), block_mask=mask)
    *own, example41 = families.serving(direction)
    for family in own:
        expected = "a block mask with attn_bias" if family.reads_block_masks else "no block masks (until"
        assert family.unfit(call).startswith(expected), family
    assert [f.name for f in own if f.reads_block_masks] == [f"sm90_{direction}"]
    assert example41.refusal(call) is None


def test_the_dense_fallback_warns_once_per_process(monkeypatch):
    monkeypatch.setattr(block_fallback, "_warned", False)
    with pytest.warns(UserWarning, match=r"^flashgen: block_mask runs dense \(the mask becomes an additive .* slow"):
        block_fallback.warn_once()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        block_fallback.warn_once()  # no second warning


@pytest.mark.parametrize("which,shapes,match", [
    ("batch", ((2, 5, 3, 64), (3, 7, 3, 64), (2, 7, 3, 64)), r"batch sizes differ: q 2, k 3, v 2"),
    ("batch", ((2, 5, 3, 64), (2, 7, 3, 64), (1, 7, 3, 64)), r"batch sizes differ: q 2, k 2, v 1"),
    ("seq", ((2, 5, 3, 64), (2, 7, 3, 64), (2, 8, 3, 64)), r"k and v have different sequence lengths: 7 and 8"),
    ("heads", ((2, 5, 3, 64), (2, 7, 4, 64), (2, 7, 3, 64)), r"head counts differ: q 3, k 4, v 3"),
    ("heads", ((2, 5, 3, 64), (2, 7, 3, 64), (2, 7, 1, 64)), r"head counts differ: q 3, k 3, v 1"),
    ("head dim", ((2, 5, 3, 64), (2, 7, 3, 32), (2, 7, 3, 64)), r"q and k head dims differ: 64 and 32"),
])
def test_mismatched_shapes(which, shapes, match):
    with pytest.raises(ValueError, match=match):
        common(*(FakeArray(s) for s in shapes))


def test_dtype_mix_and_unsupported_dtypes():
    q, k, v = qkv()
    with pytest.raises(TypeError, match=r"^k has dtype float32, expected float16 like q$"):
        common(q, FakeArray(k.shape, np.float32), v)
    with pytest.raises(TypeError, match=r"^v has dtype float64, expected float16 like q$"):
        common(q, k, FakeArray(v.shape, np.float64))
    for bad in (np.float64, np.int8, np.complex64):
        with pytest.raises(TypeError) as e:
            common(FakeArray(q.shape, bad), FakeArray(k.shape, bad), FakeArray(v.shape, bad))
        msg = str(e.value)
        assert msg.startswith(f"q has dtype {np.dtype(bad)}")
        assert "float32" in msg and "float16" in msg and "bfloat16" in msg
    assert arrays.dtype_name(np.float16) == "f16" and arrays.dtype_name(np.float32) == "f32"
    assert arrays.dtype_name(np.float64) is None


def test_inputs_on_different_devices():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"^k is on GPU 1, q is on GPU 0$"):
        common(q, FakeArray(k.shape, device=1), v)
    with pytest.raises(ValueError, match=r"^v is on GPU 0, q is on GPU 2$"):
        common(FakeArray(q.shape, device=2), FakeArray(k.shape, device=2), v)


def test_last_dim_must_be_contiguous():
    q, k, v = qkv(B=1, M=4, N=4, H=2, K=8)
    strided = FakeArray(k.shape, strides=(128, 32, 16, 2))  # every other element
    with pytest.raises(ValueError, match=r"^k must have a contiguous last \(head_dim\) dimension; its stride is 2"):
        common(q, strided, v)
    with pytest.raises(ValueError, match=r"^q must have a contiguous"):
        common(FakeArray(q.shape, strides=(64, 16, 8, 2)), k, v)
    # permuted outer dims are fine, and a head dim of 1 has no stride to speak of
    common(FakeArray(q.shape, strides=(8, 16, 64, 1)), k, v)
    common(*qkv(K=1), scale=1.0)
    validate.check_bmhk("x", FakeArray((1, 4, 2, 1), strides=(8, 2, 1, 99)))


def test_check_bmhk_names_the_argument():
    x = FakeArray((2, 5, 3, 64))
    validate.check_bmhk("grad_out", x, np.dtype(np.float16), 0)
    with pytest.raises(ValueError, match=r"^grad_out must be 4-D \[batch, seq, heads, head_dim\]; "
                                         r"got shape \(5, 3, 64\)$"):
        validate.check_bmhk("grad_out", FakeArray((5, 3, 64)))
    with pytest.raises(TypeError, match=r"^out has dtype float16, expected float32"):
        validate.check_bmhk("out", x, np.dtype(np.float32), 0)
    with pytest.raises(ValueError, match=r"^out is on GPU 0, q is on GPU 1$"):
        validate.check_bmhk("out", x, np.dtype(np.float16), 1)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_inputs_must_be_4d(which):
    arrays = dict(zip("qkv", qkv()))
    arrays[which] = FakeArray(arrays[which].shape[1:])
    with pytest.raises(ValueError, match=rf"^{which} must be 4-D"):
        common(arrays["q"], arrays["k"], arrays["v"])


@pytest.mark.parametrize("B,H", [(0, 3), (2, 0), (0, 0)])
def test_empty_batch(B, H):
    with pytest.raises(ValueError, match=rf"^empty batch: batch={B}, heads={H}$"):
        common(*qkv(B=B, H=H))


@pytest.mark.parametrize("K,Kv", [(0, 64), (64, 0), (0, 0)])
def test_head_dim_zero(K, Kv):
    with pytest.raises(ValueError, match=rf"^head dims must be >= 1; got {K} and {Kv}$"):
        common(*qkv(K=K, Kv=Kv))


@pytest.mark.parametrize("causal", ["causal", "TOP_LEFT", "lower_right", True, False, 1])
def test_bad_causal(causal):
    with pytest.raises(ValueError, match=r"^causal must be None, 'top_left' or 'bottom_right'; got "):
        common(*qkv(), causal=causal)


@pytest.mark.parametrize("p", [1.0, 1, -0.1, "0.5", None, float("nan"), float("inf"), True])
def test_bad_dropout_p(p):
    with pytest.raises(ValueError, match=r"^dropout_p must be in \[0, 1\); got "):
        common(*qkv(), dropout_p=p, seed=1)


def test_dropout_needs_a_seed():
    with pytest.raises(ValueError, match=r"^dropout_p > 0 needs an explicit seed"):
        common(*qkv(), dropout_p=0.1)
    assert common(*qkv(), dropout_p=0.1, seed=0).dropout_p == pytest.approx(0.1)


@pytest.mark.parametrize("name,value", [("seed", -1), ("seed", 2**64), ("seed", 1.5), ("seed", "7"),
                                        ("offset", -1), ("offset", 2**64), ("offset", None), ("offset", 2.0)])
def test_bad_seed_or_offset(name, value):
    kwargs = dict(seed=1, offset=0, dropout_p=0.1)
    kwargs[name] = value
    with pytest.raises(ValueError, match=rf"^{name} must be an integer in \[0, 2\*\*64\); got "):
        common(*qkv(), **kwargs)


def test_cu_seqlens_must_come_in_pairs():
    q, k, v = qkv(B=1)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k"):
        validate.problem(q, k, v, None, None, 0.0, None, 0, [0, 5], None)
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k"):
        validate.problem(q, k, v, None, None, 0.0, None, 0, None, [0, 7])


F16 = np.float16
_P = 0x7F2A00000000  # 256-byte aligned, like every CuPy allocation


@pytest.mark.parametrize("ptr_bytes,expected", [(0, 8), (16, 8), (8, 4), (24, 4), (4, 2), (12, 2), (2, 1),
                                                (6, 1), (1, 1), (3, 1)])
def test_alignment_of_pointers(ptr_bytes, expected):
    x = FakeArray((2, 16, 4, 64), F16, ptr=_P + ptr_bytes)
    assert arrays.alignment([FakeArray((2, 16, 4, 64), F16, ptr=_P), x], (64, 64)) == expected


def test_alignment_of_f32_pointers_counts_elements():
    assert arrays.alignment([FakeArray((1, 8, 1, 8), np.float32, ptr=_P + 32)], (8,)) == 8
    assert arrays.alignment([FakeArray((1, 8, 1, 8), np.float32, ptr=_P + 16)], (8,)) == 4
    assert arrays.alignment([FakeArray((1, 8, 1, 8), np.float32, ptr=_P + 8)], (8,)) == 2
    assert arrays.alignment([FakeArray((1, 8, 1, 8), np.float32, ptr=_P + 4)], (8,)) == 1
    assert arrays.alignment([FakeArray((1, 8, 1, 8), np.float32, ptr=_P + 2)], (8,)) == 1


@pytest.mark.parametrize("strides,expected", [
    ((2048, 256, 64, 1), 8),   # contiguous [2, 8, 4, 64]
    ((4096, 260, 64, 1), 4),   # padded rows: 260 = 4 * 65
    ((4096, 256, 66, 1), 2),   # head stride 66
    ((4097, 256, 64, 1), 1),   # odd batch stride
])
def test_alignment_of_strides(strides, expected):
    x = FakeArray((2, 8, 4, 64), F16, strides=strides)
    assert arrays.alignment([x], (64, 64)) == expected


def test_alignment_ignores_strides_of_size_one_dims():
    # batch of 1 and 1 head: their strides are never multiplied by anything but 0
    x = FakeArray((1, 8, 1, 64), F16, strides=(12345, 64, 3, 1))
    assert arrays.alignment([x], (64, 64)) == 8
    y = FakeArray((2, 8, 1, 64), F16, strides=(12345, 64, 3, 1))
    assert arrays.alignment([y], (64, 64)) == 1
    z = FakeArray((1, 1, 2, 64), F16, strides=(7, 7, 64, 1))
    assert arrays.alignment([z], (64, 64)) == 8


@pytest.mark.parametrize("dims,expected", [((64, 64), 8), ((64, 36), 4), ((64, 6), 2), ((63, 64), 1)])
def test_alignment_of_head_dims(dims, expected):
    x = FakeArray((1, 8, 1, 64), F16, strides=(512, 64, 64, 1))
    assert arrays.alignment([x], dims) == expected


def test_check_int32():
    limits.check_int32(q_strideM=2**31 - 1, num_keys=0, k_strideH=-(2**31 - 1))
    with pytest.raises(ValueError, match=r"^num_keys = 2147483648 does not fit the kernel's 32-bit field"):
        limits.check_int32(q_strideM=64, num_keys=2**31)
    with pytest.raises(ValueError, match=r"^v_strideM = "):
        limits.check_int32(v_strideM=2**40)


# === no CuPy anywhere ========================================================================

def test_importing_the_runtime_loads_no_cupy():
    code = ("import sys, flashgen, flashgen.runtime, flashgen.runtime.api, flashgen.runtime.select; "
            "flashgen.UnsupportedError; assert 'cupy' not in sys.modules, 'cupy imported'")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root, env=env)


def test_runtime_needs_cupy_only_at_call_time():
    # with `import cupy` blocked, the public entry points say what to install
    with pytest.raises(UnsupportedError, match="needs CuPy"):
        api.attention_forward(*qkv())
    with pytest.raises(UnsupportedError, match="needs CuPy"):
        api.explain(*qkv())
    assert sys.modules.get("cupy") is None  # still the block, never a module
