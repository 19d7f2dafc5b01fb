"""flashgen.torch on a GPU: every option's gradients through the operator against float64,
launch plans for torch tensors, torch.compile(fullgraph=True), CUDA graphs, autocast, the
SDPA drop-in and packed sequences."""
from __future__ import annotations

import math
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cupy = pytest.importorskip("cupy")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

import flashgen  # noqa: E402
import flashgen.torch as ft  # noqa: E402
from attention_reference import BWD_TOL, FWD_TOL, lse_err, reference, rel_err  # noqa: E402
from flashgen.errors import UnsupportedError  # noqa: E402
from flashgen.runtime import plans  # noqa: E402

pytestmark = pytest.mark.gpu
DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def cp(t):
    return cupy.from_dlpack(t.detach())


def poison_torch_cache(nbytes=1 << 28):
    """Fill torch's cached free blocks with NaN so an output element the kernels never write shows."""
    torch.full((nbytes // 4,), float("nan"), device="cuda")
    torch.cuda.synchronize()


def randn(shape, dtype, seed, requires_grad=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", dtype=DTYPES[dtype], generator=g).requires_grad_(requires_grad)


def run(q, k, v, bias=None, **options):
    """out and the gradients of q, k, v (and bias) through ft.attention, from poisoned memory."""
    poison_torch_cache()
    try:
        out = ft.attention(q, k, v, bias, **options)
    except UnsupportedError as e:
        pytest.skip(f"no kernels for this call on this GPU: {e}")
    do = torch.randn_like(out)
    inputs = [t for t in (q, k, v, bias) if t is not None and t.requires_grad]
    grads = torch.autograd.grad(out, inputs, do)
    return out, do, grads


CASES = [  # (dtype, B, M, N, H, Hk, K, options)
    ("f16", 2, 1, 7, 2, 2, 64, {}),
    ("bf16", 1, 129, 1000, 8, 2, 128, {"causal": "bottom_right"}),
    ("bf16", 2, 1000, 129, 8, 1, 64, {"causal": "top_left"}),
    ("f16", 1, 300, 700, 4, 4, 128, {"window": (100, 20)}),
    ("bf16", 2, 257, 257, 8, 2, 64, {"causal": "top_left", "window": (64, None), "softcap": 20.0}),
    ("f16", 2, 200, 300, 4, 4, 64, {"scale": 0.3}),
    ("f32", 1, 129, 65, 2, 2, 40, {"causal": "top_left"}),
]


@pytest.mark.parametrize("dtype,B,M,N,H,Hk,K,options", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}x{c[3]}-h{c[4]}/{c[5]}-k{c[6]}-"
                                                                  + "-".join(map(str, c[7].items())) for c in CASES])
def test_gradients_of_every_option_match_float64(dtype, B, M, N, H, Hk, K, options):
    q, k, v = randn((B, M, H, K), dtype, 1), randn((B, N, Hk, K), dtype, 2), randn((B, N, Hk, K), dtype, 3)
    out, do, (dq, dk, dv) = run(q, k, v, **options)
    ref_out, _, ref = reference(cp(q), cp(k), cp(v), grad_out=cp(do), **options)
    assert rel_err(cp(out), ref_out) < FWD_TOL[dtype]
    for name, g, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert g.shape == r.shape and rel_err(cp(g), r, math.sqrt(K)) < BWD_TOL[dtype], name


def test_bias_gradient_is_summed_to_the_bias_shape():
    q, k, v = (randn((2, 129, 4, 64), "f16", s) for s in (1, 2, 3))
    bias = randn((1, 4, 129, 129), "f16", 4)
    out, do, (dq, dk, dv, dbias) = run(q, k, v, bias, causal="top_left")
    ref_out, _, (rq, rk, rv, ds) = reference(cp(q), cp(k), cp(v), bias=cp(bias), causal="top_left", grad_out=cp(do))
    assert rel_err(cp(out), ref_out) < FWD_TOL["f16"]
    assert dbias.shape == bias.shape
    assert rel_err(cp(dbias), ds.sum(axis=0, keepdims=True)) < BWD_TOL["f16"]
    for g, r in zip((dq, dk, dv), (rq, rk, rv)):
        assert rel_err(cp(g), r) < BWD_TOL["f16"]


@pytest.mark.parametrize("bias_shape", [(1, 4, 200, 136), (4, 200, 129), (2, 4, 200, 136)])
def test_repeated_bias_steps_replay_a_plan_with_their_own_dbias(bias_shape, monkeypatch):
    """A training step with a bias that requires grad replays a backward plan from the second step
    on, and from the third the forward plan's follower without api's lookup (the dbias its kernels
    add into or store is remade per call, in torch's memory): every step's gradients match float64
    on new data, and no step's dbias is an earlier one's.  129 keys: rows validation copies, no plan."""
    plans.clear()
    planned = bias_shape[-1] % 8 == 0  # else a per-call aligned copy of the bias
    lookups = []
    find = plans.find
    monkeypatch.setattr(plans, "find", lambda sig, direction, *a: lookups.append(direction) or find(sig, direction, *a))
    grads_seen = []
    for step, seed in enumerate((1, 10, 20)):
        q, k, v = randn((2, 200, 4, 64), "bf16", seed), randn((2, bias_shape[-1], 4, 64), "bf16", seed + 1), \
            randn((2, bias_shape[-1], 4, 64), "bf16", seed + 2)
        bias = randn(bias_shape, "bf16", seed + 3)
        before = len(lookups)
        out, do, (dq, dk, dv, dbias) = run(q, k, v, bias, causal="top_left")
        looked_up = lookups[before:]
        served = next(n for n, _, w in flashgen.explain(cp(q), cp(k), cp(v), attn_bias=cp(bias), causal="top_left",
                                                        backward=True) if w == "selected")
        if step == 1 and planned and served.startswith("sm90_bwd_"):
            torch_bwd = [plan for key, plan in plans._plans.items() if key[0] == "bwd" and key[1][0] == "torch"]
            assert [plan.sizes.get("dbias") is not None for plan in torch_bwd] == [True]
        if step == 2 and planned and served.startswith("sm90_bwd_"):
            assert looked_up == [], "the backward looked its plan up by api's key"
        _, _, (rq, rk, rv, ds) = reference(cp(q), cp(k), cp(v), bias=cp(bias), causal="top_left", grad_out=cp(do))
        assert dbias.shape == bias.shape and rel_err(cp(dbias), ds.reshape(bias_shape)) < BWD_TOL["bf16"], step
        for g, r in zip((dq, dk, dv), (rq, rk, rv)):
            assert rel_err(cp(g), r) < BWD_TOL["bf16"], step
        grads_seen.append(dbias)
    assert len({g.data_ptr() for g in grads_seen}) == len(grads_seen)


def test_dropout_and_deterministic_reach_the_runtime():
    """Dropout: the op draws what the runtime draws for the same seed; deterministic: the same bits."""
    import flashgen

    q, k, v = (randn((1, 200, 4, 64), "bf16", s) for s in (1, 2, 3))
    out = ft.attention(q, k, v, dropout_p=0.2, seed=1234, offset=8)
    direct, _ = flashgen.attention_forward(q.detach(), k.detach(), v.detach(), dropout_p=0.2, seed=1234, offset=8)
    assert torch.equal(out, direct)
    torch.manual_seed(5)
    first = ft.attention(q, k, v, dropout_p=0.2)
    torch.manual_seed(5)
    assert torch.equal(first, ft.attention(q, k, v, dropout_p=0.2)), "a drawn seed follows torch.manual_seed"
    outs = []
    for seed in (1, 2, 3, 4):  # from the third on, replays under the adapter's key: each with its seed and offset
        outs.append(ft.attention(q, k, v, dropout_p=0.2, seed=seed, offset=seed * 4))
        direct, _ = flashgen.attention_forward(q.detach(), k.detach(), v.detach(), dropout_p=0.2, seed=seed,
                                               offset=seed * 4)
        assert torch.equal(outs[-1], direct), seed
    assert not torch.equal(outs[2], outs[3])
    runs = []
    for _ in range(2):
        out = ft.attention(q, k, v, causal="top_left", deterministic=True)
        runs.append(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def test_lse_comes_back_in_the_layout_the_fake_promises():
    q, k, v = (randn((2, 100, 4, 64), "bf16", s) for s in (1, 2, 3))
    out, lse = ft.attention(q, k, v, return_lse=True)
    _, ref_lse = reference(cp(q), cp(k), cp(v))
    assert lse.shape == (2, 4, 100) and lse.stride() == (4 * 128, 128, 1) and not lse.requires_grad
    assert lse_err(cp(lse), ref_lse) < FWD_TOL["bf16"]


def test_packed_sequences_match_each_sequence_alone():
    lengths_q, lengths_k = [5, 0, 130, 64], [7, 3, 100, 64]
    cu_q = torch.tensor(np.cumsum([0] + lengths_q), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.cumsum([0] + lengths_k), dtype=torch.int32, device="cuda")
    q, k, v = randn((sum(lengths_q), 4, 64), "f16", 1), randn((sum(lengths_k), 2, 64), "f16", 2), \
        randn((sum(lengths_k), 2, 64), "f16", 3)
    poison_torch_cache()
    out, lse = ft.attention_varlen(q, k, v, cu_q, cu_k, 160, 100, causal="top_left", return_lse=True)
    assert out.shape == (sum(lengths_q), 4, 64) and lse.shape == (4, 4, 160)
    do = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
    for s in range(4):
        qs, ks = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
        if lengths_q[s] == 0:
            continue
        ref_out, _, (rq, rk, rv, _) = reference(cp(q[qs])[None], cp(k[ks])[None], cp(v[ks])[None],
                                                grad_out=cp(do[qs])[None], causal="top_left")
        assert rel_err(cp(out[qs])[None], ref_out) < FWD_TOL["f16"], s
        for g, r in zip((dq[qs], dk[ks], dv[ks]), (rq, rk, rv)):
            assert rel_err(cp(g)[None], r, 8.0) < BWD_TOL["f16"], s


def packed_reference_errors(q, k, v, out, cu_q, cu_k):
    """Each packed sequence's relative error against float64 attention on it alone."""
    errors = []
    for s in range(cu_q.numel() - 1):
        qs, ks = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
        if qs.stop > qs.start:
            ref, _, _ = reference(cp(q[qs])[None], cp(k[ks])[None], cp(v[ks])[None],
                                  grad_out=cupy.zeros((1,) + tuple(out[qs].shape), cupy.float16), causal="top_left")
            errors.append(rel_err(cp(out[qs])[None], ref))
    return errors


def test_a_step_reads_its_offsets_once_while_torch_says_they_are_unchanged():
    """Every layer of a packed-sequence step passes the same cu_seqlens tensors: the first call reads
    them on the host (waiting for the GPU), later ones reuse that copy and leave the GPU's queue
    running; an in-place write (torch bumps the version) or a new tensor is read again, and every
    call matches each sequence alone."""
    from flashgen.runtime import host_offsets

    host_offsets.clear()
    q, k, v = randn((300, 4, 64), "f16", 1), randn((260, 2, 64), "f16", 2), randn((260, 2, 64), "f16", 3)
    cu_q = torch.tensor([0, 100, 100, 300], dtype=torch.int32, device="cuda")
    cu_k = torch.tensor([0, 60, 130, 260], dtype=torch.int32, device="cuda")
    first = ft.attention_varlen(q, k, v, cu_q, cu_k, 200, 130, causal="top_left")  # reads both
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the next call
    again = ft.attention_varlen(q, k, v, cu_q, cu_k, 200, 130, causal="top_left")
    assert not torch.cuda.current_stream().query(), "the call waited for the GPU (read its offsets again)"
    torch.cuda.synchronize()
    assert torch.equal(first, again)
    assert max(packed_reference_errors(q, k, v, again, cu_q, cu_k)) < FWD_TOL["f16"]
    cu_q.copy_(torch.tensor([0, 150, 170, 300], dtype=torch.int32))  # in place: a new version
    moved = ft.attention_varlen(q, k, v, cu_q, cu_k, 150, 130, causal="top_left")
    assert max(packed_reference_errors(q, k, v, moved, cu_q, cu_k)) < FWD_TOL["f16"]
    del cu_k  # a new tensor, perhaps at the freed one's address
    cu_k = torch.tensor([0, 10, 200, 260], dtype=torch.int32, device="cuda")
    fresh = ft.attention_varlen(q, k, v, cu_q, cu_k, 150, 190, causal="top_left")
    assert max(packed_reference_errors(q, k, v, fresh, cu_q, cu_k)) < FWD_TOL["f16"]
    do = torch.randn_like(fresh)
    dq, dk, dv = torch.autograd.grad(fresh, (q, k, v), do)  # the backward reuses the forward's copies
    for s in range(3):
        qs, ks = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
        _, _, (rq, rk, rv, _) = reference(cp(q[qs])[None], cp(k[ks])[None], cp(v[ks])[None],
                                          grad_out=cp(do[qs])[None], causal="top_left")
        for g, r in zip((dq[qs], dk[ks], dv[ks]), (rq, rk, rv)):
            assert rel_err(cp(g)[None], r, 8.0) < BWD_TOL["f16"], s


@pytest.mark.parametrize("families", ["", "sm80_fwd,sm80_bwd"])
def test_packed_steps_replay_plans_that_clear_the_rows_past_the_last_sequence(monkeypatch, families):
    """From the third call with the same offsets tensors (the first reads them, the second leaves a
    plan keyed by their contents), a packed forward and backward replay their plans: in poisoned
    memory the rows past the last sequence come back zero and every sequence matches float64 on new
    data; offsets changed in place key another plan.  On the dispatch's own families, and forced onto
    the Ampere pair (where it is built for this GPU)."""
    from flashgen.runtime import host_offsets

    monkeypatch.setenv(plans.FAMILIES_VARIABLE, families)
    plans.clear()
    host_offsets.clear()
    replayed = []
    find = plans.find

    def recording(sig, direction, *args):
        found = find(sig, direction, *args)
        replayed.append((direction, found[1] is not None))
        return found

    monkeypatch.setattr(plans, "find", recording)
    cu_q = torch.tensor([0, 50, 50, 180], dtype=torch.int32, device="cuda")  # rows 180.. are in no sequence
    cu_k = torch.tensor([0, 70, 100, 160], dtype=torch.int32, device="cuda")
    for step in range(4):
        if step == 3:
            cu_q.copy_(torch.tensor([0, 90, 120, 190], dtype=torch.int32))
        ends, before = (int(cu_q[-1]), int(cu_k[-1])), len(replayed)
        q, k, v = randn((200, 4, 64), "bf16", 10 * step + 1), randn((170, 2, 64), "bf16", 10 * step + 2), \
            randn((170, 2, 64), "bf16", 10 * step + 3)
        poison_torch_cache()
        try:
            out = ft.attention_varlen(q, k, v, cu_q, cu_k, 130, 70, causal="top_left")
        except UnsupportedError as e:
            pytest.skip(f"{families or 'the default families'}: {e}")
        do = torch.randn_like(out)
        poison_torch_cache()
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), do)
        for x, end in ((out, ends[0]), (dq, ends[0]), (dk, ends[1]), (dv, ends[1])):
            assert bool((x[end:] == 0).all()), f"step {step}: rows past the last sequence are not zero"
        for s in range(3):
            qs, ks = slice(int(cu_q[s]), int(cu_q[s + 1])), slice(int(cu_k[s]), int(cu_k[s + 1]))
            if qs.stop == qs.start:
                continue
            ref_out, _, ref = reference(cp(q[qs])[None], cp(k[ks])[None], cp(v[ks])[None], grad_out=cp(do[qs])[None],
                                        causal="top_left")
            assert rel_err(cp(out[qs])[None], ref_out) < FWD_TOL["bf16"], (step, s)
            for g, r in zip((dq[qs], dk[ks], dv[ks]), ref):
                assert rel_err(cp(g)[None], r, 8.0) < BWD_TOL["bf16"], (step, s)
        if step == 2:
            assert replayed[before:] == [("fwd", True), ("bwd", True)], replayed
        if step == 3:  # written in place: the forward reads them again, the backward finds no plan for them
            assert replayed[before:] == [("bwd", False)], replayed


