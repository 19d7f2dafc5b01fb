"""Ring attention on real GPUs against single-GPU flashgen attention on the gathered sequence.

    torchrun --nproc-per-node 2 tests/distributed/ring_check.py [--seqlen 4096]

Every rank builds the same whole q, k, v and grad_out (one seed), runs ``ring_attention`` on
its zigzag shard (forward and backward, NCCL transfers), and all-gathers its output and
gradients; rank 0 compares them with ``flashgen.torch.attention`` on the whole sequence and
with float64 attention, for f16 and bf16, causal or not, grouped-query k/v or not (and a
causal window on 9.0 GPUs).  The bounds are the single-GPU suite's (tests/attention_reference.py,
||x - ref|| / ||ref||).  Also checks that ``deterministic=True`` repeats the same bits.
Prints one JSON line per case; exits 1 if any case is out of bounds.  tests/test_ring_gpu.py
runs it where two GPUs are present.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from attention_reference import BWD_TOL, FWD_TOL  # noqa: E402  (the single-GPU suite's bounds)

import flashgen.torch as ft  # noqa: E402
from flashgen.torch.distributed import ring_attention, zigzag_shard, zigzag_unshard  # noqa: E402

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


def whole_float64(q, k, v, grad_out, causal, window):
    """float64 attention on the whole sequence, differentiated by autograd: (out, dq, dk, dv)."""
    q, k, v = (x.double().requires_grad_() for x in (q, k, v))
    group = q.shape[2] // k.shape[2]
    s = torch.einsum("bmhk,bnhk->bhmn", q, k.repeat_interleave(group, 2)) * q.shape[-1] ** -0.5
    distance = torch.arange(s.shape[-1], device=s.device)[None, :] - torch.arange(s.shape[-2], device=s.device)[:, None]
    keep = torch.ones_like(distance, dtype=torch.bool)
    if causal:
        keep &= distance <= 0
    if window is not None and window[0] is not None:
        keep &= distance >= -window[0]
    out = torch.einsum("bhmn,bnhk->bmhk", torch.softmax(s.masked_fill(~keep, -torch.inf), -1),
                       v.repeat_interleave(group, 2))
    return (out.detach(), *torch.autograd.grad(out, (q, k, v), grad_out.double()))


def rel_err(x, ref) -> float:
    return float((x.double() - ref.double()).norm() / ref.double().norm())


def gathered(x, world):
    every = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(every, x.contiguous())
    return zigzag_unshard(every)


def ring(q_all, k_all, v_all, grad_all, rank, world, **options):
    """Gathered (out, dq, dk, dv) of ring attention over every rank's zigzag shard."""
    q, k, v = (zigzag_shard(x, rank, world).requires_grad_() for x in (q_all, k_all, v_all))
    out = ring_attention(q, k, v, **options)
    grads = torch.autograd.grad(out, (q, k, v), zigzag_shard(grad_all, rank, world))
    return [gathered(x, world) for x in (out, *grads)]


def check(case, rank, world, seqlen) -> bool:
    dtype, causal, heads, kv_heads, window = case
    g = torch.Generator(device="cuda").manual_seed(1234)  # the same whole tensors on every rank
    shapes = [(2, seqlen, heads, 128), (2, seqlen, kv_heads, 128), (2, seqlen, kv_heads, 128), (2, seqlen, heads, 128)]
    q_all, k_all, v_all, grad_all = (torch.randn(s, device="cuda", dtype=DTYPES[dtype], generator=g) for s in shapes)
    options = dict(causal=causal, window=window)
    got = ring(q_all, k_all, v_all, grad_all, rank, world, **options)
    if rank != 0:
        return True
    leaves = [x.clone().requires_grad_() for x in (q_all, k_all, v_all)]
    single_out = ft.attention(*leaves, causal="top_left" if causal else None, window=window)
    single = [single_out, *torch.autograd.grad(single_out, leaves, grad_all)]
    exact = whole_float64(q_all, k_all, v_all, grad_all, causal, window)
    bounds = [FWD_TOL[dtype]] + [BWD_TOL[dtype]] * 3
    row = {"dtype": dtype, "causal": causal, "heads": heads, "kv_heads": kv_heads, "window": window,
           "ring_vs_single": [rel_err(a, b) for a, b in zip(got, single)],
           "ring_vs_float64": [rel_err(a, b) for a, b in zip(got, exact)],
           "single_vs_float64": [rel_err(a, b) for a, b in zip(single, exact)]}
    row["ok"] = all(e < b for key in ("ring_vs_single", "ring_vs_float64") for e, b in zip(row[key], bounds))
    print(json.dumps(row), flush=True)
    return row["ok"]


def same_bits_again(rank, world, seqlen) -> bool:
    g = torch.Generator(device="cuda").manual_seed(99)
    tensors = [torch.randn(1, seqlen, 8, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]
    first = ring(*tensors, rank, world, causal=True, deterministic=True)
    again = ring(*tensors, rank, world, causal=True, deterministic=True)
    ok = all(torch.equal(a, b) for a, b in zip(first, again))
    if rank == 0:
        print(json.dumps({"deterministic_same_bits": ok}), flush=True)
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=4096, help="whole-sequence length (a multiple of 2 * world)")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    cases = [(dtype, causal, 8, kv_heads, None) for dtype in DTYPES for causal in (False, True) for kv_heads in (8, 2)]
    if torch.cuda.get_device_capability() == (9, 0):  # windows run on the sm90 kernels only
        cases.append(("bf16", True, 8, 2, (1000, None)))
    ok = all([check(case, rank, world, args.seqlen) for case in cases])
    ok = same_bits_again(rank, world, args.seqlen) and ok
    verdict = torch.tensor([0 if ok else 1], device="cuda")
    dist.all_reduce(verdict)
    dist.destroy_process_group()
    if rank == 0:
        print("ring_check:", "all cases within bounds" if verdict.item() == 0 else "FAILED", flush=True)
    return int(verdict.item() != 0)


if __name__ == "__main__":
    sys.exit(main())
