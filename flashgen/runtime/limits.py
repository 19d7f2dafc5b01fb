"""The kernels' 32-bit arithmetic: sizes, strides and offsets a call may not exceed.

The example-41 kernels form row, head and batch offsets, lse offsets and dropout
stream offsets as 32-bit products of ``Params`` fields (each check cites the line of
``kernel_forward.h`` / ``kernel_backward.h`` that does it), and CUDA grids allow at most
65535 blocks in y and z.  Every call is checked against these bounds before any launch,
whichever family serves it, so an input that would wrap an offset gets a ValueError that
says how to split the call instead of a fault or a silently wrong answer.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from flashgen.runtime.arrays import elem_strides

if TYPE_CHECKING:
    from flashgen.runtime.validate import Problem

INT32_MAX = 2**31 - 1

# The Params fields an input's own strides go into, and the 32-bit products the kernels form
# with them: row offsets `row * strideM` in int32 (backward: kernel_backward.h:1489, 1502, 1512,
# 1531, 1566, 2463, and 803-809 for varlen starts; forward key loop: kernel_forward.h:735, 779,
# 999) and head offsets `head_id * strideH` (uint32 in the forward, kernel_forward.h:293-296;
# int32 in the backward, kernel_backward.h:817-819).  Both kernels must accept an input, so
# the bound is the stricter int32 one.
_OFFSET_FIELDS = {"q": ("q_strideM", "q_strideH"), "k": ("k_strideM", "k_strideH"),
                  "v": ("v_strideM", "v_strideH"), "grad_out": ("gO_strideM", None)}
SPLIT_ROWS = ("split the call: fewer heads per call (each group copied into its own contiguous array: a row "
              "is heads x head_dim elements) or fewer rows per call (fewer packed sequences, or fewer queries)")
SPLIT_HEADS = "use a BMHK-contiguous layout (cupy.ascontiguousarray) or split the heads over several calls"


def lse_rows(rows: int) -> int:
    """Rows of each (batch, head) in the forward's lse buffer: both forward families write lse
    padded to a multiple of 32 rows (+inf past the last query), as example 41 does."""
    return -(-rows // 32) * 32


def check_offset(field: str, what: str, count: int, stride: int, advice: str, limit: int = INT32_MAX):
    """``count * stride`` is an offset a kernel computes in 32-bit arithmetic; refuse it if it overflows."""
    if count > 0 and count * stride > limit:
        raise ValueError(f"{field}: {what} = {count} * {stride} = {count * stride} overflows the kernels' "
                         f"32-bit offset arithmetic (at most {limit}); {advice}")


def check_input_offsets(name: str, x):
    fields = _OFFSET_FIELDS.get(name)
    if fields is None or not x.size:
        return
    rows, heads = x.shape[1], x.shape[2]
    stride_m, stride_h = elem_strides(x)[1:3]
    check_offset(fields[0], f"{name}'s last row offset (seq - 1) * row stride", rows - 1, stride_m, SPLIT_ROWS)
    if fields[1] is not None:
        check_offset(fields[1], f"{name}'s last head offset (heads - 1) * head stride", heads - 1, stride_h,
                     SPLIT_HEADS)


_ROWS_OF = {"q": "num_queries", "o": "num_queries", "gO": "num_queries", "gQ": "num_queries",
            "bias": "num_queries", "gB": "num_queries", "k": "num_keys", "v": "num_keys", "gK": "num_keys",
            "gV": "num_keys"}


def check_int32(**values):
    """Every value fits its int32 Params field, and every ``X_strideM`` times the last row index
    (``num_queries`` or ``num_keys``, when given) fits the kernels' 32-bit row offsets."""
    for name, v in values.items():
        if not -INT32_MAX - 1 <= v <= INT32_MAX:
            raise ValueError(f"{name} = {v} does not fit the kernel's 32-bit field; split the batch")
    for name, stride in values.items():
        rows_name = _ROWS_OF.get(name[:-len("_strideM")]) if name.endswith("_strideM") else None
        if rows_name in values:
            check_offset(name, f"the last row offset ({rows_name} - 1) * {name}", values[rows_name] - 1,
                          abs(stride), SPLIT_ROWS)



_UINT32_MAX = 2**32 - 1
_GRID_YZ_MAX = 65535  # CUDA's limit on gridDim.y (heads) and gridDim.z (batch) of both kernels
# Row loops run on int32 counters that step past the last row before the test ends: by a block
# in the forward (kernel_forward.h:722), by num_splits_key * block_j in the backward
# (kernel_backward.h:1359; num_splits_key <= 32767 but in practice < 2**22 / 128).
MAX_ROWS = 2**31 - 2**22
_SPLIT_BATCH = "split the batch over several calls"


