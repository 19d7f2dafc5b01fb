"""float64 attention reference and test inputs, shared by the GPU suite and the fuzzer.

Imported only where CuPy exists (a GPU module imports it after
``pytest.importorskip("cupy")`` and takes its marks from ``gpu_marks``).
Conventions: [B, M, H, K] inputs; a row that sees no key has output 0, lse
-inf and no gradient.
"""
from __future__ import annotations

import contextlib
import math

import cupy
import numpy as np

import flashgen



def gpu_marks():
    """(whether a GPU is there, the marks of a GPU test module): marked `gpu`, skipped cleanly
    where CuPy finds no device or no driver."""
    import pytest

    try:
        have = cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no driver at all
        have = False
    return have, [pytest.mark.gpu, pytest.mark.skipif(not have, reason="needs a CUDA GPU")]


def gpu0_kernels(family: str, fits) -> list:
    """The built kernels of ``family`` for GPU 0, or [] where there is no GPU, GPU 0's compute
    capability fails ``fits``, or nothing of the family was built for it."""
    from flashgen.runtime.device import device_info
    from flashgen.runtime.registry import default_registry

    if not gpu_marks()[0] or not fits(device_info(0).cc):
        return []
    try:
        return default_registry().for_device(family, device_info(0))
    except flashgen.UnsupportedError:
        return []


def hopper_kernels(family: str) -> list:
    """One of flashgen's sm90 families for GPU 0: a 9.0 part (`flashgen build --arch sm90a`)."""
    return gpu0_kernels(family, lambda cc: cc == 90)


def ampere_kernels(family: str) -> list:
    """A family built for plain targets, for GPU 0 of compute capability 8.0 or newer
    (`flashgen build --arch sm80`, or `--arch sm90` on Hopper)."""
    return gpu0_kernels(family, lambda cc: cc >= 80)


DTYPES = {"f32": np.float32, "f16": np.float16}
try:
    import ml_dtypes

    DTYPES["bf16"] = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    pass
# ||out - ref|| / ||ref|| bounds.  Measured on an H200: the GPU suite's max is f32 ~1e-6 (3xTF32
# tensor cores), f16 ~5e-4, bf16 ~4e-3.  The fuzzer (larger scales, head dims up to 512) reaches
# f32 6e-5, bf16 1.3e-2 and, for f16, 5.7e-3 in one regime: a single query row (M = 1) with
# K >= 256 and a peaky softmax, where dQ/dK come from the cancellation dP - rowsum(dO * O).
# The bounds leave ~2x over those; an indexing or masking bug errs by O(1).
FWD_TOL = {"f32": 1e-5, "f16": 1e-3, "bf16": 8e-3}
BWD_TOL = {"f32": 1e-4, "f16": 1e-2, "bf16": 3e-2}


@contextlib.contextmanager
def poisoned_allocations():
    """Every CuPy allocation inside starts as 0xFF bytes (NaN for f16/bf16/f32)."""
    pool = cupy.get_default_memory_pool()

    def alloc(size):
        mem = pool.malloc(size)
        cupy.cuda.runtime.memsetAsync(mem.ptr, 0xFF, size, cupy.cuda.get_current_stream().ptr)
        return mem

    with cupy.cuda.using_allocator(alloc):
        yield


def randn(rng, shape, dtype, scale=1.0):
    return cupy.asarray((rng.standard_normal(shape) * scale).astype(np.float32)).astype(DTYPES[dtype])


def f64(x):
    return x.astype(cupy.float32).astype(cupy.float64)


def mask_matrix(M, N, causal, window=None):
    """Which keys each query sees: below the causal diagonal, within window = (left, right) of it
    (None: no limit on that side); the diagonal is top-left unless causal='bottom_right'."""
    if causal is None and window is None:
        return None
    i = cupy.arange(M)[:, None]
    j = cupy.arange(N)[None, :]
    diagonal = i + (N - M if causal == "bottom_right" else 0)
    visible = cupy.ones((M, N), dtype=bool)
    if causal is not None:
        visible &= j <= diagonal
    left, right = window or (None, None)
    if left is not None:
        visible &= j >= diagonal - left
    if right is not None:
        visible &= j <= diagonal + right
    return visible


