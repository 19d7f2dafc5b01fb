"""Ring attention end to end on the CPU: four processes under torch.distributed's gloo backend
run ``flashgen.torch.distributed.ring_attention`` (its real transfers, P2P ops and autograd)
with float64 stand-ins for the kernels, over groups of 1, 2, 3 and 4 ranks, and compare the
gathered outputs and gradients with plain float64 attention on the whole sequence (torch
autograd).  What needs a GPU (streams, events, NCCL, the kernels) is in test_ring_gpu.py.
"""
from __future__ import annotations

import datetime
import itertools
import json
import socket
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("torch.distributed without gloo", allow_module_level=True)

from context_reference import block_backward, block_forward, global_mask  # noqa: E402
from flashgen.torch import distributed as fd  # noqa: E402

PROCESSES = 4
GROUPS = [(0,), (1, 3), (0, 1, 2), (0, 1, 2, 3)]  # (1, 3): group ranks that are not the global ones
SHAPES = dict(B=2, chunk=4, H=4, Hk=4, K=8, Kv=8)
CASES = {
    "full": dict(),
    "causal": dict(causal=True),
    "causal-contiguous": dict(causal=True, layout="contiguous"),
    "gqa-odd-dims": dict(causal=True, H=8, Hk=2, K=5, Kv=3),
    "gqa-full-contiguous": dict(H=8, Hk=2, K=5, Kv=3, layout="contiguous"),
    "causal-window": dict(causal=True, window=(5, None)),
    "window-softcap-scale": dict(window=(4, 6), softcap=1.5, scale=0.4, layout="contiguous"),
    # the backward's own shard in two halves by k/v heads (above), by batch, or whole
    "one-kv-head": dict(causal=True, H=4, Hk=1),
    "one-kv-head-one-sequence": dict(causal=True, B=1, H=4, Hk=1),
}


def _numpy_kernel(function):
    """A NumPy stand-in as a block kernel on CPU tensors."""
    def kernel(*tensors, **options):
        arrays = [t.detach().numpy() for t in tensors]
        return tuple(torch.from_numpy(np.ascontiguousarray(x)) for x in function(*arrays, **options))
    return kernel


REFERENCE = fd.Kernels(_numpy_kernel(block_forward), _numpy_kernel(block_backward), "cpu")


def whole_attention(q, k, v, causal=False, window=None, scale=None, softcap=0.0):
    """Plain float64 attention over global positions, differentiated by torch's autograd."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bmhk,bnhk->bhmn", q, k) * (q.shape[-1] ** -0.5 if scale is None else scale)
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    keep = torch.from_numpy(global_mask(np.arange(q.shape[1]), np.arange(k.shape[1]), causal, window))
    return torch.einsum("bhmn,bnhk->bmhk", torch.softmax(s.masked_fill(~keep, -torch.inf), -1), v)


def _inputs(case, world, seed):
    g = torch.Generator().manual_seed(seed)
    S = 2 * world * case["chunk"]
    shapes = [(case["B"], S, case["H"], case["K"]), (case["B"], S, case["Hk"], case["K"]),
              (case["B"], S, case["Hk"], case["Kv"]), (case["B"], S, case["H"], case["Kv"])]
    return [torch.randn(shape, generator=g, dtype=torch.float64) for shape in shapes]


def _shard(x, rank, world, layout):
    return fd.zigzag_shard(x, rank, world) if layout == "zigzag" else x.chunk(world, 1)[rank].clone()


def _gather(x, group, world):
    every = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(every, x.contiguous(), group=group)
    return every


def _ring(case, group, seed):
    """This rank's ring run of ``case``: the gathered (out, dq, dk, dv) and the whole-sequence
    reference's."""
    world, rank, layout = dist.get_world_size(group), dist.get_rank(group), case.get("layout", "zigzag")
    q_all, k_all, v_all, grad_all = _inputs(case, world, seed)
    options = {name: case[name] for name in ("causal", "window", "scale", "softcap") if name in case}
    q, k, v = (_shard(x, rank, world, layout).requires_grad_() for x in (q_all, k_all, v_all))
    out = fd.ring_attention(q, k, v, group, layout=layout, **options)
    out.backward(_shard(grad_all, rank, world, layout))
    unshard = fd.zigzag_unshard if layout == "zigzag" else lambda xs: torch.cat(xs, 1)
    got = [unshard(_gather(x, group, world)) for x in (out.detach(), q.grad, k.grad, v.grad)]
    leaves = [x.clone().requires_grad_() for x in (q_all, k_all, v_all)]
    want_out = whole_attention(*leaves, **options)
    want_out.backward(grad_all)
    return got, [want_out.detach()] + [x.grad for x in leaves]


def _errors(case, group, seed):
    got, want = _ring(case, group, seed)
    return [float((a - b).abs().max() / b.abs().max()) for a, b in zip(got, want)]


def _error_paths(rank):
    """Inputs one or every rank gets wrong: every rank must raise (no hang), each its message."""
    found = {}
    q = torch.zeros(1, 8, 2, 4, dtype=torch.float64)
    odd = q[:, :6] if rank == 3 else q
    calls = {"shapes-differ": lambda: fd.ring_attention(odd, odd, odd),
             "odd-zigzag-shard": lambda: fd.ring_attention(q[:, :5], q[:, :5], q[:, :5]),
             "bad-window-on-rank-0": lambda: fd.ring_attention(q, q, q, window=(-1, 2) if rank == 0 else None),
             "options-differ": lambda: fd.ring_attention(q, q, q, causal=rank == 1),
             "meta-tensors": lambda: fd.ring_attention(q.to("meta"), q.to("meta"), q.to("meta"))}
    for name, call in calls.items():
        try:
            call()
            found[name] = "no error"
        except (TypeError, ValueError) as e:
            found[name] = f"{type(e).__name__}: {e}"
    return found