def test_torch_tensors_take_launch_plans_and_torchs_memory():
    plans.clear()
    q, k, v = (randn((2, 256, 4, 64), "bf16", s) for s in (1, 2, 3))
    first = ft.attention(q, k, v, causal="top_left")
    assert any(key[1][0] == "torch" for key in plans._plans), "no plan was made for torch tensors"
    before = torch.cuda.memory_allocated()
    again = ft.attention(q, k, v, causal="top_left")
    assert torch.cuda.memory_allocated() > before, "the planned output is not torch's memory"
    assert torch.equal(first, again)
    q2 = randn((2, 256, 4, 64), "bf16", 7)
    ref_out, _ = reference(cp(q2), cp(k), cp(v), causal="top_left")
    assert rel_err(cp(ft.attention(q2, k, v, causal="top_left")), ref_out) < FWD_TOL["bf16"]


def test_plans_made_on_one_thread_replay_on_a_fresh_one():
    """Autograd runs backwards on its own thread, whose first call may find a plan the main thread
    made (an eval pass, a direct call); a fresh thread has no CUDA context bound until a runtime
    call binds one, and the replay's driver-API launch must not depend on having made one."""
    plans.clear()
    q, k, v, do = (randn((1, 128, 2, 64), "f16", s, requires_grad=False) for s in (1, 2, 3, 4))
    out, lse = flashgen.attention_forward(q, k, v)
    grads = flashgen.attention_backward(do, q, k, v, out, lse)  # both plans made here
    assert {key[0] for key in plans._plans} == {"fwd", "bwd"}
    got = {}

    def replay():
        try:
            again, again_lse = flashgen.attention_forward(q, k, v)
            got["out"], got["grads"] = again, flashgen.attention_backward(do, q, k, v, again, again_lse)
            torch.cuda.synchronize()
        except Exception as e:  # reported below, on the test's thread
            got["error"] = e

    worker = threading.Thread(target=replay)
    worker.start()
    worker.join()
    assert "error" not in got, got.get("error")
    assert torch.equal(got["out"], out)
    for g, want in zip(got["grads"], grads):
        assert rel_err(cp(g), cp(want)) < BWD_TOL["f16"]


