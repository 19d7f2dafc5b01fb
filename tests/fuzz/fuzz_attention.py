"""Differential fuzzer: random valid attention problems against the float64 reference.

    FLASHGEN_KERNEL_PATH=build/kernels python tests/fuzz/fuzz_attention.py --seed 1 --cases 1000
    FLASHGEN_KERNEL_PATH=build/kernels python tests/fuzz/fuzz_attention.py --seed 1 --case 417
    FLASHGEN_KERNEL_PATH=build/kernels python tests/fuzz/fuzz_attention.py \
        --families sm80_fwd,sm80_bwd,mem_eff_fwd,mem_eff_bwd
    FLASHGEN_KERNEL_PATH=build/kernels python tests/fuzz/fuzz_attention.py --seed 1 --torch

``--families`` sets FLASHGEN_FAMILIES (the families dispatch may ask), so one family can be
fuzzed where an earlier one would serve the calls: the Ampere forward and backward (sm80_fwd,
sm80_bwd) on an H100/H200, say, with example 41 taking what they refuse.  A case none of them
serves (bias with soft-capping and its gradient, say: only sm90_bwd has them together) is counted
apart in the summary and checked with every family allowed.  ``--forward-only``
skips the backward, for a family list without a backward that has sliding windows and
soft-capping (sm90_bwd on 9.0 GPUs, sm80_bwd from 8.0 on).

Each case is drawn from its own generator seeded with (seed, case), so the
one-line reproducer printed for a failure reruns exactly that problem.  The
space: dtype, batch, heads, M, N (1 to 1000), head dims (multiples of 4 up to
512, K != Kv), layouts (contiguous, heads-major, padded slices, element offsets
that leave only 4-element alignment), causal kinds, bias (full or broadcast over any of B, H, M),
dropout (checked through the mask recovered with an identity V, or, where one of flashgen's pairs
draws it -- sm90, or sm80 when built or forced with ``--families`` -- through the NumPy copy of
their rule, tests/philox_reference.py), varlen
batches with empty sequences, the softmax scale (of either sign), grouped-query k/v (2, 4 or 8 query
heads a k/v head; fixed-length calls without dropout), and on flashgen's own
kernels' path (sm90, sm80) sliding windows, soft-capping and bias (the sm90 and sm80 bias
instances, head dims up to 128: a forced sm80 run puts them on sm80_fwd/sm80_bwd), and block masks (documents, causal + window, random blocks with empty
rows, all full; 128 x 128 blocks, which sm90_fwd's and sm90_bwd's sparse instances read, or others,
served dense; a causal mask or window beside them folded into their lists), and on a 9.0 GPU the sm90
ALiBi instances (``score_mod="alibi"``, checked as the additive bias -slope[h] * |i - j|; drawn only
there and where the kernel path holds them -- an sm90a build, not a plain one -- so a reproducer
redraws the same case on the same kind of GPU and build).  Outputs come from poisoned
memory, so an unwritten element fails.  A quarter of the cases make two earlier calls with the same
shapes on other data first, so that the checked call replays the launch plan they left (a stale
pointer or size in a plan reads the earlier call's data); half the packed ones pass their offsets as
``flashgen.packed_offsets``, whose calls take plans keyed by the offsets' contents.  ``--torch`` sends
every call through flashgen.torch instead (tests/fuzz/torch_path.py: autograd for the gradients, packed
cases through ``attention_varlen`` with lse rows past the longest sequence, outputs from torch's
allocator filled with NaN first).

A gradient passes if it matches the exact float64 gradient, or the exact
gradient of the kernel's own rounded output: every flash-style backward takes
delta = rowsum(dO * O) from the O it is given, and with a peaked softmax (one
query, large scale, bf16) the rounding of O dominates dP - delta in dQ, dK and
dbias.  Where dP - delta cancels outright (one query seeing two keys, say) dQ,
dK and dbias are measured against the size of their sums' terms instead
(``rel_err_to_summands``), the scale their rounding error has.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the shared reference

import cupy  # noqa: E402
from attention_reference import (  # noqa: E402
    BIAS_BROADCASTS, BWD_TOL, FWD_TOL, fold_like_bias, lse_err, make_bias, poisoned_allocations, randn,
    recover_keep_mask, reference, rel_err, rel_err_to_summands,
)

import flashgen  # noqa: E402

FORWARD_ONLY = False  # --forward-only: no backward call, out and lse checked
TORCH = False  # --torch: the calls go through flashgen.torch (tests/fuzz/torch_path.py)
ALIBI_RUNS = False  # GPU 0 is a 9.0 part and the kernel path holds sm90 ALiBi instances (set in main)
SM90_BWD_RUNS = False  # GPU 0 is a 9.0 part and the kernel path holds sm90_bwd kernels (set in main)
BIAS_PATTERNS = tuple(b or "full" for b in BIAS_BROADCASTS)  # the dims a drawn bias broadcasts ("full": none)


def draw(seed: int, case: int) -> dict:
    r = np.random.default_rng([seed, case])
    pick = lambda xs: xs[int(r.integers(len(xs)))]  # noqa: E731
    size = lambda: int(pick([1, 7, 129, int(r.integers(1, 300)), int(r.integers(1, 300)), int(r.integers(300, 1001))]))  # noqa: E731
    head = lambda: int(pick([4 * int(r.integers(1, 33)), 64, 128, 160, 256, 320, 4 * int(r.integers(65, 129))]))  # noqa: E731
    p = dict(dtype=pick(["f32", "f16", "bf16"]), B=int(r.integers(1, 4)), H=int(r.integers(1, 5)), M=size(),
             N=size(), K=head(), layout=pick(["contiguous", "contiguous", "bhsk", "padded", "offset"]),
             causal=pick([None, None, "top_left", "bottom_right"]), bias=None, dropout=0.0, varlen=None,
             scale=None if r.random() < 0.7 else float(r.uniform(0.02, 0.5)))
    p["Kv"] = p["K"] if r.random() < 0.7 else head()
    kind = r.random()
    if kind < 0.2:  # varlen: B = 1, sequences packed along dim 1, some of them empty
        lens = [(int(r.integers(0, 200)), int(r.integers(0, 200))) for _ in range(int(r.integers(1, 5)))]
        if p["causal"] == "bottom_right":
            lens = [(min(m, n), n) for m, n in lens]  # the kernels' diagonal offset is unsigned
        p.update(B=1, varlen=lens, layout="contiguous")
    elif kind < 0.35:
        p["bias"] = pick(BIAS_PATTERNS)
    elif kind < 0.5:  # dropout, checked through the recovered mask: keep N small enough for V = I
        p.update(dropout=float(r.uniform(0.05, 0.6)), N=int(r.integers(1, 129)), causal=None, scale=None,
                 seed=int(r.integers(2**40)))
        p["Kv"] = p["K"] = min(p["K"], 256)
        if r.random() < 0.5:  # what the sm90 / sm80 dropout instances take (recover_keep_mask: their rule)
            p.update(dtype=pick(["f16", "bf16"]), K=int(pick([64, 96, 128, 8 * int(r.integers(1, 17))])))
            p["Kv"] = p["K"]
    p["deterministic"] = bool(r.random() < 0.3)  # drawn last: earlier draws stay what they were
    p.update(window=None, softcap=0.0)
    # the options only flashgen's own kernels have (sm90_fwd/bwd, sm80_fwd/bwd): f16/bf16, K = Kv <= 256 (every
    # tier, 64 to 256, and multiples of 8 between), 16-byte-aligned strides (packed batches too)
    if (kind >= 0.5 or kind < 0.2) and r.random() < 0.4:
        p.update(dtype=pick(["f16", "bf16"]), K=int(pick([64, 96, 128, 160, 192, 256, 8 * int(r.integers(1, 33))])))
        if not p["varlen"]:
            p["layout"] = pick(["contiguous", "bhsk", "padded"])
        p["Kv"] = p["K"]
        side = lambda: None if r.random() < 0.25 else int(pick([0, 1, int(r.integers(0, 300))]))  # noqa: E731
        p["window"] = (side(), side()) if r.random() < 0.7 else None
        p["softcap"] = float(r.uniform(1, 50)) if r.random() < 0.4 else 0.0
        # the sm90 and sm80 bias instances, head dims up to 128 (drawn last: the rest stays)
        if not p["varlen"] and r.random() < 0.3 and p["K"] <= 128:
            p["bias"] = pick(BIAS_PATTERNS)
            if not SM90_BWD_RUNS:  # only sm90_bwd writes dbias beside soft-capping (no draw: the rest stays)
                p["softcap"] = 0.0
    if p["scale"] is not None and r.random() < 0.3:  # drawn after the rest, which stays what it was
        p["scale"] = -p["scale"]  # the largest product becomes the smallest score
    p["block_mask"] = None
    if not p["varlen"] and not p["dropout"] and r.random() < 0.25:  # drawn last; no soft-capping beside a mask
        p.update(softcap=0.0, block_mask=pick(["documents", "causal-window", "random", "full"]),
                 block=pick([(128, 128), (128, 128), (64, 128), (32, 64)]), mask_seed=int(r.integers(2**31)),
                 mask_bh=pick([(1, 1), (p["B"], 1), (1, p["H"]), (p["B"], p["H"])]))
        if r.random() < 0.5:  # causal and a window fold into the mask's lists; half keep the window drawn
            p["window"] = None
        if r.random() < 0.5:  # drawn after the mask: half its calls are ones sm90's sparse kernels take
            p.update(bias=None, deterministic=False)
    own = p["dtype"] != "f32" and p["K"] == p["Kv"] and p["K"] <= 128 and p["K"] % 8 == 0 and p["layout"] != "offset"
    p["alibi"] = bool(ALIBI_RUNS and own and not (p["varlen"] or p["dropout"] or p["block_mask"])
                      and r.random() < 0.3)  # drawn last
    if p["alibi"]:  # the score mod's calls take no bias or soft-capping, nor bottom-right rows without keys
        p.update(bias=None, softcap=0.0)
        if p["causal"] == "bottom_right" and p["M"] > p["N"]:
            p["causal"] = "top_left"
    # drawn last: the checked call as the third of its kind (a launch plan's replay), and packed offsets
    # given as a PackedOffsets (whose calls plan; an array's read every call do not)
    p["calls"] = 3 if r.random() < 0.25 else 1
    p["packed_offsets"] = bool(p["varlen"] and r.random() < 0.5)
    p["lse_extra"] = int(pick([0, 0, 1, 31, 100])) if p["varlen"] else 0  # --torch: max_seqlen_q past the longest
    # drawn last: grouped-query k/v, the H drawn above as k/v heads and group times as many query heads
    # (fixed-length calls without dropout, whose keep mask is recovered per head)
    group = int(pick([1, 1, 1, 2, 4, 8]))
    p["group"] = 1 if p["varlen"] or p["dropout"] else group
    if p["block_mask"] and p["mask_bh"][1] == p["H"] > 1:  # a mask per head: per query head
        p["mask_bh"] = (p["mask_bh"][0], p["H"] * p["group"])
    p["H"] *= p["group"]
    return p


def alibi(H, M, N):
    """ALiBi's slopes (2^(-8 i / H)) and the same mod as the additive float32 bias [1, H, M, N]."""
    slope = cupy.asarray([2.0 ** (-8.0 * (i + 1) / H) for i in range(H)], dtype=cupy.float32)
    distance = cupy.abs(cupy.arange(M)[:, None] - cupy.arange(N)[None, :]).astype(cupy.float32)
    return slope, -slope[None, :, None, None] * distance