def _worker(rank, port, directory):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=PROCESSES,
                            timeout=datetime.timedelta(seconds=30))
    fd.KERNELS = REFERENCE
    groups = {members: dist.new_group(list(members)) for members in GROUPS}  # every rank, in one order
    results = {}
    for (name, case), members in itertools.product(CASES.items(), GROUPS):
        if rank in members:
            results[f"{name}/{len(members)}"] = _errors({**SHAPES, **case}, groups[members], seed=len(members))
    if rank in (0, 1, 2):  # determinism: the same call again gives the same bits
        first, _ = _ring({**SHAPES, **CASES["gqa-odd-dims"]}, groups[(0, 1, 2)], seed=7)
        again, _ = _ring({**SHAPES, **CASES["gqa-odd-dims"]}, groups[(0, 1, 2)], seed=7)
        results["repeat-same-bits"] = all(torch.equal(a, b) for a, b in zip(first, again))
    if rank == 0:  # one rank: the plain block kernel's results, bit for bit
        results["world-1-is-plain-attention"] = _world_of_one(groups[(0,)])
    results["errors"] = _error_paths(rank)
    with open(f"{directory}/rank{rank}.json", "w") as f:
        json.dump(results, f)
    dist.destroy_process_group()


def _world_of_one(group) -> bool:
    q_all, k_all, v_all, grad = _inputs({**SHAPES, "H": 8, "Hk": 2}, 1, seed=5)
    q, k, v = (x.clone().requires_grad_() for x in (q_all, k_all, v_all))
    out, lse = fd.ring_attention(q, k, v, group, causal=True, return_lse=True)
    out.backward(grad)
    want_out, want_lse = REFERENCE.forward(q_all, k_all, v_all, causal="top_left")
    want_grads = REFERENCE.backward(grad, q_all, k_all, v_all, want_out, want_lse, causal="top_left")
    return all(torch.equal(a, b) for a, b in zip((out, lse, q.grad, k.grad, v.grad), (want_out, want_lse,
                                                                                        *want_grads)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """The four processes' results, one dict per rank.  Forked (no second import of torch), unless
    this process has run CUDA work: autograd's device threads then make a forked backward fail
    (the whole suite on a GPU machine), and the ranks start afresh instead."""
    directory = tmp_path_factory.mktemp("ring")
    start = "spawn" if torch.cuda.is_available() and torch.cuda.is_initialized() else "fork"
    processes = torch.multiprocessing.start_processes(_worker, args=(_free_port(), str(directory)),
                                                      nprocs=PROCESSES, join=False, start_method=start)
    deadline = time.monotonic() + 180  # a ring that waits forever (a receive nobody sends) fails, not hangs
    while not processes.join(timeout=2):
        if time.monotonic() > deadline:
            for process in processes.processes:
                process.kill()
            pytest.fail("the ring's processes did not finish in 180 s: a transfer waits for one never sent")
    return [json.loads((directory / f"rank{r}.json").read_text()) for r in range(PROCESSES)]


@pytest.mark.parametrize("world", [len(g) for g in GROUPS])
@pytest.mark.parametrize("case", CASES)
def test_ring_equals_whole_attention(ranks, case, world):
    """out, dq, dk and dv of every rank, gathered, against float64 attention on the whole sequence."""
    members = next(g for g in GROUPS if len(g) == world)
    for rank in members:
        errors = ranks[rank][f"{case}/{world}"]
        assert max(errors) < 1e-12, dict(zip(("out", "dq", "dk", "dv"), errors))


def test_repeated_calls_give_the_same_bits(ranks):
    assert all(ranks[r]["repeat-same-bits"] for r in (0, 1, 2))


def test_a_group_of_one_is_plain_attention(ranks):
    assert ranks[0]["world-1-is-plain-attention"]


@pytest.mark.parametrize("name,own,others", [
    ("shapes-differ", "ValueError: ring_attention: rank(s) [3] passed other shapes", None),
    ("odd-zigzag-shard", "ValueError: a zigzag shard is two equal chunks", None),
    ("bad-window-on-rank-0", "ValueError: window sides must be", "ValueError: ring_attention: rank(s) [0] of the group "
                                                             "rejected their inputs"),
    ("options-differ", "ValueError: ring_attention: rank(s) [1] passed other", None),
    ("meta-tensors", "TypeError: q is on meta: ring_attention takes cpu tensors", None)])
def test_bad_inputs_raise_on_every_rank(ranks, name, own, others):
    for rank in range(PROCESSES):
        message = ranks[rank]["errors"][name]
        assert message.startswith(own if rank == 0 or others is None else others), (rank, message)


def test_zigzag_shards_round_trip():
    x = torch.arange(2 * 3 * 12 * 5).reshape(2, 3, 12, 5)
    shards = [fd.zigzag_shard(x, r, 3, dim=2) for r in range(3)]
    assert (shards[1][0, 0, :, 0] // 5).tolist() == [2, 3, 8, 9]  # positions: chunks 1 and 4 of 6
    assert torch.equal(fd.zigzag_unshard(shards, dim=2), x)
    with pytest.raises(ValueError, match="multiple of 8"):
        fd.zigzag_shard(x, 0, 4, dim=2)


def test_without_a_process_group():
    q = torch.zeros(1, 4, 1, 8)
    with pytest.raises(ValueError, match="init_process_group"):
        fd.ring_attention(q, q, q)
