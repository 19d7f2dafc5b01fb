"""Strong scaling of ring attention: one sequence on one GPU against the same sequence split
over every rank, forward and backward, and how much of the communication is hidden.

    torchrun --nproc-per-node 2 tools/ring_bench.py [--seqlen 131072] [--heads 16] [--kv-heads 16]
             [--head-dim 128] [--dtype bf16] [--iters 10] [--warmup 3] [--json ring_bench.json]

Per direction and mask (causal and not): the median over ``--iters`` iterations (after
``--warmup``) of CUDA-event times, forward and backward timed apart:
  one_gpu   flashgen.torch.attention on the whole sequence, on rank 0 (the others wait);
  ring      ring_attention on the zigzag shards, the slowest rank's time each iteration;
  no_comm   the same with every transfer skipped (the shards never move: wrong results,
            the compute and merges alone);
  comm      the ring's transfers alone, the same tensors between the same ranks.
ratio = ring / one_gpu (the target for 2 GPUs is <= 0.55); hidden = 1 - (ring - no_comm) / comm,
the share of the transfer time that overlaps compute.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from unittest import mock

import torch
import torch.distributed as dist

import flashgen.torch as ft
from flashgen.torch import distributed as fd

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16}


def timed(step, iters, warmup):
    """Median (forward ms, backward ms) of ``step()`` -> (start, after forward, after backward) events,
    each iteration's time the slowest rank's."""
    fwd, bwd = [], []
    for i in range(warmup + iters):
        dist.barrier()
        start, mid, end = step()
        torch.cuda.synchronize()
        times = torch.tensor([start.elapsed_time(mid), mid.elapsed_time(end)], device="cuda")
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        if i >= warmup:
            fwd.append(times[0].item())
            bwd.append(times[1].item())
    return statistics.median(fwd), statistics.median(bwd)


def events():
    return [torch.cuda.Event(enable_timing=True) for _ in range(3)]


def attention_step(run, q, k, v, grad):
    """One timed forward + backward of ``run(q, k, v)``."""
    def step():
        start, mid, end = events()
        start.record()
        out = run(q, k, v)
        mid.record()
        torch.autograd.grad(out, (q, k, v), grad)
        end.record()
        return start, mid, end
    return step


def transfers_step(ring, k, v, world):
    """The ring's transfers alone: world - 1 hops of k, v (forward); in the backward, the first
    hop of k, v, then world - 2 hops of k, v with the float32 dk, dv of the shard before, and
    the last hop of dk, dv home."""
    kv_in = [torch.empty_like(x) for x in (k, v)]
    acc = [torch.empty_like(x, dtype=torch.float32) for x in (k, v)]
    acc_in = [torch.empty_like(x) for x in acc]

    def step():
        start, mid, end = events()
        start.record()
        for _ in range(world - 1):
            ring.wait(ring.exchange((k, v), kv_in, ring.mark()))
        mid.record()
        if world > 1:
            ring.wait(ring.exchange((k, v), kv_in, ring.mark()))
            for hop in range(world - 1):
                sends, recvs = ([k, v], list(kv_in)) if hop + 1 < world - 1 else ([], [])
                if hop > 0:
                    sends, recvs = sends + acc, recvs + acc_in
                ring.wait(ring.exchange(sends, recvs, ring.mark()))
            ring.wait(ring.exchange(acc, acc_in, ring.mark()))
        end.record()
        return start, mid, end
    return step


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=None, help="k/v heads (default: --heads)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json", help="write the results here (rank 0)")
    args = ap.parse_args()
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    kv_heads = args.kv_heads or args.heads
    g = torch.Generator(device="cuda").manual_seed(0)
    shapes = [(args.heads, args.head_dim), (kv_heads, args.head_dim), (kv_heads, args.head_dim),
              (args.heads, args.head_dim)]
    whole = [torch.randn(args.batch, args.seqlen, h, d, device="cuda", dtype=DTYPES[args.dtype], generator=g)
             for h, d in shapes]
    shards = [fd.zigzag_shard(x, rank, world).requires_grad_(i < 3) for i, x in enumerate(whole)]
    rows = []
    for causal in (False, True):
        row = dict(seqlen=args.seqlen, heads=args.heads, kv_heads=kv_heads, head_dim=args.head_dim,
                   batch=args.batch, dtype=args.dtype, causal=causal, world=world, device=torch.cuda.get_device_name())
        if rank == 0:
            q, k, v = (x.clone().requires_grad_() for x in whole[:3])
            one = attention_step(lambda *t: ft.attention(*t, causal="top_left" if causal else None), q, k, v,
                                 whole[3])
        else:
            one = _idle
        row["one_gpu"] = timed(one, args.iters, args.warmup)
        ring = attention_step(lambda *t: fd.ring_attention(*t, causal=causal), *shards)
        row["ring"] = timed(ring, args.iters, args.warmup)
        with mock.patch.object(fd._Ring, "exchange", lambda self, sends, recvs, after: []):
            row["no_comm"] = timed(ring, args.iters, args.warmup)
        transport = fd._Ring(None)
        transport.stream = torch.cuda.Stream()  # posted from a side stream, as the ring does
        row["comm"] = timed(transfers_step(transport, shards[1].detach(), shards[2].detach(), world),
                            args.iters, args.warmup)
        for name, direction in enumerate(("fwd", "bwd")):
            row[f"ratio_{direction}"] = row["ring"][name] / row["one_gpu"][name]
            exposed = row["ring"][name] - row["no_comm"][name]
            row[f"hidden_{direction}"] = 1 - exposed / row["comm"][name] if row["comm"][name] else None
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)
    if rank == 0:
        print("\n| mask | one GPU fwd / bwd ms | ring fwd / bwd ms | ratio fwd / bwd | comm fwd / bwd ms "
              "| hidden fwd / bwd |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {'causal' if r['causal'] else 'none'} | {r['one_gpu'][0]:.1f} / {r['one_gpu'][1]:.1f} | "
                  f"{r['ring'][0]:.1f} / {r['ring'][1]:.1f} | {r['ratio_fwd']:.3f} / {r['ratio_bwd']:.3f} | "
                  f"{r['comm'][0]:.2f} / {r['comm'][1]:.2f} | {_share(r['hidden_fwd'])} / {_share(r['hidden_bwd'])} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"results": rows}, f, indent=1)
    dist.destroy_process_group()
    return 0


def _idle():
    """A rank with nothing to time: zero-length events, so the slowest rank's time is rank 0's."""
    start, mid, end = events()
    for e in (start, mid, end):
        e.record()
    return start, mid, end


def _share(x):
    return "n/a" if x is None else f"{100 * x:.0f}%"


if __name__ == "__main__":
    sys.exit(main())
