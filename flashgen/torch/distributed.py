"""Context parallelism: ring attention over a sequence split across the ranks of a process group.

    import torch.distributed as dist
    from flashgen.torch.distributed import ring_attention, zigzag_shard, zigzag_unshard
    dist.init_process_group("nccl")           # torchrun --nproc-per-node P ...
    q, k, v = (zigzag_shard(x, rank, world) for x in (q_full, k_full, v_full))   # [B, S/P, H(k), D]
    out = ring_attention(q, k, v, causal=True)  # this rank's rows of attention over all S keys

Each rank keeps its queries; the key/value shards travel around the ring (rank r sends to
r + 1 and receives from r - 1, ``torch.distributed.batch_isend_irecv``) while the block
that has arrived is computed, and the partial outputs merge through their log-sum-exp
(``flashgen.runtime.context``).  The backward works on the other ranks' shards first and
on its own last: the key/value shards go around again, each with the float32 dk/dv
accumulators of the ranks that have worked on it, and their last hop home runs beside the
owner's work on its own shard, whose first half (by heads, else batch) runs beside the
first key/value hop: no transfer waits for nothing but itself.  Grouped-query k/v travel
with their Hk heads.  Every sum runs in a fixed order (dq over the steps, a shard's dk/dv
over the ranks after its owner, the owner's share last), so with ``deterministic=True`` for
the kernels a fixed world size repeats the same bits.

Overlap: at each step the compute stream records an event, enqueues the block's kernels,
then the transfers for the next step are posted from a side stream that waits only for
that event (so the kernels' validation runs before any transfer is posted, and the
transfers run beside the kernels); the compute stream waits for the transfers before the
next step reads what arrived.  Two receive buffers alternate, so a transfer never writes
what a running kernel reads.
"""
from __future__ import annotations

import numbers
import zlib
from typing import Callable, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from flashgen.runtime import api, context
from flashgen.torch import _autocast, _window as window_sides

__all__ = ["ring_attention", "zigzag_shard", "zigzag_unshard"]


class Kernels(NamedTuple):
    """The block kernels the ring runs, and the device type of the tensors they take."""

    forward: Callable  # (q, k, v, *, causal, window, scale, softcap) -> (out, lse)
    backward: Callable  # (grad_out, q, k, v, out, lse, *, causal, window, scale, softcap, deterministic)
    device_type: str


# flashgen's kernels.  The CPU tests replace KERNELS with a float64 reference on CPU tensors
# (under the gloo backend) so that they run the whole ring, transfers included, without a GPU.
FLASHGEN = Kernels(api.attention_forward, api.attention_backward, "cuda")
KERNELS = FLASHGEN