@pytest.mark.parametrize("loss", ["weighted", "sum"])
def test_backward_follows_the_forwards_plan(loss, monkeypatch):
    """From the third step on, a step's forward replays its plan under the adapter's own key and
    its backward that plan's follower, neither looked up by api's key, with the gradients of a
    fresh call.  ``sum`` hands the backward an expanded grad_out (stride 0), which it makes
    contiguous first."""
    plans.clear()
    q, k, v = randn((2, 129, 8, 64), "bf16", 1), randn((2, 300, 2, 64), "bf16", 2), randn((2, 300, 2, 64), "bf16", 3)
    w = torch.randn(2, 129, 8, 64, device="cuda", dtype=torch.bfloat16)
    lookups = []
    find = plans.find
    monkeypatch.setattr(plans, "find", lambda sig, direction, *a: lookups.append(direction) or find(sig, direction, *a))
    grads = []
    for step in range(4):
        poison_torch_cache()
        before = len(lookups)
        out = ft.attention(q, k, v, causal="bottom_right", deterministic=True)
        objective = (out * w).sum() if loss == "weighted" else out.sum()
        grads.append(torch.autograd.grad(objective, (q, k, v)))
        if step >= 2:
            assert len(lookups) == before, f"step {step}: a plan was looked up by api's key ({lookups[before:]})"
    do = (w if loss == "weighted" else torch.ones_like(w))
    _, _, ref = reference(cp(q), cp(k), cp(v), grad_out=cp(do), causal="bottom_right")
    for g, r in zip(grads[-1], ref):
        assert rel_err(cp(g), r, math.sqrt(64)) < BWD_TOL["bf16"]
    for step in grads[1:]:  # deterministic: the same bits from every path
        assert all(torch.equal(a, b) for a, b in zip(step, grads[0]))


