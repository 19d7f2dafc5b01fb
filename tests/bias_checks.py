"""What the bias tests of both families run (test_sm90_bias_gpu.py, test_sm80_bias_gpu.py): the kernel
that served a call, one call with a bias against the float64 reference in poisoned memory, and the
grid of shapes, broadcasts and masks they cover.  Import after CuPy (the callers skip without it)."""
from __future__ import annotations

import flashgen
from attention_reference import (BIAS_BROADCASTS, BWD_TOL, FWD_TOL, lse_err, make_bias,
                                 make_input, poisoned_allocations, reference, rel_err)

SIZES = ((1, 1), (7, 129), (129, 7), (1000, 129), (129, 1000), (1000, 1000), (1, 1000), (129, 129))
GRID = [(dtype, K, broadcast, *SIZES[(i + j + b + c) % len(SIZES)], causal)
        for i, dtype in enumerate(("f16", "bf16")) for j, K in enumerate((64, 128))
        for b, broadcast in enumerate(BIAS_BROADCASTS) for c, causal in enumerate((None, "top_left", "bottom_right"))]
GRID_IDS = [f"{d}-k{k}-bcast{b or '-'}-{m}x{n}-{c}" for d, k, b, m, n, c in GRID]


def selected(q, k, v, backward=False, **options):
    return next(name for name, _, verdict in flashgen.explain(q, k, v, backward=backward, **options)
                if verdict == "selected")


def assert_bias_pair(arch, q, k, v, **options):
    """Both directions are served by ``arch``'s (sm90, sm80) bias instances; returns their names
    (forward, backward)."""
    names = tuple(selected(q, k, v, backward=backward, **options) for backward in (False, True))
    for name, family in zip(names, (f"{arch}_fwd_", f"{arch}_bwd_")):
        assert name.startswith(family) and "_bias_" in name, f"served by {name}, not an {arch} bias instance"
    return names


def check_bias(arch, rng, dtype, B, M, N, H, K, broadcast="", Hk=None, bias=None, deterministic=False,
               layout="contiguous", dbias=True, **options):
    """Forward and backward with a bias on ``arch``'s bias instances against the reference; returns the
    inputs and outputs."""
    Hk = Hk or H
    q, do = (make_input(rng, (B, M, H, K), dtype, layout) for _ in range(2))
    k, v = (make_input(rng, (B, N, Hk, K), dtype, layout) for _ in range(2))
    bias = make_bias(rng, dtype, B, H, M, N, broadcast) if bias is None else bias
    assert_bias_pair(arch, q, k, v, attn_bias=bias, **options)
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, attn_bias=bias, **options)
        grads = flashgen.attention_backward(do, q, k, v, out, lse, attn_bias=bias, bias_requires_grad=dbias,
                                            deterministic=deterministic, **options)
    ref_out, ref_lse, ref_grads = reference(q, k, v, grad_out=do, bias=bias, **options)
    assert out.shape == (B, M, H, K) and lse.shape == (B, H, M)
    fwd = {"out": rel_err(out, ref_out), "lse": lse_err(lse, ref_lse)}
    assert all(e < FWD_TOL[dtype] for e in fwd.values()), fwd
    assert len(grads) == 3 + dbias
    if dbias:  # summed over the batch and the heads where the bias has extent 1 (attention_backward)
        extents = (1,) * (4 - bias.ndim) + tuple(bias.shape)
        folded = tuple(1 if extent == 1 else n for extent, n in zip(extents, (B, H))) + (M, N)
        assert grads[3].shape == folded and grads[3].dtype == q.dtype
    bwd = {name: rel_err(g, r) for name, g, r in zip(("dq", "dk", "dv", "dbias"), grads, ref_grads)}
    assert all(e < BWD_TOL[dtype] for e in bwd.values()), bwd
    return (q, k, v, do, bias, out, lse), grads
