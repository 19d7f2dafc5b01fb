"""PyTorch adapter: flashgen's kernels as a ``torch.autograd.Function``.

    from flashgen.torch import attention
    out = attention(q, k, v, causal="top_left")      # q, k, v: [B, M, H, K] CUDA tensors
    out.sum().backward()

Tensors cross to CuPy and back through DLPack without copies, and the kernels
run on torch's current stream, so this drops into a training loop (autocast
and torch.compile aside).  ``import flashgen`` never imports torch; only this
module does.
"""
from __future__ import annotations

import contextlib

import torch

from flashgen.runtime import api


@contextlib.contextmanager
def _torch_stream(device: torch.device):
    """Make torch's current stream CuPy's current stream, so both order their work the same."""
    import cupy

    stream = torch.cuda.current_stream(device)
    if hasattr(stream, "__cuda_stream__") and hasattr(cupy.cuda.Stream, "from_external"):
        external = cupy.cuda.Stream.from_external(stream)
    else:
        external = cupy.cuda.ExternalStream(stream.cuda_stream, device.index)
    with cupy.cuda.Device(device.index), external:
        yield


def _plain(t):
    """DLPack refuses tensors that require grad; the kernels only read the data."""
    return None if t is None else t.detach()


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, attn_bias, causal, scale, dropout_p, seed, offset):
        opts = dict(causal=causal, scale=scale, dropout_p=dropout_p, seed=seed, offset=offset)
        with _torch_stream(q.device):
            out, lse = api.attention_forward(_plain(q), _plain(k), _plain(v), attn_bias=_plain(attn_bias), **opts)
        out, lse = torch.from_dlpack(out), torch.from_dlpack(lse)
        ctx.save_for_backward(q, k, v, attn_bias, out, lse)
        ctx.opts = opts
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, attn_bias, out, lse = ctx.saved_tensors
        bias_grad = attn_bias is not None and ctx.needs_input_grad[3]
        if grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        with _torch_stream(q.device):
            grads = api.attention_backward(_plain(grad_out), _plain(q), _plain(k), _plain(v), _plain(out), _plain(lse),
                                           attn_bias=_plain(attn_bias), bias_requires_grad=bias_grad, **ctx.opts)
        dq, dk, dv = (torch.from_dlpack(g) for g in grads[:3])
        dbias = torch.from_dlpack(grads[3]).sum_to_size(attn_bias.shape) if bias_grad else None
        return dq, dk, dv, dbias, None, None, None, None, None


def attention(q, k, v, attn_bias=None, *, causal=None, scale=None, dropout_p=0.0, seed=None, offset=0):
    """softmax(q k^T * scale + bias) v over [B, M, H, K] tensors, differentiable.

    With ``dropout_p > 0`` and no ``seed``, a seed is drawn from torch's CPU
    generator (so ``torch.manual_seed`` makes runs repeatable); the backward
    redraws the same mask from it.
    """
    if dropout_p > 0 and seed is None:
        seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))
    return _Attention.apply(q, k, v, attn_bias, causal, scale, dropout_p, seed, offset)