def test_a_block_mask_step_does_not_follow(monkeypatch):
    """A block mask's backward plan ends with the mask's transposed lists: its steps keep the lookup."""
    plans.clear()
    q, k, v = (randn((1, 256, 2, 64), "f16", s) for s in (1, 2, 3))
    mask = flashgen.block_mask(lambda b, h, i, j: j <= i, 1, 2, 256, 256)
    lookups = []
    find = plans.find
    monkeypatch.setattr(plans, "find", lambda sig, direction, *a: lookups.append(direction) or find(sig, direction, *a))
    for _ in range(3):
        torch.autograd.grad(ft.attention(q, k, v, block_mask=mask).sum(), (q, k, v))
    assert lookups.count("bwd") == 3


def test_block_mask_calls_on_torch_tensors_take_launch_plans():
    """A torch caller's block-mask calls replay plans (keyed on torch views of the mask's arrays),
    forward and backward, with the results of the CuPy path on the same arrays."""
    plans.clear()
    q, k, v = randn((2, 384, 4, 64), "bf16", 1), randn((2, 300, 2, 64), "bf16", 2), randn((2, 300, 2, 64), "bf16", 3)
    doc = cupy.arange(384) // 100
    mask = flashgen.block_mask(lambda b, h, i, j: (doc[i] == doc[j]) & (j <= i), 1, 1, 384, 300)
    do = torch.randn(2, 384, 4, 64, device="cuda", dtype=torch.bfloat16)
    results = []
    for _ in range(3):
        poison_torch_cache()
        out = ft.attention(q, k, v, block_mask=mask)
        results.append((out,) + torch.autograd.grad(out, (q, k, v), do))
    torch_keys = [key for key in plans._plans if key[1][0] == "torch"]
    if not torch_keys:
        pytest.skip("no sparse kernels for this call on this GPU (the dense fallback leaves no plan)")
    assert {key[0] for key in torch_keys} == {"fwd", "bwd"}
    out, lse = flashgen.attention_forward(cp(q), cp(k), cp(v), block_mask=mask)
    want = (out,) + tuple(flashgen.attention_backward(cp(do), cp(q), cp(k), cp(v), out, lse, block_mask=mask))
    for step in results[1:]:
        for name, got, ref in zip(("out", "dq", "dk", "dv"), step, want):
            assert rel_err(cp(got), ref) < BWD_TOL["bf16"], name