def reference(q, k, v, *, bias=None, causal=None, scale=None, keep=None, p=0.0, grad_out=None, window=None,
              softcap=0.0, out_for_delta=None, summand_sizes=False):
    """float64 attention and, with grad_out, its gradients.  keep: dropout mask [B, H, M, N];
    softcap: scores become softcap * tanh(scores / softcap); out_for_delta: the gradients a
    flash-style backward computes from this (rounded) output, delta = rowsum(grad_out * out).
    summand_sizes: dq and dk (and ds) hold the sizes of their sums' terms instead,
    scale * P (|dP| + |delta|) |K| and likewise, what their rounding error is proportional to
    where dP - delta cancels (``rel_err_to_summands``).  Grouped-query k/v (H / group heads): repeated
    per query head, their gradients summed back over each group.  Returns (out, lse), and with grad_out
    (out, lse, (dq, dk, dv, dS)): dS the gradient of the biased scores, [B, H, M, N], folded like the
    bias where one is given (fold_like_bias), as attention_backward returns dbias."""
    group = q.shape[2] // k.shape[2]
    q, k, v = f64(q), f64(k), f64(v)
    if group > 1:
        k, v = (cupy.repeat(x, group, axis=2) for x in (k, v))
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = cupy.einsum("bmhk,bnhk->bhmn", q, k) * scale
    slope = 1.0
    if softcap:
        t = cupy.tanh(s / softcap)
        s, slope = softcap * t, 1 - t * t
    if bias is not None:
        s = s + f64(bias)
    m = mask_matrix(q.shape[1], k.shape[1], causal, window)
    if m is not None:
        s = cupy.where(m, s, -cupy.inf)
    lse = logsumexp(s)
    prob = cupy.where(cupy.isfinite(lse)[..., None], cupy.exp(s - lse[..., None]), 0.0)  # no key: P = 0
    drop = keep / (1 - p) if keep is not None else 1.0
    out = cupy.einsum("bhmn,bnhk->bmhk", prob * drop, v)
    if grad_out is None:
        return out, lse
    do = f64(grad_out)
    dv = cupy.einsum("bhmn,bmhk->bnhk", prob * drop, do)
    dp = cupy.einsum("bmhk,bnhk->bhmn", do, v) * drop
    if out_for_delta is None:
        delta = (dp * prob).sum(-1, keepdims=True)  # = rowsum(grad_out * out) in exact arithmetic
    else:
        delta = cupy.einsum("bmhk,bmhk->bhm", do, f64(out_for_delta))[..., None]
    ds = prob * (dp - delta)
    if summand_sizes:
        ds, slope, scale, q, k = prob * (abs(dp) + abs(delta)), abs(slope), abs(scale), abs(q), abs(k)
    dq = cupy.einsum("bhmn,bnhk->bmhk", ds * slope, k) * scale
    dk = cupy.einsum("bhmn,bmhk->bnhk", ds * slope, q) * scale
    fold = lambda g: g.reshape(*g.shape[:2], g.shape[2] // group, group, g.shape[3]).sum(axis=3)  # noqa: E731
    return out, lse, (dq, fold(dk), fold(dv), ds if bias is None else fold_like_bias(ds, bias))


def fold_like_bias(dbias, bias, rows=False):
    """dbias [B, H, M, N] summed over the batch and the heads where ``bias`` has extent 1 there (or no
    such dim), as attention_backward returns it; a broadcast query dim stays whole unless ``rows``
    (autograd's gradient of the bias itself, as flashgen.torch returns it, sums it too)."""
    shape = (1,) * (4 - bias.ndim) + tuple(bias.shape)
    folded = (0, 1, 2) if rows else (0, 1)
    axes = tuple(axis for axis in folded if shape[axis] == 1 and dbias.shape[axis] > 1)
    return dbias.sum(axis=axes, keepdims=True) if axes else dbias


# Which dims of a [B, H, M, N] attention bias are broadcast (extent 1, stride 0 once validated):
# every combination of batch, heads and query rows ("": a full bias; "M": one row per head, a
# key-padding mask)
BIAS_BROADCASTS = ("", "B", "H", "M", "BH", "BM", "HM", "BHM")


def make_bias(rng, dtype, B, H, M, N, broadcast="", scale=2.0):
    """A random bias of [B, H, M, N] with extent 1 in the dims named in ``broadcast``."""
    shape = tuple(1 if dim in broadcast else n for dim, n in zip("BHMN", (B, H, M, N)))
    return randn(rng, shape, dtype, scale)


def assert_same_bits(grads, again):
    """Two calls' gradients agree in every bit (deterministic mode)."""
    for a, b in zip(grads, again):
        assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all()), "deterministic backward changed bits"


