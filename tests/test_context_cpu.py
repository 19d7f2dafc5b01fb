"""flashgen.runtime.context on the CPU: shards, block plans, the lse merge and the partial
forward/backward, driven by float64 NumPy stand-ins for the kernels (no GPU, no torch)."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from context_reference import attention, block_backward, block_forward, global_mask, visible
from flashgen.runtime import context

WINDOWS = [None, (3, None), (5, 2), (None, 4), (0, 0), (40, None), (2, 30)]


def positions(segments):
    return np.concatenate([np.arange(start, start + n) for start, n in segments])


@pytest.mark.parametrize("layout", context.LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_shards_cover_the_sequence_once(layout, world):
    length = 2 * world * 3
    every = np.concatenate([positions(context.shard_segments(r, world, length, layout)) for r in range(world)])
    assert sorted(every.tolist()) == list(range(length))
    for r in range(world):
        assert sum(n for _, n in context.shard_segments(r, world, length, layout)) == length // world


def test_shard_errors():
    with pytest.raises(ValueError, match="multiple of 6"):
        context.shard_segments(0, 3, 20, "zigzag")
    with pytest.raises(ValueError, match="layout"):
        context.shard_segments(0, 2, 8, "striped")
    with pytest.raises(ValueError, match="rank"):
        context.shard_segments(2, 2, 8)


@pytest.mark.parametrize("layout", context.LAYOUTS)
@pytest.mark.parametrize("world,chunk", [(1, 5), (2, 3), (3, 4), (4, 3)])
def test_blocks_cover_the_mask_exactly(layout, world, chunk):
    """Every visible (query, key) pair of a shard pair is computed by exactly one block, no
    masked one is, and no block carries a row or a key that sees nothing."""
    length = 2 * world * chunk
    for causal, window in itertools.product((False, True), WINDOWS):
        for r, s in itertools.product(range(world), repeat=2):
            mine, theirs = (context.shard_segments(x, world, length, layout) for x in (r, s))
            want = global_mask(positions(mine), positions(theirs), causal, window)
            count = np.zeros(want.shape, dtype=int)
            for b in context.plan_blocks(mine, theirs, causal=causal, window=window):
                local = visible(b.rows.stop - b.rows.start, b.cols.stop - b.cols.start, b.causal, b.window)
                assert local.any(1).all() and local.any(0).all(), (causal, window, r, s, b)
                count[b.rows, b.cols] += local
            assert np.array_equal(count, want.astype(int)), (causal, window, r, s)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_zigzag_causal_gives_every_rank_the_same_work(world):
    """One kernel call per step, and the same visible pairs and the same block areas on every
    rank (the contiguous layout's rank r computes r + 1 blocks)."""
    length = 2 * world * 4
    pairs, areas = set(), set()
    for r in range(world):
        mine = context.shard_segments(r, world, length)
        plans = [context.plan_blocks(mine, context.shard_segments(s, world, length), causal=True)
                 for s in range(world)]
        assert all(len(p) == 1 for p in plans)
        blocks = [b for p in plans for b in p]
        areas.add(sum((b.rows.stop - b.rows.start) * (b.cols.stop - b.cols.start) for b in blocks))
        pairs.add(sum(int(visible(b.rows.stop - b.rows.start, b.cols.stop - b.cols.start, b.causal).sum())
                      for b in blocks))
        contiguous = context.shard_segments(r, world, length, "contiguous")
        assert sum(len(context.plan_blocks(contiguous, context.shard_segments(s, world, length, "contiguous"),
                                           causal=True)) for s in range(world)) == r + 1
    assert len(pairs) == 1 and len(areas) == 1


def _partial(rng, B=2, M=6, H=3, Kv=4, empty=(), infinite=()):
    out = rng.standard_normal((B, M, H, Kv))
    lse = rng.standard_normal((B, H, M)) * 3
    for row in empty:
        out[:, row], lse[:, :, row] = 0.0, -np.inf
    for row in infinite:  # example 41's way of saying "no key"
        out[:, row], lse[:, :, row] = 0.0, np.inf
    return out, lse


def _accumulators(B=2, M=6, H=3, Kv=4):
    return np.zeros((B, M, H, Kv)), np.full((B, H, M), -np.inf)


def test_merge_is_the_softmax_over_every_part():
    rng = np.random.default_rng(0)
    parts = [_partial(rng, empty=(1, 4)), _partial(rng, empty=(4,), infinite=(2,)), _partial(rng, empty=(4, 5))]
    out, lse = _accumulators()
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # no inf, NaN or log(0)
        for part in parts:
            context.merge(out, lse, *part)
    lses = np.stack([np.where(np.isfinite(p_lse), p_lse, -np.inf) for _, p_lse in parts])
    with np.errstate(divide="ignore"):
        want_lse = np.log(np.exp(lses).sum(0))
    weights = np.where(np.isfinite(want_lse), np.exp(lses - np.where(np.isfinite(want_lse), want_lse, 0)), 0)
    want_out = sum(o * w.swapaxes(1, 2)[..., None] for (o, _), w in zip(parts, weights))
    assert np.isneginf(lse[:, :, 4]).all() and (out[:, 4] == 0).all()  # no part saw a key
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-13)


