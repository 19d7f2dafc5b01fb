"""Score mods compiled into the Hopper kernels, on a GPU: the built-in ALiBi (default set) and the
mods of tests/score_mods_example.py, forward and gradients against float64 with the mod evaluated
densely (flashgen.mods' NumPy/CuPy translation of the same declaration), on poisoned outputs.

The example mods are built apart; point FLASHGEN_MODS_BUILD at the directory of

    flashgen build --mods tests/score_mods_example.py --arch sm90a --kernels '*_mod_tempered_*,*_mod_tanh_cap_*' \\
        --out build/mods
"""
from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

cupy = pytest.importorskip("cupy")
from attention_reference import (BWD_TOL, FWD_TOL, f64, gpu_marks, hopper_kernels, logsumexp, lse_err,  # noqa: E402
                                 mask_matrix, poisoned_allocations, randn, rel_err)

HAVE_GPU, pytestmark = gpu_marks()

import flashgen  # noqa: E402
from flashgen.mods import BUILTIN_MODS, ScoreMod, load_mods  # noqa: E402
from flashgen.runtime.registry import Registry, search_path  # noqa: E402

EXAMPLE = Path(__file__).parent / "score_mods_example.py"
BUILD_COMMAND = ("flashgen build --mods tests/score_mods_example.py --arch sm90a "
                 "--kernels '*_mod_tempered_*,*_mod_tanh_cap_*' --out build/mods")
ALIBI_BUILT = any(b.spec.score_mod == "alibi" for b in hopper_kernels("sm90_fwd"))
needs_alibi = pytest.mark.skipif(not ALIBI_BUILT, reason="no sm90 ALiBi kernels for GPU 0: flashgen build --arch sm90a "
                                                         "--kernels '*_mod_alibi_*' and FLASHGEN_KERNEL_PATH")


def example_registry():
    """A registry over FLASHGEN_MODS_BUILD (then the default path), or a skip naming the build command."""
    where = os.environ.get("FLASHGEN_MODS_BUILD")
    if not HAVE_GPU or not where:
        pytest.skip(f"set FLASHGEN_MODS_BUILD to the output of `{BUILD_COMMAND}`")
    return Registry(search_path([Path(where)]))


def alibi_slopes(H):
    """The ALiBi paper's geometric slopes, 2^(-8 i / H)."""
    return cupy.asarray([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)], dtype=cupy.float32)


def modded_reference(q, k, v, do, mod: ScoreMod, tensors, causal=None, window=None, scale=None):
    """float64 (out, lse, (dq, dk, dv)) with scores mod(scale * q.k) and dS times the mod's grad;
    grouped-query k/v repeated per query head and their gradients summed back over each group."""
    B, M, H, K = q.shape
    N, group = k.shape[1], H // k.shape[2]
    scale = 1 / math.sqrt(K) if scale is None else scale
    kr, vr = (cupy.repeat(f64(x), group, axis=2) for x in (k, v))
    q, do = f64(q), f64(do)
    index = (cupy.arange(B)[:, None, None, None], cupy.arange(H)[None, :, None, None],
             cupy.arange(M)[None, None, :, None], cupy.arange(N)[None, None, None, :])
    raw = cupy.einsum("bmhk,bnhk->bhmn", q, kr) * scale
    s = mod.function(tensors, xp=cupy)(*index, score=raw)
    slope = ScoreMod(mod.grad, tensors=mod.tensors, grad="1").function(tensors, xp=cupy)(*index, score=raw)
    visible = mask_matrix(M, N, causal, window)
    if visible is not None:
        s = cupy.where(visible, s, -cupy.inf)
    lse = logsumexp(s)
    prob = cupy.where(cupy.isfinite(lse)[..., None], cupy.exp(s - lse[..., None]), 0.0)
    out = cupy.einsum("bhmn,bnhk->bmhk", prob, vr)
    dp = cupy.einsum("bmhk,bnhk->bhmn", do, vr)
    ds = prob * (dp - (dp * prob).sum(-1, keepdims=True)) * slope
    dq = cupy.einsum("bhmn,bnhk->bmhk", ds, kr) * scale
    dk = cupy.einsum("bhmn,bmhk->bnhk", ds, q) * scale
    dv = cupy.einsum("bhmn,bmhk->bnhk", prob, do)
    fold = lambda g: g.reshape(B, N, k.shape[2], group, g.shape[3]).sum(axis=3)  # noqa: E731
    return out, lse, (dq, fold(dk), fold(dv))


