"""``attention_forward`` / ``attention_backward``: validate, select, pack ``Params``, launch.

Layout is BMHK: q [B, M, H, K], k [B, N, H, K], v [B, N, H, Kv], any strides
with a contiguous last dim.  Inputs are CuPy arrays or anything that speaks
DLPack or ``__cuda_array_interface__`` (torch tensors, zero-copy); outputs
are CuPy arrays.  Every check happens before the launch; a launch goes to the
given or current CuPy stream with no host synchronisation.
"""
from __future__ import annotations

import math
import numbers
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np

from flashgen.errors import UnsupportedError
from flashgen.runtime.device import device_info
from flashgen.runtime.registry import KernelBinary, Registry, default_registry
from flashgen.runtime.select import Request, Selector, num_splits_key, workspace_bytes
from flashgen.spec.mem_eff_bwd import MemEffBwd
from flashgen.spec.mem_eff_fwd import MemEffFwd

_MASKS = {None: 0, "top_left": 1, "bottom_right": 2}
_INT32_MAX = 2**31 - 1
_selectors = {}
_params = threading.local()


def _selector(registry: Registry) -> Selector:
    sel = _selectors.get(id(registry))
    if sel is None or sel.registry is not registry:
        sel = _selectors[id(registry)] = Selector(registry)
    return sel


def _cupy():
    try:
        import cupy
    except ImportError:
        raise UnsupportedError("flashgen's runtime needs CuPy: pip install 'flashgen[cu13]' "
                               "(or cupy-cuda12x / cupy-cuda13x matching your driver)") from None
    return cupy


def _dtype_name(dtype) -> Optional[str]:
    return {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}.get(np.dtype(dtype).name)


def as_array(x, name: str):
    """A CuPy view of ``x`` (no copy), or a TypeError that says what to pass."""
    cupy = _cupy()
    if isinstance(x, cupy.ndarray):
        return x
    if isinstance(x, np.ndarray):
        raise TypeError(f"{name} is a host (NumPy) array; move it to the GPU first (cupy.asarray)")
    if hasattr(x, "__dlpack__"):  # keeps bfloat16 (CUDA array interface has no code for it)
        try:
            return cupy.from_dlpack(x)
        except Exception as e:  # e.g. a CPU torch tensor
            raise TypeError(f"{name}: cannot view it on the GPU through DLPack ({e})") from None
    if hasattr(x, "__cuda_array_interface__"):
        return cupy.asarray(x)
    raise TypeError(f"{name} must be a CuPy array or a GPU array with DLPack or __cuda_array_interface__, "
                    f"not {type(x).__name__}")


def _check_bmhk(name: str, x, dtype=None, device=None):
    if x.ndim != 4:
        raise ValueError(f"{name} must be 4-D [batch, seq, heads, head_dim]; got shape {tuple(x.shape)}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name} has dtype {x.dtype}, expected {dtype} like q")
    if device is not None and x.device.id != device:
        raise ValueError(f"{name} is on GPU {x.device.id}, q is on GPU {device}")
    if x.size and x.shape[3] > 1 and x.strides[3] != x.itemsize:
        raise ValueError(f"{name} must have a contiguous last (head_dim) dimension; its stride is "
                         f"{x.strides[3] // x.itemsize} elements (use cupy.ascontiguousarray)")