def test_merge_far_apart_lse_and_a_subset_of_rows():
    out, lse = _accumulators()
    big = np.ones((2, 2, 3, 4)), np.full((2, 3, 2), 1e4)
    small = np.full((2, 2, 3, 4), 7.0), np.full((2, 3, 2), -1e4)
    with np.errstate(over="raise", invalid="raise", divide="raise"):  # exp(-2e4) may underflow to 0
        context.merge(out, lse, *small, rows=slice(2, 4))
        context.merge(out, lse, *big, rows=slice(2, 4))
    assert (out[:, 2:4] == 1).all() and (lse[:, :, 2:4] == 1e4).all()
    assert (out[:, [0, 1, 4, 5]] == 0).all() and np.isneginf(lse[:, :, [0, 1, 4, 5]]).all()


def test_one_part_passes_through_unchanged():
    """A single block merged into fresh accumulators is that block, bit for bit (world size 1
    equals plain attention)."""
    out, lse = _accumulators()
    part = _partial(np.random.default_rng(1), empty=(3,))
    context.merge(out, lse, *part)
    assert np.array_equal(out, part[0]) and np.array_equal(lse, part[1])


OPTIONS = [dict(causal=False), dict(causal=True), dict(causal=True, window=(5, None)),
           dict(causal=False, window=(4, 3), softcap=2.0), dict(causal=True, scale=0.3)]


@pytest.mark.parametrize("layout", context.LAYOUTS)
@pytest.mark.parametrize("options", OPTIONS, ids=str)
def test_partials_add_up_to_whole_attention(layout, options):
    """Each rank's partial_forward over every key shard is its rows of the whole attention, and
    partial_backward with the final out and lse gives exact shares: summed over the shards
    they are the whole attention's gradients."""
    rng = np.random.default_rng(2)
    world, B, S, H, Hk, K, Kv = 3, 2, 24, 4, 2, 5, 3
    q, k, v = (rng.standard_normal((B, S, h, d)) for h, d in ((H, K), (Hk, K), (Hk, Kv)))
    grad_out = rng.standard_normal((B, S, H, Kv))
    want_out, want_lse, want_grads = attention(q, k, v, grad_out, **options)
    causal, window = options["causal"], options.get("window")
    kernel = dict(scale=options.get("scale"), softcap=options.get("softcap", 0.0))
    shards = [positions(context.shard_segments(r, world, S, layout)) for r in range(world)]
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for r, mine in enumerate(shards):
        out = lse = dq = None
        for s, theirs in enumerate(shards):
            blocks = context.plan_blocks(*(context.shard_segments(x, world, S, layout) for x in (r, s)),
                                         causal=causal, window=window)
            out, lse = context.partial_forward(q[:, mine], k[:, theirs], v[:, theirs], blocks, out, lse,
                                               forward=block_forward, **kernel)
        np.testing.assert_allclose(out, want_out[:, mine], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(lse, want_lse[:, :, mine], rtol=1e-12)
        for s, theirs in enumerate(shards):
            blocks = context.plan_blocks(*(context.shard_segments(x, world, S, layout) for x in (r, s)),
                                         causal=causal, window=window)
            dq, dk_s, dv_s = context.partial_backward(grad_out[:, mine], q[:, mine], k[:, theirs], v[:, theirs],
                                                      out, lse, blocks, dq, backward=block_backward, **kernel)
            dk[:, theirs] += dk_s
            dv[:, theirs] += dv_s
        np.testing.assert_allclose(dq, want_grads[0][:, mine], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dk, want_grads[1], rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dv, want_grads[2], rtol=1e-10, atol=1e-12)


def test_the_reference_gradients_are_the_derivative():
    """The stand-ins' textbook gradients against central differences of sum(out * grad_out)."""
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 6, h, 3)) for h in (4, 2, 2))
    grad_out = rng.standard_normal((1, 6, 4, 3))
    options = dict(causal=True, window=(3, None), softcap=1.5)
    _, _, grads = attention(q, k, v, grad_out, **options)
    step = 1e-6
    for x, g in zip((q, k, v), grads):
        numeric = np.zeros_like(x)
        for index in np.ndindex(x.shape):
            saved = x[index]
            x[index] = saved + step
            up = (attention(q, k, v, **options)[0] * grad_out).sum()
            x[index] = saved - step
            down = (attention(q, k, v, **options)[0] * grad_out).sum()
            x[index] = saved
            numeric[index] = (up - down) / (2 * step)
        np.testing.assert_allclose(g, numeric, rtol=1e-6, atol=1e-8)


def test_a_shard_with_no_visible_key():
    """No block: out 0 and lse -inf (a softmax over nothing), zero gradients."""
    q = np.ones((1, 4, 2, 3))
    out, lse = context.partial_forward(q, q, q, (), forward=block_forward)
    assert (out == 0).all() and np.isneginf(lse).all() and out.shape == (1, 4, 2, 3) and lse.shape == (1, 2, 4)
    grads = context.partial_backward(q, q, q, q, q, lse, (), backward=block_backward)
    assert all(g.shape == q.shape and (g == 0).all() for g in grads)