def check(name, mod, tensors, dtype, B, H, Hk, M, N, K, registry=None, **options):
    r = np.random.default_rng(M * 7 + N + K + H)
    q, do = randn(r, (B, M, H, K), dtype), randn(r, (B, M, H, K), dtype)
    k, v = randn(r, (B, N, Hk, K), dtype), randn(r, (B, N, Hk, K), dtype)
    call = dict(score_mod=name, mod_tensors=tensors, registry=registry, **options)
    with poisoned_allocations():
        out, lse = flashgen.attention_forward(q, k, v, **call)
        dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, **call)
    ro, rl, (rdq, rdk, rdv) = modded_reference(q, k, v, do, mod, tensors, **options)
    assert rel_err(out, ro) < FWD_TOL[dtype] and lse_err(lse, rl) < FWD_TOL[dtype]
    for g, ref in ((dq, rdq), (dk, rdk), (dv, rdv)):
        assert rel_err(g, ref, zero_scale=np.sqrt(K)) < BWD_TOL[dtype]


ALIBI_CASES = [  # dtype, B, H, Hk, M, N, K, options
    ("f16", 1, 2, 2, 1, 1, 64, {}),
    ("bf16", 2, 4, 4, 7, 129, 128, {}),
    ("f16", 2, 8, 2, 129, 7, 64, {}),
    ("bf16", 1, 8, 1, 1000, 1000, 64, dict(causal="top_left")),
    ("f16", 2, 4, 4, 129, 1000, 128, dict(causal="bottom_right")),
    ("bf16", 1, 4, 2, 1000, 129, 96, {}),
    ("f16", 1, 4, 4, 1000, 700, 32, dict(window=(100, 20))),
    ("f16", 1, 4, 4, 1000, 1000, 128, dict(causal="top_left", scale=0.3)),
]


@needs_alibi
@pytest.mark.parametrize("dtype,B,H,Hk,M,N,K,options", ALIBI_CASES)
def test_alibi_matches_float64(dtype, B, H, Hk, M, N, K, options):
    check("alibi", BUILTIN_MODS["alibi"], {"slope": alibi_slopes(H)}, dtype, B, H, Hk, M, N, K, **options)


@needs_alibi
def test_an_alibi_call_runs_the_alibi_instance_and_refuses_what_it_cannot_take():
    q = randn(np.random.default_rng(0), (1, 64, 4, 64), "f16")
    rows = flashgen.explain(q, q, q, score_mod="alibi", mod_tensors={"slope": alibi_slopes(4)})
    assert "_mod_alibi_" in next(name for name, _, verdict in rows if verdict == "selected")
    with pytest.raises(flashgen.UnsupportedError, match="with softcap"):
        flashgen.attention_forward(q, q, q, softcap=5.0, score_mod="alibi", mod_tensors={"slope": alibi_slopes(4)})
    with pytest.raises(TypeError, match=r"tensor 'slope' must be float32"):
        flashgen.attention_forward(q, q, q, score_mod="alibi", mod_tensors={"slope": alibi_slopes(4).astype("f2")})
    with pytest.raises(flashgen.UnsupportedError, match=r"score mod 'nowhere' is not built: .*flashgen build --mods"):
        flashgen.attention_forward(q, q, q, score_mod="nowhere", mod_tensors={})


@needs_alibi
def test_repeated_alibi_calls_replay_a_plan_that_reads_each_calls_tensors():
    """From the second call of a signature on, the forward replays the first's launch plan: each call's
    slopes (new values at a new address) and inputs must reach the kernels, forward and backward."""
    from flashgen.runtime import plans

    B, H, M, K = 2, 4, 300, 64
    r = np.random.default_rng(5)
    for step in range(3):
        q, k, v, do = (randn(r, (B, M, H, K), "f16") for _ in range(4))
        slope = alibi_slopes(H) * (step + 1)
        call = dict(causal="top_left", score_mod="alibi", mod_tensors={"slope": slope})
        with poisoned_allocations():
            out, lse = flashgen.attention_forward(q, k, v, **call)
            replayed = plans.served()
            dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, **call)
        assert (replayed is not None) == (step > 0)
        ro, rl, grads = modded_reference(q, k, v, do, BUILTIN_MODS["alibi"], {"slope": slope}, causal="top_left")
        assert rel_err(out, ro) < FWD_TOL["f16"] and lse_err(lse, rl) < FWD_TOL["f16"]
        for g, ref in zip((dq, dk, dv), grads):
            assert rel_err(g, ref, zero_scale=np.sqrt(K)) < BWD_TOL["f16"]