class TinyBlock(torch.nn.Module):
    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)

    def forward(self, x):
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).unbind(2)
        return self.proj(ft.attention(q, k, v, causal="top_left").reshape(B, S, D))


def test_torch_compile_fullgraph_matches_eager():
    torch.manual_seed(0)
    model = TinyBlock().cuda().to(torch.bfloat16)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    eager = model(x)
    (gx,) = torch.autograd.grad(eager.float().square().mean(), x)
    compiled = torch.compile(model, fullgraph=True)
    traced = compiled(x)
    (cx,) = torch.autograd.grad(traced.float().square().mean(), x)
    assert float((traced - eager).float().norm() / eager.float().norm()) < 1e-2
    assert float((cx - gx).float().norm() / gx.float().norm()) < 3e-2


def test_cuda_graph_replays_forward_and_backward():
    q, k, v = (randn((2, 512, 8, 128), "bf16", s) for s in (1, 2, 3))
    do = torch.randn(2, 512, 8, 128, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the first calls take the full path and leave plans
        for _ in range(2):
            out = ft.attention(q, k, v, causal="top_left")
            torch.autograd.grad(out, (q, k, v), do)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ft.attention(q, k, v, causal="top_left")
        grads = torch.autograd.grad(out, (q, k, v), do)
    with torch.no_grad():
        for x, seed in zip((q, k, v), (11, 12, 13)):
            x.copy_(randn(x.shape, "bf16", seed, requires_grad=False))
    graph.replay()
    torch.cuda.synchronize()
    ref_out, _, ref = reference(cp(q), cp(k), cp(v), causal="top_left", grad_out=cp(do))
    assert rel_err(cp(out), ref_out) < FWD_TOL["bf16"]
    for g, r in zip(grads, ref):
        assert rel_err(cp(g), r) < BWD_TOL["bf16"]


def test_autocast_casts_like_sdpa():
    q, k, v = (randn((1, 128, 4, 64), "f32", s) for s in (1, 2, 3))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = ft.attention(q, k, v)
        ref = torch.nn.functional.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))
    assert out.dtype == ref.dtype == torch.bfloat16
    assert float((out.float() - ref.transpose(1, 2).float()).norm() / ref.float().norm()) < FWD_TOL["bf16"]
    (dq,) = torch.autograd.grad(out.float().sum(), (q,))
    assert dq.dtype == torch.float32