def logsumexp(s):
    """log(sum(exp(s), -1)), -inf for a row that sees no key."""
    top = s.max(-1)
    safe = cupy.where(cupy.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return cupy.log(cupy.exp(s - safe[..., None]).sum(-1)) + safe


def lse_err(x, ref):
    """||x - ref|| / max(||ref||, sqrt(size)) over the rows that see keys; rows that see none must be
    -inf exactly.  An lse off by d scales its row's probabilities by e^d, about 1 + d, so below |lse|
    ~ 1 the absolute error is the one that matters: a relative one grows without bound as the lse
    nears 0 (a row seeing one key whose score is near 0; fuzzer seed 39, case 334: 2.9e-4 in f32)."""
    x = f64(x)
    assert not bool(cupy.isnan(x).any()), "NaN in lse: a row was not written"
    empty = cupy.isneginf(ref)
    assert bool((cupy.isneginf(x) == empty).all()), "lse is not -inf exactly where a row sees no key"
    x, ref = cupy.where(empty, 0.0, x), cupy.where(empty, 0.0, ref)
    denom = max(float(cupy.linalg.norm(ref.ravel())), math.sqrt(max(ref.size, 1)))
    return float(cupy.linalg.norm((x - ref).ravel())) / denom


def rel_err(x, ref, zero_scale=1.0):
    """||x - ref|| / ||ref||.  A reference that is exactly zero (one visible key: the softmax is
    constant, so dq and dk vanish) leaves only the rounding residue of the cancellation
    dP - rowsum(dO * O), whose terms are of size |dO| |V| ~ sqrt(Kv) for unit inputs: pass that
    as ``zero_scale``; the residue is then compared by RMS against it."""
    x = f64(x)
    assert x.shape == ref.shape, f"compared {x.shape} with a reference of {ref.shape}: broadcasting would hide it"
    assert not bool(cupy.isnan(x).any()), "NaN in output: an element was not written"
    denom = float(cupy.linalg.norm(ref.ravel())) or math.sqrt(max(ref.size, 1)) * zero_scale
    return float(cupy.linalg.norm((x - ref).ravel())) / denom


def rel_err_to_summands(x, ref, sizes):
    """||x - ref|| / ||sizes||: the error of a sum against the size of its terms.  dq and dk are
    sums of scale * P (dP - delta) K; where dP and delta nearly cancel (two keys and one query,
    say), their rounding in f16/bf16 inputs leaves an error that is small next to the terms but
    not next to the sum.  ``sizes`` from ``reference(..., summand_sizes=True)``."""
    x = f64(x)
    assert x.shape == ref.shape == sizes.shape, f"compared {x.shape} with {ref.shape} (sizes {sizes.shape})"
    assert not bool(cupy.isnan(x).any()), "NaN in output: an element was not written"
    return float(cupy.linalg.norm((x - ref).ravel())) / (float(cupy.linalg.norm(sizes.ravel())) or 1.0)


def offsets(lengths):
    """cu_seqlens of sequences of these lengths."""
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


# The Ampere families' reference grid (sm80_fwd's tests and sm80_bwd's): each dtype, head dims
# below, between and at the 64, 128, 192 and 256 tiers, each mask kind, the sizes taken in turn
# (one and many blocks, partial ones, M != N).
AMPERE_SIZES = ((1, 1), (7, 129), (129, 7), (1000, 129), (129, 1000), (1000, 1000), (1, 1000), (2048, 2048))
AMPERE_GRID = [(dtype, K, *AMPERE_SIZES[(i + j + c) % len(AMPERE_SIZES)], causal)
               for i, dtype in enumerate(("f16", "bf16")) for j, K in enumerate((8, 40, 64, 96, 128, 160, 192, 200, 256))
               for c, causal in enumerate((None, "top_left", "bottom_right"))]

# Their sliding windows ((left, right) of the diagonal, None unbounded), each run on these
# (dtype, head dim, M, N) shapes.
AMPERE_WINDOWS = ((0, 0), (3, None), (None, 5), (100, 50), (1, 1000), (127, 0))
AMPERE_WINDOW_SHAPES = [("f16", 64, 1000, 700), ("bf16", 128, 129, 1000), ("f16", 96, 700, 700),
                        ("bf16", 192, 300, 700), ("f16", 256, 700, 129)]

# The Ampere families' packed batches (sm80_fwd's tests and sm80_bwd's): (query lengths, key
# lengths) per packing, with sequences of no queries or no keys; the masks each packing runs
# under (bottom-right only where every sequence has at least as many keys as queries).
PACKINGS = {
    "square": ((1, 7, 129, 1000), (1, 7, 129, 1000)),
    "ragged": ((129, 0, 7, 300, 1), (1000, 5, 7, 128, 2000)),
    "keyless": ((300, 64, 1), (0, 1000, 3)),
}
PACKED_MASKS = [dict(), dict(causal="top_left"), dict(causal="bottom_right"), dict(window=(50, 10)),
                dict(softcap=20.0, causal="top_left")]
PACKED = [(dtype, K, name, i) for dtype, K in (("f16", 64), ("bf16", 128)) for name in PACKINGS
          for i, options in enumerate(PACKED_MASKS)
          if options.get("causal") != "bottom_right" or all(m <= n for m, n in zip(*PACKINGS[name]))]


def make_input(rng, shape, dtype, layout):
    B, S, H, K = shape
    if layout == "contiguous":
        return randn(rng, shape, dtype)
    if layout == "bhsk":  # heads-major storage, viewed as BMHK
        return randn(rng, (B, H, S, K), dtype).transpose(0, 2, 1, 3)
    if layout == "padded":  # a slice of a wider buffer: every stride differs from the packed one
        return randn(rng, (B, S + 3, H + 1, K + 8), dtype)[:, 2:S + 2, 1:, :K]
    raise AssertionError(layout)


def recover_keep_mask(q, k, p, seed, offset=0, v=None, causal=None):
    """Run the forward with V = identity: out[b, i, h, j] = P_ij * keep_ij / (1 - p).

    V gets N columns padded to a multiple of 8 (zeros), so any N has a kernel: example 41's
    (head dims differ).  Where the call with the values ``v`` runs on one of flashgen's pairs (sm90 or
    sm80), which draw another mask, it is their rule instead (tests/philox_reference.py), whose rows
    start after those a bottom-right ``causal`` mask leaves without keys."""
    B, M, H, _ = q.shape
    N = k.shape[1]
    if v is not None:
        rows = flashgen.explain(q, k, v, dropout_p=p, seed=seed, offset=offset)
        if any(name.startswith(("sm90_fwd", "sm80_fwd")) and verdict == "selected" for name, _, verdict in rows):
            from philox_reference import keep_mask
            skipped = M - N if causal == "bottom_right" and M > N else 0
            return cupy.asarray(keep_mask(seed, offset, p, B, H, M, N, skipped))
    eye = cupy.eye(N, -(-N // 8) * 8, dtype=q.dtype)
    eye = cupy.broadcast_to(eye[None, :, None, :], (B, N, H, eye.shape[1])).copy()
    out, _ = flashgen.attention_forward(q, k, eye, dropout_p=p, seed=seed, offset=offset)
    out = out[..., :N]
    prob = cupy.exp(reference_scores(q, k))
    ratio = f64(out).transpose(0, 2, 1, 3) * (1 - p) / prob
    keep = ratio > 0.5
    assert bool((cupy.abs(ratio - keep) < 0.05).all()), "dropout output is not P * {0, 1/(1-p)}"
    return keep


def reference_scores(q, k):
    s = cupy.einsum("bmhk,bnhk->bhmn", f64(q), f64(k)) / math.sqrt(q.shape[-1])
    return s - logsumexp(s)[..., None]