@needs_alibi
def test_alibi_through_flashgen_torch_matches_the_cupy_path():
    """The same kernels on the same inputs (dq in a fixed order): the same bits."""
    torch = pytest.importorskip("torch")
    import flashgen.torch as ft

    r = np.random.default_rng(3)
    q, k, v, do = (randn(r, (2, 300, 4, 64), "f16") for _ in range(4))
    slope = alibi_slopes(4)
    out, lse = flashgen.attention_forward(q, k, v, causal="top_left", score_mod="alibi", mod_tensors={"slope": slope})
    grads = flashgen.attention_backward(do, q, k, v, out, lse, causal="top_left", score_mod="alibi",
                                        mod_tensors={"slope": slope}, deterministic=True)
    tq, tk, tv = (torch.from_dlpack(x).clone().requires_grad_() for x in (q, k, v))
    ts = torch.from_dlpack(slope)
    tout = ft.attention(tq, tk, tv, causal="top_left", score_mod="alibi", mod_tensors={"slope": ts},
                        deterministic=True)
    tout.backward(torch.from_dlpack(do))
    assert torch.equal(tout, torch.from_dlpack(out))
    for g, t in zip(grads, (tq, tk, tv)):
        assert torch.equal(t.grad, torch.from_dlpack(g))
    with pytest.raises(flashgen.UnsupportedError, match="gradients into captured tensors are not computed"):
        ft.attention(tq, tk, tv, score_mod="alibi", mod_tensors={"slope": ts.clone().requires_grad_()})



@needs_alibi
def test_alibi_under_torch_compile_matches_float64_with_each_calls_slopes():
    """torch.compile(fullgraph=True) traces the operators with the mod by name and the slopes as a
    graph input: each call's slopes (new values) reach the kernels, forward and backward, at a
    grouped-query ratio of 4, on outputs poisoned before launch."""
    torch = pytest.importorskip("torch")
    import flashgen.torch as ft

    def step(q, k, v, slope):
        return ft.attention(q, k, v, causal="top_left", score_mod="alibi", mod_tensors={"slope": slope})

    compiled = torch.compile(step, fullgraph=True)
    r = np.random.default_rng(11)
    for factor in (1.0, 3.0):
        q, do = (randn(r, (2, 300, 8, 64), "bf16") for _ in range(2))
        k, v = (randn(r, (2, 129, 2, 64), "bf16") for _ in range(2))
        slope = alibi_slopes(8) * factor
        tq, tk, tv = (torch.from_dlpack(x).clone().requires_grad_() for x in (q, k, v))
        with poisoned_allocations():
            out = compiled(tq, tk, tv, torch.from_dlpack(slope))
            out.backward(torch.from_dlpack(do))
        ro, _, grads = modded_reference(q, k, v, do, BUILTIN_MODS["alibi"], {"slope": slope}, causal="top_left")
        assert rel_err(cupy.from_dlpack(out.detach()), ro) < FWD_TOL["bf16"]
        for t, ref in zip((tq, tk, tv), grads):
            assert rel_err(cupy.from_dlpack(t.grad), ref, zero_scale=np.sqrt(64)) < BWD_TOL["bf16"]

EXAMPLE_CASES = [  # mod, dtype, B, H, Hk, M, N, K, options
    ("tempered", "f16", 2, 4, 2, 129, 1000, 64, {}),
    ("tempered", "bf16", 1, 8, 8, 1000, 1000, 128, dict(causal="top_left")),
    ("tempered", "f16", 1, 2, 2, 7, 1, 128, {}),
    ("tanh_cap", "bf16", 2, 4, 4, 1000, 129, 64, {}),
    ("tanh_cap", "f16", 1, 4, 1, 700, 700, 128, dict(causal="bottom_right")),
]


@pytest.mark.parametrize("name,dtype,B,H,Hk,M,N,K,options", EXAMPLE_CASES)
def test_the_example_mods_match_float64(name, dtype, B, H, Hk, M, N, K, options):
    registry = example_registry()
    mod = load_mods(EXAMPLE)[name]
    values = cupy.asarray(np.linspace(0.5, 2.0, H), dtype=cupy.float32)  # temperatures; caps (scores reach ~4)
    tensors = {"temp": values} if name == "tempered" else {"cap": values * 2}
    check(name, mod, tensors, dtype, B, H, Hk, M, N, K, registry=registry, **options)
    # the declaration itself finds the same instances, whatever the caller calls it
    q = randn(np.random.default_rng(1), (1, 8, H, K), dtype)
    k = q[:, :, :Hk]
    by_name = flashgen.attention_forward(q, k, k, score_mod=name, mod_tensors=tensors, registry=registry)[0]
    by_mod = flashgen.attention_forward(q, k, k, score_mod=mod, mod_tensors=tensors, registry=registry)[0]
    assert bool((by_name == by_mod).all())