def _elem_strides(x):
    return tuple(s // x.itemsize for s in x.strides)


def _alignment(arrays, dims) -> int:
    """Largest of 8/4/2/1 dividing every pointer (in elements), stride and dim that matters."""
    values = list(dims)
    for x in arrays:
        values.append(x.data.ptr // x.itemsize if x.data.ptr % x.itemsize == 0 else 1)
        values += [s for s, n in zip(_elem_strides(x)[:3], x.shape[:3]) if n > 1]
    for a in (8, 4, 2):
        if all(v % a == 0 for v in values):
            return a
    return 1


def _check_int32(**values):
    for name, v in values.items():
        if not -_INT32_MAX - 1 <= v <= _INT32_MAX:
            raise ValueError(f"{name} = {v} does not fit the kernel's 32-bit field; split the batch")


@dataclass
class _Common:
    """What forward and backward validate the same way."""

    B: int
    M: int
    N: int
    H: int
    K: int
    Kv: int
    dtype: str
    device: int
    mask: int
    scale: float
    dropout_p: float
    seed: int
    offset: int
    seqstart_q: object  # device int32 [S+1] or None
    seqstart_k: object
    batches: int  # B, or the number of sequences when varlen


def _varlen(cu, name, total, device):
    cupy = _cupy()
    host = cupy.asnumpy(cu) if isinstance(cu, cupy.ndarray) else np.asarray(cu)
    if host.dtype != np.int32:
        raise TypeError(f"{name} must be int32; got {host.dtype}")
    if host.ndim != 1 or host.size < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries (start offsets + end)")
    if host[0] != 0 or np.any(np.diff(host) < 0):
        raise ValueError(f"{name} must start at 0 and never decrease; got {host.tolist()[:8]}")
    if host[-1] > total:
        raise ValueError(f"{name} ends at {host[-1]} but the packed sequence has {total} rows")
    dev = cu if isinstance(cu, cupy.ndarray) and cu.device.id == device else None
    if dev is None:
        with cupy.cuda.Device(device):
            dev = cupy.asarray(host)
    return dev, int(np.diff(host).max())


def _common(q, k, v, causal, scale, dropout_p, seed, offset, cu_seqlens_q, cu_seqlens_k) -> _Common:
    """Shape, dtype, device and option checks shared by forward and backward (no GPU work
    unless cu_seqlens must be validated)."""
    _check_bmhk("q", q)
    dtype = _dtype_name(q.dtype)
    if dtype is None:
        raise TypeError(f"q has dtype {q.dtype}; flashgen supports float32, float16 and bfloat16")
    _check_bmhk("k", k, q.dtype, q.device.id)
    _check_bmhk("v", v, q.dtype, q.device.id)
    B, M, H, K = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: q {B}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[1] != v.shape[1]:
        raise ValueError(f"k and v have different sequence lengths: {k.shape[1]} and {v.shape[1]}")
    if k.shape[2] != H or v.shape[2] != H:
        raise ValueError(f"head counts differ: q {H}, k {k.shape[2]}, v {v.shape[2]}")
    if k.shape[3] != K:
        raise ValueError(f"q and k head dims differ: {K} and {k.shape[3]}")
    N, Kv = k.shape[1], v.shape[3]
    if B == 0 or H == 0:
        raise ValueError(f"empty batch: batch={B}, heads={H}")
    if K == 0 or Kv == 0:
        raise ValueError(f"head dims must be >= 1; got {K} and {Kv}")
    if causal not in _MASKS:
        raise ValueError(f"causal must be None, 'top_left' or 'bottom_right'; got {causal!r}")
    if not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1); got {dropout_p!r}")
    if dropout_p > 0 and seed is None:
        raise ValueError("dropout_p > 0 needs an explicit seed (and offset): attention_backward must "
                         "redraw the same mask from them")
    for name, value in (("seed", seed or 0), ("offset", offset)):
        if not isinstance(value, (int, np.integer)) or not 0 <= value < 2**64:
            raise ValueError(f"{name} must be an integer in [0, 2**64); got {value!r}")
    scale = 1.0 / math.sqrt(K) if scale is None else float(scale)
    seqstart_q = seqstart_k = None
    batches = B
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("pass both cu_seqlens_q and cu_seqlens_k, or neither")
    if cu_seqlens_q is not None:
        if B != 1:
            raise ValueError(f"with cu_seqlens the sequences are packed along dim 1 of a batch of 1; got batch {B}")
        seqstart_q, M_max = _varlen(cu_seqlens_q, "cu_seqlens_q", M, q.device.id)
        seqstart_k, N_max = _varlen(cu_seqlens_k, "cu_seqlens_k", N, q.device.id)
        if seqstart_q.size != seqstart_k.size:
            raise ValueError(f"cu_seqlens_q has {seqstart_q.size} entries, cu_seqlens_k {seqstart_k.size}")
        batches = seqstart_q.size - 1
        M, N = M_max, N_max
    return _Common(B, M, H=H, N=N, K=K, Kv=Kv, dtype=dtype, device=q.device.id, mask=_MASKS[causal],
                   scale=scale, dropout_p=float(dropout_p), seed=int(seed or 0), offset=int(offset),
                   seqstart_q=seqstart_q, seqstart_k=seqstart_k, batches=batches)


def _bias(cupy, attn_bias, c: _Common, q, rows: int, cols: int):
    """The bias as [B, H, M, N] (broadcast dims get stride 0), with an aligned row stride."""
    if attn_bias is None:
        return None
    if c.seqstart_q is not None:
        raise UnsupportedError("attn_bias with cu_seqlens is not supported by the example-41 kernels")
    b = as_array(attn_bias, "attn_bias")
    if b.dtype != q.dtype:
        raise TypeError(f"attn_bias has dtype {b.dtype}, expected {q.dtype} like q")
    if b.device.id != c.device:
        raise ValueError(f"attn_bias is on GPU {b.device.id}, q is on GPU {c.device}")
    try:
        b = cupy.broadcast_to(b, (c.B, c.H, rows, cols))
    except ValueError:
        raise ValueError(f"attn_bias of shape {tuple(attn_bias.shape)} does not broadcast to "
                         f"[batch, heads, M, N] = {(c.B, c.H, rows, cols)}") from None
    if cols > 1 and b.strides[3] != b.itemsize or _elem_strides(b)[2] % 8 or b.data.ptr % 16:
        # the kernels read bias rows with vector loads: copy into rows padded to 8 elements
        padded = cupy.zeros((c.B, c.H, rows, -(-cols // 8) * 8), dtype=b.dtype)
        padded[..., :cols] = b
        b = padded[..., :cols]
    return b


def _launch(registry, binary: KernelBinary, device: int, grid, block, params, stream):
    fn = registry.function(binary, device)
    fn(grid, block, (params,), shared_mem=binary.constants["shared_memory_bytes"], stream=stream)


def _params_buffer(cls):
    """A per-thread Params buffer, so a call allocates nothing on the host after warm-up."""
    buf = getattr(_params, cls.FAMILY, None)
    if buf is None:
        buf = np.zeros(1, dtype=cls.params_dtype())
        setattr(_params, cls.FAMILY, buf)
    buf[...] = 0
    return buf


def _fill(buf, **fields):
    for name, value in fields.items():
        buf[name] = value


def attention_forward(q, k, v, *, attn_bias=None, causal=None, scale=None, dropout_p=0.0, seed=None, offset=0,
                      cu_seqlens_q=None, cu_seqlens_k=None, stream=None, registry: Optional[Registry] = None):
    """Fused attention forward: returns ``(out [B, M, H, Kv], lse [B, H, M] float32)``.

    ``causal``: None, "top_left" (query i sees keys <= i) or "bottom_right"
    (the diagonal ends at the last key).  With ``cu_seqlens_q/k`` (int32,
    [S+1] offsets) the batch is S packed sequences in dim 1 of a batch of 1;
    ``lse`` is then [S, H, max_seqlen_q].  ``dropout_p > 0`` needs ``seed``;
    pass the same ``seed``/``offset`` to the backward.
    """
    cupy = _cupy()
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    c = _common(q, k, v, causal, scale, dropout_p, seed, offset, cu_seqlens_q, cu_seqlens_k)
    registry = registry or default_registry()
    bias = _bias(cupy, attn_bias, c, q, q.shape[1], k.shape[1])
    with cupy.cuda.Device(c.device):
        out = cupy.empty((q.shape[0], q.shape[1], c.H, c.Kv), dtype=q.dtype)
        lse_rows = -(-c.M // 32) * 32
        lse = cupy.empty((c.batches, c.H, lse_rows), dtype=cupy.float32)
        if c.M == 0 or c.N == 0 or q.shape[1] == 0:
            out.fill(0)
            lse.fill(-np.inf)  # softmax over no keys: empty sum
            return out, lse[:, :, :c.M]
        arrays = [q, k, v] + ([bias] if bias is not None else [])
        req = Request("mem_eff_fwd", c.dtype, c.K, c.Kv, _alignment(arrays, (c.K, c.Kv)), c.dropout_p > 0,
                      bias is not None, device_info(c.device))
        binary = _selector(registry).select(req)
        k_const = binary.constants
        accum = None
        if k_const["needs_output_accum_buffer"]:
            accum = cupy.empty((q.shape[0], q.shape[1], c.H, c.Kv), dtype=cupy.float32)
        qs, ks, vs = _elem_strides(q), _elem_strides(k), _elem_strides(v)
        bs = _elem_strides(bias) if bias is not None else (0, 0, 0, 0)
        _check_int32(q_strideM=qs[1], k_strideM=ks[1], v_strideM=vs[1], q_strideH=qs[2], k_strideH=ks[2],
                     v_strideH=vs[2], bias_strideM=bs[2], o_strideM=c.H * c.Kv, num_queries=q.shape[1],
                     num_keys=k.shape[1])
        p = _params_buffer(MemEffFwd)
        _fill(p, query_ptr=q.data.ptr, key_ptr=k.data.ptr, value_ptr=v.data.ptr,
              attn_bias_ptr=bias.data.ptr if bias is not None else 0,
              seqstart_q_ptr=c.seqstart_q.data.ptr if c.seqstart_q is not None else 0,
              seqstart_k_ptr=c.seqstart_k.data.ptr if c.seqstart_k is not None else 0,
              output_ptr=out.data.ptr, output_accum_ptr=accum.data.ptr if accum is not None else 0,
              logsumexp_ptr=lse.data.ptr, scale=c.scale, head_dim=c.K, head_dim_value=c.Kv,
              num_queries=c.M, num_keys=c.N, num_keys_absolute=c.N, custom_mask_type=c.mask,
              q_strideM=qs[1], k_strideM=ks[1], v_strideM=vs[1], bias_strideM=bs[2], o_strideM=c.H * c.Kv,
              q_strideH=qs[2], k_strideH=ks[2], v_strideH=vs[2], bias_strideH=bs[1],
              q_strideB=qs[0], k_strideB=ks[0], v_strideB=vs[0], bias_strideB=bs[0],
              num_batches=c.batches, num_heads=c.H, use_dropout=c.dropout_p > 0, dropout_prob=c.dropout_p,
              rng_engine_inputs_seed=c.seed, rng_engine_inputs_offset=c.offset)
        grid = (-(-c.M // k_const["queries_per_block"]), c.H, c.batches)
        block = (32, k_const["warps_per_block"], 1)
        _launch(registry, binary, c.device, grid, block, p, stream)
    return out, lse[:, :, :c.M]


def attention_backward(grad_out, q, k, v, out, lse, *, attn_bias=None, bias_requires_grad=False, causal=None,
                       scale=None, dropout_p=0.0, seed=None, offset=0, cu_seqlens_q=None, cu_seqlens_k=None,
                       stream=None, registry: Optional[Registry] = None):
    """Gradients of ``attention_forward``: returns ``(dq, dk, dv)``, plus ``dbias`` when
    ``bias_requires_grad`` (full [B, H, M, N]; sum over broadcast dims yourself).

    ``out`` and ``lse`` are what the forward returned for the same inputs and
    options (same ``seed``/``offset`` when dropout is on).
    """
    cupy = _cupy()
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    grad_out, out, lse = as_array(grad_out, "grad_out"), as_array(out, "out"), as_array(lse, "lse")
    c = _common(q, k, v, causal, scale, dropout_p, seed, offset, cu_seqlens_q, cu_seqlens_k)
    out_shape = (q.shape[0], q.shape[1], c.H, c.Kv)
    for name, x in (("out", out), ("grad_out", grad_out)):
        _check_bmhk(name, x, q.dtype, c.device)
        if tuple(x.shape) != out_shape:
            raise ValueError(f"{name} has shape {tuple(x.shape)}; expected {out_shape} ([B, M, H, Kv])")
    if lse.dtype != cupy.float32:
        raise TypeError(f"lse must be float32 (as attention_forward returns it); got {lse.dtype}")
    if lse.ndim != 3 or tuple(lse.shape[:2]) != (c.batches, c.H) or lse.shape[2] < c.M:
        raise ValueError(f"lse has shape {tuple(lse.shape)}; expected [{c.batches}, {c.H}, {c.M}] "
                         "as attention_forward returns it")
    if lse.device.id != c.device:
        raise ValueError(f"lse is on GPU {lse.device.id}, q is on GPU {c.device}")
    if attn_bias is None and bias_requires_grad:
        raise ValueError("bias_requires_grad=True without attn_bias")
    registry = registry or default_registry()
    bias = _bias(cupy, attn_bias, c, q, q.shape[1], k.shape[1])
    with cupy.cuda.Device(c.device):
        dq, dk, dv = cupy.empty_like(q, order="C"), cupy.empty_like(k, order="C"), cupy.empty_like(v, order="C")
        cols = -(-k.shape[1] // 8) * 8
        # zeros: with a causal mask the kernel skips key blocks no query sees and never writes their dbias
        dbias_full = (cupy.zeros((c.B, c.H, q.shape[1], cols), dtype=q.dtype) if bias_requires_grad else None)
        dbias = dbias_full[..., :k.shape[1]] if dbias_full is not None else None
        grads = (dq, dk, dv) + ((dbias,) if bias_requires_grad else ())
        if c.M == 0 or c.N == 0 or q.shape[1] == 0 or k.shape[1] == 0:
            for g in grads:
                g.fill(0)
            return grads
        if _elem_strides(out)[1:] != (c.H * c.Kv, c.Kv, 1):
            out = cupy.ascontiguousarray(out)  # the kernel derives out's row stride from H * Kv
        if lse.shape[2] > 1 and lse.strides[2] != 4 or _elem_strides(lse)[1] % 8 or _elem_strides(lse)[0] % 8:
            padded = cupy.empty((c.batches, c.H, -(-c.M // 32) * 32), dtype=cupy.float32)
            padded[:, :, :c.M] = lse[:, :, :c.M]
            lse = padded
        arrays = [q, k, v, out, grad_out] + ([bias] if bias is not None else [])
        req = Request("mem_eff_bwd", c.dtype, c.K, c.Kv, _alignment(arrays, (c.K, c.Kv)), c.dropout_p > 0,
                      bias is not None, device_info(c.device))
        binary = _selector(registry).select(req)
        kc = binary.constants
        if c.seqstart_q is not None:  # the kernel indexes delta as [H, total_q]
            total_q = q.shape[1]
            delta = cupy.empty((c.H, total_q), dtype=cupy.float32)
            delta_strides = (0, total_q)
        else:
            delta = cupy.empty((c.B, c.H, c.M), dtype=cupy.float32)
            delta_strides = (c.H * c.M, c.M)
        if not kc["kernel_computes_delta"]:
            rowsum = (grad_out.astype(cupy.float32) * out.astype(cupy.float32)).sum(axis=-1)  # [B, M, H]
            delta[...] = rowsum.transpose(0, 2, 1).reshape(delta.shape)
        splits = num_splits_key(binary, c.batches, c.H, c.N, device_info(c.device))
        ws_bytes = workspace_bytes(binary, c.batches, c.H, c.M, c.N, c.K, c.Kv, splits)
        workspace = None
        if ws_bytes:
            workspace = (cupy.zeros if splits > 1 else cupy.empty)(ws_bytes // 4, dtype=cupy.float32)
        qs, ks, vs, os_ = _elem_strides(q), _elem_strides(k), _elem_strides(v), _elem_strides(out)
        gos, ls = _elem_strides(grad_out), _elem_strides(lse)
        bs = _elem_strides(bias) if bias is not None else (0, 0, 0, 0)
        gbs = _elem_strides(dbias_full) if dbias_full is not None else (0, 0, 0, 0)
        _check_int32(q_strideM=qs[1], k_strideM=ks[1], v_strideM=vs[1], q_strideH=qs[2], k_strideH=ks[2],
                     v_strideH=vs[2], gO_strideM=gos[1], bias_strideM=bs[2], gB_strideM=gbs[2],
                     num_queries=q.shape[1], num_keys=k.shape[1])
        p = _params_buffer(MemEffBwd)
        _fill(p, query_ptr=q.data.ptr, key_ptr=k.data.ptr, value_ptr=v.data.ptr,
              bias_ptr=bias.data.ptr if bias is not None else 0, logsumexp_ptr=lse.data.ptr,
              output_ptr=out.data.ptr, grad_output_ptr=grad_out.data.ptr, delta_ptr=delta.data.ptr,
              cu_seqlens_q_ptr=c.seqstart_q.data.ptr if c.seqstart_q is not None else 0,
              cu_seqlens_k_ptr=c.seqstart_k.data.ptr if c.seqstart_k is not None else 0,
              grad_query_ptr=dq.data.ptr, grad_key_ptr=dk.data.ptr, grad_value_ptr=dv.data.ptr,
              grad_bias_ptr=dbias_full.data.ptr if dbias_full is not None else 0,
              workspace=workspace.data.ptr if workspace is not None else 0,
              scale=c.scale, head_dim=c.K, head_dim_value=c.Kv, num_queries=c.M, num_keys=c.N, num_heads=c.H,
              custom_mask_type=c.mask, q_strideM=qs[1], k_strideM=ks[1], v_strideM=vs[1], bias_strideM=bs[2],
              gO_strideM=gos[1], gB_strideM=gbs[2], gQKV_strideM_multiplier=1,
              rng_engine_inputs_seed=c.seed, rng_engine_inputs_offset=c.offset, dropout_prob=c.dropout_p,
              o_strideH=os_[2], q_strideH=qs[2], k_strideH=ks[2], v_strideH=vs[2], bias_strideH=bs[1],
              o_strideB=os_[0], q_strideB=qs[0], k_strideB=ks[0], v_strideB=vs[0], bias_strideB=bs[0],
              lse_strideB=ls[0], lse_strideH=ls[1], delta_strideB=delta_strides[0], delta_strideH=delta_strides[1],
              num_batches=c.batches, num_splits_key=splits,
              gO_strideB=gos[0], gQ_strideB=_elem_strides(dq)[0], gK_strideB=_elem_strides(dk)[0],
              gV_strideB=_elem_strides(dv)[0], gB_strideB=gbs[0], gO_strideH=gos[2], gQ_strideH=c.K,
              gK_strideH=c.K, gV_strideH=c.Kv, gB_strideH=gbs[1])
        _launch(registry, binary, c.device, (splits, c.H, c.batches), (kc["threads_per_block"], 1, 1), p, stream)
    return grads


def explain(q, k, v, *, backward=False, attn_bias=None, dropout_p=0.0, registry: Optional[Registry] = None):
    """Every candidate kernel for this call, in the order tried, with why it was rejected or chosen."""
    cupy = _cupy()
    q, k, v = as_array(q, "q"), as_array(k, "k"), as_array(v, "v")
    c = _common(q, k, v, None, None, dropout_p, 0 if dropout_p else None, 0, None, None)
    bias = _bias(cupy, attn_bias, c, q, q.shape[1], k.shape[1])
    arrays = [q, k, v] + ([bias] if bias is not None else [])
    family = "mem_eff_bwd" if backward else "mem_eff_fwd"
    req = Request(family, c.dtype, c.K, c.Kv, _alignment(arrays, (c.K, c.Kv)), c.dropout_p > 0,
                  bias is not None, device_info(c.device))
    return _selector(registry or default_registry()).explain(req)