def make_block_mask(p):
    """The drawn block mask: a flashgen.block_mask over the case's [B or 1, H or 1, M, N]."""
    r = np.random.default_rng(p["mask_seed"])
    (mb, mh), M, N = p["mask_bh"], p["M"], p["N"]
    if p["block_mask"] == "documents":  # 8 documents over the longer of the two
        doc = cupy.asarray(np.sort(r.integers(0, 8, size=max(M, N))))
        fn = lambda b, h, q, kv: doc[q] == doc[kv]  # noqa: E731
    elif p["block_mask"] == "causal-window":
        width = int(r.integers(1, 400))
        fn = lambda b, h, q, kv: (kv <= q) & (kv > q - width)  # noqa: E731
    elif p["block_mask"] == "random":  # blocks hidden, full or partial at random; some rows without keys
        bm, bn = p["block"]
        kind = r.integers(0, 3, size=(mb, mh, -(-M // bm), -(-N // bn)))
        blocks = np.repeat(np.repeat(kind, bm, axis=2), bn, axis=3)[:, :, :M, :N]
        visible = (blocks == 1) | ((blocks == 2) & (r.random(blocks.shape) < 0.3))
        visible[:, :, ::int(r.integers(2, 9))] = False
        fn = cupy.asarray(visible)
    else:
        fn = lambda b, h, q, kv: (q >= 0) & (kv >= 0)  # noqa: E731
    return flashgen.block_mask(fn, mb, mh, M, N, block=p["block"])


def make(r, shape, dtype, layout):
    B, S, H, K = shape
    if layout == "bhsk":
        return randn(r, (B, H, S, K), dtype).transpose(0, 2, 1, 3)
    if layout == "padded":
        return randn(r, (B, S + 2, H + 1, K + 8), dtype)[:, 1:S + 1, 1:, :K]
    if layout == "offset":  # 4 elements into a flat buffer: only 4-element alignment survives
        flat = randn(r, (B * S * H * K + 4,), dtype)
        return flat[4:].reshape(B, S, H, K)
    return randn(r, shape, dtype)


def run_case(seed: int, case: int) -> dict:
    p = draw(seed, case)
    # the same calls on other data, unchecked, so that the checked one replays their plan; their arrays stay
    # alive until it is done (freed, their memory could hold the checked call's, and a stale pointer pass)
    shared = {}  # what the case's calls share: --torch's offsets tensors
    earlier = [call_case(p, np.random.default_rng([seed, case, 2, call]), shared, check=False)
               for call in range(p["calls"] - 1)]
    result = call_case(p, np.random.default_rng([seed, case, 1]), shared, check=True)
    del earlier
    return result


def call_case(p: dict, r: np.random.Generator, shared: dict, check: bool):
    """The case's forward and backward on inputs drawn from ``r``; with ``check``, their errors against
    the float64 reference ({"params", "errors"}), else the arrays the calls took and made."""
    dt, tol_f, tol_b = p["dtype"], FWD_TOL[p["dtype"]], BWD_TOL[p["dtype"]]
    errors = {}
    if p["varlen"]:
        cu_q = np.concatenate([[0], np.cumsum([m for m, _ in p["varlen"]])]).astype(np.int32)
        cu_k = np.concatenate([[0], np.cumsum([n for _, n in p["varlen"]])]).astype(np.int32)
        q, k = randn(r, (1, int(cu_q[-1]), p["H"], p["K"]), dt), randn(r, (1, int(cu_k[-1]), p["H"], p["K"]), dt)
        v, do = randn(r, (1, int(cu_k[-1]), p["H"], p["Kv"]), dt), randn(r, (1, int(cu_q[-1]), p["H"], p["Kv"]), dt)
        offsets = flashgen.packed_offsets if p["packed_offsets"] else (lambda cu: cu)
        opts = dict(causal=p["causal"], scale=p["scale"], cu_seqlens_q=offsets(cu_q), cu_seqlens_k=offsets(cu_k),
                    window=p["window"], softcap=p["softcap"])
        with poisoned_allocations():
            if TORCH:
                if "offsets" not in shared:  # one pair for the case's calls: the later ones find them read
                    shared["offsets"] = torch_path.offsets(cu_q, cu_k)
                out, lse, grads = torch_path.calls(p, q, k, v, do, opts, shared["offsets"], FORWARD_ONLY)
                dq, dk, dv = grads or (None, None, None)
            else:
                out, lse = flashgen.attention_forward(q, k, v, **opts)
                dq = dk = dv = None
                if not FORWARD_ONLY:
                    dq, dk, dv = flashgen.attention_backward(do, q, k, v, out, lse, deterministic=p["deterministic"],
                                                             **opts)
        if not check:
            return q, k, v, do, opts, out, lse, dq, dk, dv
        for s, (m, n) in enumerate(p["varlen"]):
            qs, ks = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
            if m == 0:
                continue
            if n == 0:  # queries without keys: output 0, lse -inf, no gradient (documented)
                ok = bool((out[:, qs] == 0).all() and cupy.isneginf(lse[s, :, :m]).all())
                ok = ok and (FORWARD_ONLY or bool((dq[:, qs] == 0).all()))
                errors[f"empty[{s}]"] = (0.0 if ok else float("inf"), 1.0)
                continue
            seq_opts = dict(causal=p["causal"], scale=p["scale"], grad_out=do[:, qs], window=p["window"],
                            softcap=p["softcap"])
            ro, rl, (rdq, rdk, rdv, _) = reference(q[:, qs], k[:, ks], v[:, ks], **seq_opts)
            errors[f"lse[{s}]"] = (lse_err(lse[s:s + 1, :, :m], rl), tol_f)
            if FORWARD_ONLY:
                errors[f"out[{s}]"] = (rel_err(out[:, qs], ro, zero_scale=p["Kv"] ** 0.5), tol_f)
                continue
            for name, x, ref, tol in (("out", out[:, qs], ro, tol_f), ("dq", dq[:, qs], rdq, tol_b),
                                      ("dk", dk[:, ks], rdk, tol_b), ("dv", dv[:, ks], rdv, tol_b)):
                errors[f"{name}[{s}]"] = (rel_err(x, ref, zero_scale=p["Kv"] ** 0.5), tol)
            if any(not errors[f"{n}[{s}]"][0] < tol_b for n in ("dq", "dk")):  # see the module docstring
                _, _, given = reference(q[:, qs], k[:, ks], v[:, ks], out_for_delta=out[:, qs], **seq_opts)
                _, _, sizes = reference(q[:, qs], k[:, ks], v[:, ks], out_for_delta=out[:, qs], summand_sizes=True,
                                        **seq_opts)
                for name, x, j in (("dq", dq[:, qs], 0), ("dk", dk[:, ks], 1)):
                    errors[f"{name}[{s}]"] = (min(errors[f"{name}[{s}]"][0],
                                                  rel_err(x, given[j], zero_scale=p["Kv"] ** 0.5),
                                                  rel_err_to_summands(x, given[j], sizes[j])), tol_b)
        return {"params": p, "errors": errors}
    B, M, N, H = p["B"], p["M"], p["N"], p["H"]
    Hk = H // p["group"]  # k/v heads (the reference repeats them per query head)
    q, k = make(r, (B, M, H, p["K"]), dt, p["layout"]), make(r, (B, N, Hk, p["K"]), dt, p["layout"])
    v, do = make(r, (B, N, Hk, p["Kv"]), dt, p["layout"]), randn(r, (B, M, H, p["Kv"]), dt)
    bias = None
    if p["bias"]:
        bias = make_bias(r, dt, B, H, M, N, "" if p["bias"] == "full" else p["bias"], scale=1.0)
    opts = dict(causal=p["causal"], scale=p["scale"], attn_bias=bias, window=p["window"], softcap=p["softcap"])
    if p["block_mask"]:  # the reference sees it as the dense additive mask, plus the bias if any
        opts["block_mask"] = make_block_mask(p)
        dense = opts["block_mask"].to_dense(cupy.float32)
        bias = dense if bias is None else dense + bias.astype(cupy.float32)
    if p.get("alibi"):
        slope, bias = alibi(H, M, N)
        opts.update(score_mod="alibi", mod_tensors={"slope": slope})
    keep = None
    if p["dropout"]:
        opts.update(dropout_p=p["dropout"], seed=p["seed"])
        if check:  # the rule where a pair draws
            keep = recover_keep_mask(q, k, p["dropout"], p["seed"], v=v, causal=p["causal"])
    with poisoned_allocations():
        if TORCH:
            out, lse, grads = torch_path.calls(p, q, k, v, do, opts, None, FORWARD_ONLY)
        else:
            out, lse = flashgen.attention_forward(q, k, v, **opts)
        if FORWARD_ONLY and not check:
            return q, k, v, do, opts, out, lse
        if FORWARD_ONLY:
            ro, rl = reference(q, k, v, bias=bias, causal=p["causal"], scale=p["scale"], keep=keep, p=p["dropout"],
                               window=p["window"], softcap=p["softcap"])
            errors.update(out=(rel_err(out, ro), tol_f), lse=(lse_err(lse, rl), tol_f))
            return {"params": p, "errors": errors}
        if not TORCH:
            grads = flashgen.attention_backward(do, q, k, v, out, lse,
                                                bias_requires_grad=opts["attn_bias"] is not None,
                                                deterministic=p["deterministic"], **opts)
    if not check:
        return q, k, v, do, opts, out, lse, grads

    def user_bias_grads(grads):
        """The reference's gradients with dbias that of the caller's bias (the reference took the mask
        with it, which may not broadcast where the bias does): summed where the bias broadcasts (through
        flashgen.torch, autograd's gradient has the bias's own shape: its query rows summed too)."""
        if opts["attn_bias"] is None:
            return grads
        return grads[:3] + (fold_like_bias(grads[3], opts["attn_bias"], rows=TORCH),)

    ro, rl, rgrads = reference(q, k, v, bias=bias, causal=p["causal"], scale=p["scale"], keep=keep,
                               p=p["dropout"], grad_out=do, window=p["window"], softcap=p["softcap"])
    rgrads = user_bias_grads(rgrads)
    checks = [("out", rel_err, out, ro, tol_f), ("lse", lse_err, lse, rl, tol_f)]
    checks += [(n, rel_err, g, ref, tol_b) for n, g, ref in zip(("dq", "dk", "dv", "dbias"), grads, rgrads)
               if n != "dbias" or opts["attn_bias"] is not None]
    for name, measure, x, ref, tol in checks:
        try:
            extra = {"zero_scale": p["Kv"] ** 0.5} if name in ("dq", "dk") else {}
            errors[name] = (measure(x, ref, **extra), tol)
        except AssertionError as e:  # NaN: an element was not written
            raise AssertionError(f"{name}: {e}") from None
    sensitive = [n for n in ("dq", "dk", "dbias") if n in errors]  # the ones dP - delta enters (dbias = dS)
    if any(not errors[n][0] < tol_b for n in sensitive):
        _, _, given = reference(q, k, v, bias=bias, causal=p["causal"], scale=p["scale"], keep=keep, p=p["dropout"],
                                grad_out=do, window=p["window"], softcap=p["softcap"], out_for_delta=out)
        given = user_bias_grads(given)
        for name, g, ref in zip(("dq", "dk", "dv", "dbias"), grads, given):
            if name in sensitive:
                extra = {"zero_scale": p["Kv"] ** 0.5} if name != "dbias" else {}
                errors[name] = (min(errors[name][0], rel_err(g, ref, **extra)), tol_b)
        if any(not errors[n][0] < tol_b for n in sensitive):
            _, _, sizes = reference(q, k, v, bias=bias, causal=p["causal"], scale=p["scale"], keep=keep,
                                    p=p["dropout"], grad_out=do, window=p["window"], softcap=p["softcap"],
                                    out_for_delta=out, summand_sizes=True)
            sizes = user_bias_grads(sizes)
            for name, g, ref, size in zip(("dq", "dk", "dv", "dbias"), grads, given, sizes):
                if name in sensitive:
                    errors[name] = (min(errors[name][0], rel_err_to_summands(g, ref, size)), tol_b)
    return {"params": p, "errors": errors}


def run_unforced(seed: int, case: int) -> dict:
    """run_case with every family allowed: for a case that the families --families names cannot serve."""
    forced = os.environ.pop("FLASHGEN_FAMILIES")
    try:
        return run_case(seed, case)
    finally:
        os.environ["FLASHGEN_FAMILIES"] = forced


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=1000)
    ap.add_argument("--case", type=int, default=None, help="run only this case (a reproducer)")
    ap.add_argument("--json", type=Path, default=None, help="write per-case results here")
    ap.add_argument("--families", default=None,
                    help="comma-separated families dispatch may ask (sets FLASHGEN_FAMILIES), e.g. "
                         "sm80_fwd,sm80_bwd,mem_eff_fwd,mem_eff_bwd")
    ap.add_argument("--forward-only", action="store_true", help="check the forward only (out and lse)")
    ap.add_argument("--torch", action="store_true",
                    help="call through flashgen.torch (autograd for the gradients), the path torch users take")
    args = ap.parse_args(argv)
    global FORWARD_ONLY, ALIBI_RUNS, SM90_BWD_RUNS, TORCH, torch_path
    FORWARD_ONLY, TORCH = args.forward_only, args.torch
    if TORCH:
        import torch_path  # tests/fuzz/ is on the path as the script's own directory
    from flashgen.runtime.device import device_info

    from flashgen.runtime.registry import default_registry

    hopper, specs = device_info(0).cc == 90, [b.spec for b in default_registry().binaries.values()]
    ALIBI_RUNS = hopper and any(getattr(s, "score_mod", "") == "alibi" for s in specs)
    SM90_BWD_RUNS = hopper and any(s.FAMILY == "sm90_bwd" for s in specs)
    if args.families is not None:
        os.environ["FLASHGEN_FAMILIES"] = args.families
    cases = [args.case] if args.case is not None else range(args.cases)
    extra = (f" --families {args.families}" if args.families is not None else "") + \
        (" --forward-only" if args.forward_only else "") + (" --torch" if args.torch else "")
    start, ran, mismatches, cuda_errors, results, worst = time.monotonic(), 0, 0, 0, [], {}
    outside = 0  # cases no forced family serves (only with --families)
    for case in cases:
        ran += 1
        reproduce = f"python tests/fuzz/fuzz_attention.py --seed {args.seed} --case {case}{extra}"
        try:
            try:
                result = run_case(args.seed, case)
            except flashgen.UnsupportedError as e:
                if args.families is None:
                    raise
                # a feature the forced families lack: counted apart, and the case still checked unforced
                result = run_unforced(args.seed, case)
                outside += 1
                print(f"OUTSIDE case {case}: {str(e).splitlines()[1].strip()}; reproduce: {reproduce}", flush=True)
        except (cupy.cuda.runtime.CUDARuntimeError, cupy.cuda.driver.CUDADriverError) as e:  # context gone: stop
            cuda_errors += 1
            print(f"CUDA ERROR case {case}: {e}; params {draw(args.seed, case)}; reproduce: {reproduce}", flush=True)
            break
        except Exception as e:  # a valid problem must never be refused or crash
            mismatches += 1
            print(f"ERROR case {case}: {type(e).__name__}: {e}; params {draw(args.seed, case)}; "
                  f"reproduce: {reproduce}", flush=True)
            continue
        bad = {n: e for n, (e, tol) in result["errors"].items() if not e < tol}  # NaN fails too
        for n, (e, _) in result["errors"].items():
            key = (result["params"]["dtype"], n.split("[")[0])
            worst[key] = max(worst.get(key, 0.0), e)
        if bad:
            mismatches += 1
            print(f"MISMATCH case {case}: {bad}; params {result['params']}; reproduce: {reproduce}", flush=True)
        results.append({"case": case, **result})
    cupy.cuda.runtime.deviceSynchronize()
    summary = (f"fuzz: {ran} cases, {mismatches} mismatches, {cuda_errors} CUDA errors "
               + (f"({outside} outside the forced families, checked unforced) " if args.families else "")
               + ("through flashgen.torch " if args.torch else "")
               + f"(seed {args.seed}, {time.monotonic() - start:.0f} s)")
    print("worst relative errors: " + ", ".join(f"{d}/{n} {e:.1e}" for (d, n), e in sorted(worst.items())))
    print(summary)
    if args.json:
        args.json.write_text(json.dumps({"summary": summary, "cases": results}, default=str))
    return 1 if mismatches or cuda_errors else 0


if __name__ == "__main__":
    sys.exit(main())