def zigzag_shard(x: torch.Tensor, rank: int, world: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s shard of a whole sequence along ``dim`` for ``ring_attention``'s zigzag
    layout: chunks ``rank`` and ``2 * world - 1 - rank`` of 2 * world equal chunks, in that
    order (the length must be a multiple of 2 * world: pad it).  Returns a new tensor."""
    segments = context.shard_segments(rank, world, x.shape[dim], "zigzag")
    return torch.cat([x.narrow(dim, start, length) for start, length in segments], dim)


def zigzag_unshard(shards: Sequence[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The whole sequence from every rank's zigzag shard, in rank order (``dist.all_gather``'s
    list): the inverse of ``zigzag_shard``."""
    world = len(shards)
    if world == 0 or len({s.shape[dim] for s in shards}) != 1:
        raise ValueError("zigzag_unshard takes one shard per rank, in rank order, all of one length")
    length = shards[0].shape[dim] * world
    pieces = []
    for rank, shard in enumerate(shards):
        at = 0
        for start, n in context.shard_segments(rank, world, length, "zigzag"):
            pieces.append((start, shard.narrow(dim, at, n)))
            at += n
    return torch.cat([piece for _, piece in sorted(pieces, key=lambda p: p[0])], dim)


def ring_attention(q, k, v, group=None, *, causal=None, window=None, scale=None, softcap: float = 0.0,
                   layout: str = "zigzag", deterministic: bool = False, return_lse: bool = False):
    """Attention over a sequence split across the ranks of ``group`` (default: the world).

    Each rank passes its shard: q [B, S/P, H, K], k [B, S/P, Hk, K], v [B, S/P, Hk, Kv]
    (H a multiple of Hk), the same shapes on every rank, and gets back its rows of the
    output, [B, S/P, H, Kv], differentiable in q, k and v.  ``layout``: "zigzag" (each shard
    holds chunks r and 2P-1-r of 2P, ``zigzag_shard``: with ``causal`` every rank does the
    same work) or "contiguous" (chunk r of P; with ``causal`` rank r works r + 1 times as
    long as rank 0).  ``causal``: True, "top_left" or "bottom_right" (the same here: queries
    and keys are one sequence); ``window=(left, right)``, ``softcap``, ``scale`` and
    ``deterministic`` as in ``flashgen.torch.attention``, over global positions.  With
    ``return_lse``: (out, lse [B, H, S/P] float32, natural log, not differentiable).

    Needs ``torch.distributed`` initialised (NCCL for CUDA tensors; one GPU per rank, set
    with ``torch.cuda.set_device``).  Each call first checks with one small all_gather (and
    a host synchronisation) that every rank passed the same shapes and options, so that a
    mismatch is an error on every rank rather than a hang.
    """
    ring = _Ring(group)
    config = _config(ring, q, k, v, causal, window, scale, softcap, layout, deterministic)
    q, k, v = _autocast(q, k, v) if config.kernels.device_type == "cuda" else (q, k, v)
    out, lse = _RingAttention.apply(q, k, v, config)
    return (out, lse) if return_lse else out


class _RingAttention(torch.autograd.Function):
    """The ring's forward and backward; ``config`` (a ``_Config``) is not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, config):
        ring, kernels = config.ring, config.kernels
        k, v = k.contiguous(), v.contiguous()  # a transfer sends a tensor's whole storage
        held, spare = (k, v), [None, None]
        out = lse = None
        for step, blocks in enumerate(config.plans):
            ready = ring.mark()
            out, lse = context.partial_forward(q, *held, blocks, out, lse, scale=config.scale, softcap=config.softcap,
                                               forward=kernels.forward)
            if step + 1 < ring.world:
                incoming = spare[step % 2] = spare[step % 2] or _like(held)
                ring.wait(ring.exchange(held, incoming, ready))
                held = incoming
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.config = config
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse = ctx.saved_tensors
        config = ctx.config
        ring, world = config.ring, config.ring.world
        grad_out = grad_out.contiguous()
        options = dict(scale=config.scale, softcap=config.softcap, deterministic=config.deterministic,
                       backward=config.kernels.backward)
        own_blocks, remote_plans = config.plans[0], config.plans[1:]  # the others: shards r-1, r-2, ..., r+1
        dq = _filled_like(q, torch.float32)
        own_dk, own_dv = _filled_like(k, torch.float32), _filled_like(v, torch.float32)

        def own_part(part):  # this rank's own key shard, over one slice of heads (or batch)
            views = [x[part.q] for x in (grad_out, q)] + [x[part.kv] for x in (k, v)] + [out[part.q], lse[part.lse]]
            context.partial_backward(*views, own_blocks, dq[part.q], own_dk[part.kv], own_dv[part.kv], **options)

        first, last = _halves(q, k) if world > 1 else (None, _EVERY)
        held, spare = (k, v), [None, None]
        inbox = [None, None]  # the dk/dv accumulators that arrive, alternately
        done = None  # the finished float32 (dk, dv) of the shard worked on at the previous step
        pending = []
        if world > 1:  # the first shard's k/v travel while the first half of the own shard is computed
            spare[0] = _like(held)
            pending = ring.exchange(held, spare[0], ring.mark())
            if first is not None:
                own_part(first)
            ring.wait(pending)
            held = spare[0]
        for step, blocks in enumerate(remote_plans):
            ready = ring.mark()
            sends, recvs = [], []
            if step + 1 < len(remote_plans):  # pass the k/v on; the next shard's arrive
                spare[(step + 1) % 2] = spare[(step + 1) % 2] or _like(held)
                sends, recvs = list(held), list(spare[(step + 1) % 2])
            if step > 0:  # this step's shard's accumulators, from the ranks before this one
                inbox[step % 2] = inbox[step % 2] or _like(done)
                sends, recvs = sends + list(done), recvs + list(inbox[step % 2])
            pending = ring.exchange(sends, recvs, ready)
            dq, dk, dv = context.partial_backward(grad_out, q, *held, out, lse, blocks, dq, **options)
            ring.wait(pending)
            if step > 0:
                inbox[step % 2][0].add_(dk)
                inbox[step % 2][1].add_(dv)
                dk, dv = inbox[step % 2]
            done = dk.contiguous(), dv.contiguous()  # sent next (a kernel's own gradient may be strided)
            if step + 1 < len(remote_plans):
                held = spare[(step + 1) % 2]
        if world > 1:  # the last hop (the accumulators to their owner) runs beside the own shard's rest
            home = inbox[len(remote_plans) % 2] or _like(done)
            pending = ring.exchange(done, home, ring.mark())
        own_part(last)
        ring.wait(pending)
        dk, dv = (own_dk, own_dv) if world == 1 else (home[0].add_(own_dk), home[1].add_(own_dv))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


class _Part(NamedTuple):
    """Index tuples of one slice of the heads (or the batch): into q-shaped, k-shaped and lse tensors."""

    q: tuple
    kv: tuple
    lse: tuple


_EVERY = _Part((slice(None),), (slice(None),), (slice(None),))


def _halves(q, k) -> Tuple[Optional[_Part], _Part]:
    """The own shard's backward in two parts: the first hides the first k/v hop, the second the
    accumulators' last hop.  Split by k/v heads (with their query heads), else by batch; with
    one k/v head and one sequence, all of it comes last (the first hop, k and v in q's dtype,
    is the shorter one)."""
    batch, heads, kv_heads = q.shape[0], q.shape[2], k.shape[2]
    if kv_heads > 1:
        kv_cut = kv_heads // 2
        cut = kv_cut * (heads // kv_heads)
        def part(qs, ks):
            return _Part((slice(None), slice(None), qs), (slice(None), slice(None), ks), (slice(None), qs))
        return part(slice(0, cut), slice(0, kv_cut)), part(slice(cut, None), slice(kv_cut, None))
    if batch > 1:
        return _Part(*[(slice(0, batch // 2),)] * 3), _Part(*[(slice(batch // 2, None),)] * 3)
    return None, _EVERY


def _filled_like(x, dtype):
    """Zeros in x's shape, in the accumulators' dtype (float32; float64 for a float64 reference run)."""
    return torch.zeros(x.shape, dtype=torch.float64 if x.dtype == torch.float64 else dtype, device=x.device)


def _like(tensors) -> Tuple[torch.Tensor, ...]:
    """Receive buffers for ``tensors``: contiguous, as the transfers need them."""
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in tensors)


class _Config(NamedTuple):
    ring: "_Ring"
    plans: Tuple[Tuple[context.Block, ...], ...]  # the blocks of the key shard of rank (rank - step) % P, by step
    scale: Optional[float]
    softcap: float
    deterministic: bool
    kernels: Kernels


_CAUSAL = {None: False, False: False, True: True, "top_left": True, "bottom_right": True}


def _config(ring, q, k, v, causal, window, scale, softcap, layout, deterministic) -> _Config:
    """Check the call on this rank, then that every rank made the same call; plan the blocks.

    What the kernels check themselves (the values of scale and softcap, the dtype, head dims)
    is left to them: the first step's kernels run before its transfers are posted, so they
    fail on every rank alike, with nothing in flight."""
    try:
        signature = [1.0, *_check_local(q, k, v, causal, scale, softcap, layout, deterministic),
                     *_numbers(window, scale, softcap), layout == "zigzag", _CAUSAL[causal]]
        problem = None
    except (TypeError, ValueError) as e:
        signature, problem = [0.0] * _SIGNATURE, e
    ring.agree(signature, problem)  # every rank raises if any rank failed here or ranks differ
    if q.is_cuda:
        ring.stream = torch.cuda.Stream(device=q.device)
    causal, window = _CAUSAL[causal], _window(window)
    length = q.shape[1] * ring.world
    mine = context.shard_segments(ring.rank, ring.world, length, layout)
    plans = tuple(context.plan_blocks(mine, context.shard_segments((ring.rank - step) % ring.world, ring.world,
                                                                   length, layout), causal=causal, window=window)
                  for step in range(ring.world))
    return _Config(ring, plans, None if scale is None else float(scale), float(softcap), deterministic, KERNELS)


def _check_local(q, k, v, causal, scale, softcap, layout, deterministic) -> tuple:
    """This rank's inputs, as the numbers every rank must agree on: q's shape, k's heads and
    head dim, v's head dim, the dtype."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.device.type != KERNELS.device_type:
            where = f"on {t.device.type}" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
            raise TypeError(f"{name} is {where}: ring_attention takes {KERNELS.device_type} tensors")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [batch, seq/P, heads, head_dim]; got {tuple(t.shape)}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k and v must have one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if k.shape[:3] != v.shape[:3] or k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(f"shards q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: ring attention is "
                         "self-attention, q, k and v share batch and sequence, q and k the head dim")
    if k.shape[2] == 0 or q.shape[2] % k.shape[2]:
        raise ValueError(f"q has {q.shape[2]} heads, k and v {k.shape[2]}: q's must be a multiple of k's")
    if not isinstance(causal, (str, bool, type(None))) or causal not in _CAUSAL:
        raise ValueError(f"causal must be None, True, False, 'top_left' or 'bottom_right'; got {causal!r}")
    if layout not in context.LAYOUTS:
        raise ValueError(f"layout must be one of {context.LAYOUTS}; got {layout!r}")
    if layout == "zigzag" and q.shape[1] % 2:
        raise ValueError(f"a zigzag shard is two equal chunks; this one has {q.shape[1]} rows (zigzag_shard "
                         "cuts a sequence whose length is a multiple of 2 * world)")
    for name, x in (("scale", scale), ("softcap", softcap)):
        if x is not None and (isinstance(x, bool) or not isinstance(x, numbers.Real)):
            raise TypeError(f"{name} must be a real number; got {x!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be True or False; got {deterministic!r}")
    return (*q.shape, *k.shape[2:], v.shape[3], zlib.crc32(str(q.dtype).encode()))


def _window(window):
    """The window as the block planner takes it: None, or (left, right) with None for no limit."""
    sides = window_sides(window)
    return None if sides == (-1, -1) else tuple(None if side < 0 else side for side in sides)


def _numbers(window, scale, softcap) -> list:
    """The options as numbers every rank must agree on (-1: no window side, no scale)."""
    return [*window_sides(window), -1.0 if scale is None else scale, softcap]


_SIGNATURE = 15  # numbers in a signature: the flag, 8 from _check_local, 4 from _numbers, layout, causal


class _Ring:
    """The ring of a process group: this rank's neighbours (as global ranks, which P2POp takes)
    and the side stream that transfers are posted from."""

    def __init__(self, group):
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("ring_attention needs torch.distributed initialised (dist.init_process_group, "
                             "e.g. under torchrun)")
        self.group = group if group is not None else dist.group.WORLD
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the group passed to ring_attention")
        self.next = dist.get_global_rank(self.group, (self.rank + 1) % self.world)
        self.prev = dist.get_global_rank(self.group, (self.rank - 1) % self.world)
        self.stream = None  # set for CUDA tensors (_config)

    def agree(self, signature: list, problem: Optional[Exception]):
        """All-gather every rank's ``signature`` (its call, as numbers); raise on every rank if
        any rank rejected its inputs or any two differ."""
        cuda = dist.get_backend(self.group) == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        mine = torch.tensor([float(x) for x in signature], dtype=torch.float64, device=device)
        every = [torch.empty_like(mine) for _ in range(self.world)]
        dist.all_gather(every, mine, group=self.group)
        rows = [t.tolist() for t in every]
        if problem is not None:
            raise problem
        failed = [r for r, row in enumerate(rows) if not row[0]]
        if failed:
            raise ValueError(f"ring_attention: rank(s) {failed} of the group rejected their inputs (see the error "
                             "there); every rank must pass shards of the same shapes and the same options")
        differ = [r for r, row in enumerate(rows) if row != rows[0]]
        if differ:
            raise ValueError(f"ring_attention: rank(s) {differ} passed other shapes, dtypes or options than rank 0 "
                             f"(shapes, dtype and options as numbers: {rows[differ[0]]} against {rows[0]})")

    def mark(self):
        """An event on the compute stream: what a transfer posted next must wait for (None for
        CPU tensors, whose kernels have finished when they return)."""
        if self.stream is None:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def exchange(self, sends: Sequence[torch.Tensor], recvs: Sequence[torch.Tensor], after) -> list:
        """Send ``sends`` to the next rank and receive ``recvs`` from the previous one, posted
        once ``after`` (``mark``) has passed; returns the pending transfers."""
        ops = ([dist.P2POp(dist.isend, t, self.next, self.group) for t in sends]
               + [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recvs])
        if not ops:
            return []
        if after is None:
            return dist.batch_isend_irecv(ops)
        self.stream.wait_event(after)
        with torch.cuda.stream(self.stream):
            return dist.batch_isend_irecv(ops)

    @staticmethod
    def wait(pending: list):
        """Until the transfers are done: for NCCL, the current (compute) stream waits for them on
        the GPU; for gloo the host waits."""
        for work in pending:
            work.wait()