@pytest.mark.parametrize("mask_kind", [None, "bool", "float", "causal", "gqa"])
def test_sdpa_drop_in_matches_torch_sdpa(mask_kind):
    H, Hk = (8, 2) if mask_kind == "gqa" else (4, 4)
    q, k, v = randn((2, H, 129, 64), "f16", 1), randn((2, Hk, 200, 64), "f16", 2), randn((2, Hk, 200, 64), "f16", 3)
    kwargs = {"enable_gqa": True} if mask_kind == "gqa" else {}
    if mask_kind == "bool":
        kwargs["attn_mask"] = torch.rand(1, 1, 129, 200, device="cuda") > 0.2
    elif mask_kind == "float":
        kwargs["attn_mask"] = torch.randn(2, 1, 129, 200, device="cuda", dtype=torch.float16)
    elif mask_kind == "causal":
        kwargs["is_causal"] = True
    out = ft.scaled_dot_product_attention(q, k, v, **kwargs)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
    assert out.shape == ref.shape
    assert float((out - ref).float().norm() / ref.float().norm()) < 2e-3
    go = torch.randn_like(ref)
    mine = torch.autograd.grad(out, (q, k, v), go)
    theirs = torch.autograd.grad(ref, (q, k, v), go)
    for a, b in zip(mine, theirs):
        assert float((a - b).float().norm() / b.float().norm()) < 1e-2