def check_kernel_limits(c: Problem, q, k, v):
    """Sizes the kernels cannot address: 32-bit products of shapes (and of the contiguous
    outputs' strides) the runtime would put in ``Params``, CUDA's grid limits, and the
    forward's single-query fast path.  Arithmetic on shapes and strides only."""
    if c.M == 0 or c.N == 0:
        return  # nothing is launched
    rows_q, rows_k = q.shape[1], k.shape[1]  # packed rows (>= the longest sequence with cu_seqlens)
    for field, rows in (("num_queries", rows_q), ("num_keys", rows_k)):
        if rows > MAX_ROWS:
            raise ValueError(f"{field} = {rows} is too large: the kernels count rows in int32 and step up to "
                             f"2**22 rows past the last one; at most {MAX_ROWS} rows per call")
    for field, n, what in (("num_heads", c.H, "heads"), ("num_batches", c.batches, "batch")):
        if n > _GRID_YZ_MAX:
            raise ValueError(f"{field} = {n}: the kernels launch one block row per head and per batch element, "
                             f"and CUDA grids allow at most {_GRID_YZ_MAX} in y and z; split the {what}")
    # out, dq, dk, dv are contiguous [rows, H, K or Kv]: their row strides are int32 fields
    # (o_strideM; the backward's gQ/gK/gV_strideM() and o_strideM()) and the backward forms
    # row * stride in int32 (kernel_backward.h:808-814, 1424-1425, 1772, 2111, 2147, 2467).
    for field, rows, stride, name in (("o_strideM", rows_q, c.H * c.Kv, "out"),
                                      ("gQ_strideM", rows_q, c.H * c.K, "dq"),
                                      ("gK_strideM", rows_k, c.H * c.K, "dk"),
                                      ("gV_strideM", rows_k, c.H * c.Kv, "dv")):
        check_offset(field, f"{name}'s row stride heads * head_dim", 1, stride, SPLIT_HEADS)
        check_offset(field, f"{name}'s last row offset (seq - 1) * heads * head_dim", rows - 1, stride,
                      SPLIT_ROWS)
    if c.seqstart_q is None:  # int64_t(batch_id * num_queries): a uint32 product (kernel_forward.h:283, 286)
        check_offset("num_batches * num_queries", "the output's last batch offset (batch - 1) * num_queries",
                      c.B - 1, rows_q, _SPLIT_BATCH, _UINT32_MAX)
    # lse: batch_id * lse_dim * num_heads + head_id * lse_dim + query_start, uint32 (kernel_forward.h:315)
    lse_dim = lse_rows(c.M)
    check_offset("logsumexp_ptr", "the lse offsets batch * heads * lse_dim (largest + 1)", c.batches * c.H,
                  lse_dim, _SPLIT_BATCH, _UINT32_MAX + 1)
    if c.dropout_p > 0 and not _flashgen_may_draw(c):
        why = dropout_offsets_refusal(c)
        if why:
            raise ValueError(why)


def _flashgen_may_draw(c: Problem) -> bool:
    """Whether one of flashgen's pairs may draw this call's dropout mask (its offsets have no such
    limits); the example-41 families then refuse the calls past theirs (``unfit_example41``)."""
    from flashgen.errors import FlashgenError
    from flashgen.runtime import dropout  # runtime/families, which it imports, imports this module
    try:
        return dropout.may_draw(c)
    # no CuPy, no CUDA driver or device (CuPy's errors are RuntimeErrors), no kernels for the GPU:
    # judge by example 41's limits; anything else is a bug and propagates
    except (ImportError, RuntimeError, FlashgenError):
        return False


def dropout_offsets_refusal(c: Problem) -> Optional[str]:
    """Why example 41 cannot draw this call's dropout mask alike in both directions (None: it can).

    The forward and the backward must draw the same Philox number for every element of P.

    The forward offsets each (batch, head) by batch*H*M*N + head*M*N and each element by
    row*N + col in uint32 (kernel_forward.h:241-243, 948-951); the backward computes H*M*N and
    head*(M*N) in int32 (kernel_backward.h:783-784) and row*N + col in int32 (1702-1704).  Where
    these wrap differently the backward redraws another mask and its gradients are silently wrong;
    refuse such calls unless both are exact."""
    mn, heads, batches = c.M * c.N, c.H, c.batches
    fields = [("head * num_queries * num_keys", (heads - 1) * mn, INT32_MAX),
              ("row * num_keys + col", mn - 1, INT32_MAX),
              ("batch * heads * num_queries * num_keys + head * num_queries * num_keys", (batches * heads - 1) * mn,
               _UINT32_MAX)]
    if batches > 1:
        fields.append(("num_heads * num_queries * num_keys", heads * mn, INT32_MAX))
    for what, value, limit in fields:
        if value > limit:
            return (f"dropout_batch_head_rng_offset: with dropout the kernels offset the random stream "
                    f"by {what} = {value}, past {limit}; the forward (uint32) and the backward (int32) "
                    f"would then draw different masks.  Split the batch (one call per batch element, "
                    f"with offset=b * heads * M * N so the masks stay independent), or the heads")
    return None
