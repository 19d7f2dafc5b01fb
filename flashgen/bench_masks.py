"""Bench points under a block mask: the masks FlexAttention is measured on, built alike for each side.

A ``Point`` with ``mask`` set times attention under that mask instead of a causal or a full one:

* ``document8``: eight documents of equal length packed in each sequence; a query sees the keys
  of its own document.
* ``window1024``: causal, and only the 1024 most recent keys (the query's own included).
* ``document8-causal``: the eight documents, causal within each (packed causal training).  flashgen
  gets the document mask and ``causal="top_left"`` beside it, as a user writes it (the calls fold
  the causal mask into the mask's lists); flex one mask function with both.

flashgen gets a ``flashgen.block_mask`` of the built-in mask mod that declares the mask (``document``
with the documents' ids, ``sliding_window`` with its width: issue 17's AOT Flex path; its sparse kernels
where they serve the call, else the dense fallback: what a user gets), flex a ``create_block_mask`` of
the same mask as a Python function, both with 128 x 128 blocks, built once per point outside the
timings.  SDPA and FlashAttention-4 take no block mask: their cells say so (a dense boolean
``attn_mask`` would time a dense attention).
FLOPs count only the scores the mask shows (``visible``), so TFLOP/s compare the work it leaves.
"""
from __future__ import annotations

from typing import Callable, List

from flashgen.bench import Point, Timed, flashgen_entries, flashgen_torch_entries, flex_entries

MASKS = ("document8", "window1024", "document8-causal")
BLOCK = (128, 128)
DOCUMENTS = 8
WINDOW = 1024


def _check(mask: str) -> None:
    if mask not in MASKS:
        raise ValueError(f"unknown bench mask {mask!r}; the bench knows {', '.join(MASKS)}")


def visible(mask: str, seqlen: int) -> float:
    """The share of the seqlen x seqlen scores ``mask`` shows (exact, ragged documents included)."""
    _check(mask)
    if mask.startswith("document8"):
        starts = [-(-d * seqlen // DOCUMENTS) for d in range(DOCUMENTS + 1)]  # i * DOCUMENTS // seqlen == d
        sizes = [b - a for a, b in zip(starts, starts[1:])]
        seen = (lambda n: n * (n + 1) // 2) if mask.endswith("-causal") else (lambda n: n * n)
        return sum(seen(n) for n in sizes) / seqlen ** 2
    w = min(WINDOW, seqlen)  # row i sees min(i + 1, w) keys
    return (w * (w + 1) // 2 + (seqlen - w) * w) / seqlen ** 2


def mask_mod(mask: str, seqlen: int, arange: Callable[[int], object]):
    """``mask(b, h, q_idx, kv_idx) -> bool`` over index arrays of the module ``arange`` comes from
    (CuPy's for flashgen.block_mask, torch's for flex): the same function for both."""
    _check(mask)
    if mask == "document8":
        document = arange(seqlen) * DOCUMENTS // seqlen
        return lambda b, h, q_idx, kv_idx: document[q_idx] == document[kv_idx]
    if mask == "document8-causal":
        same = mask_mod("document8", seqlen, arange)
        return lambda b, h, q_idx, kv_idx: same(b, h, q_idx, kv_idx) & (q_idx >= kv_idx)
    return lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def flashgen_options(mask: str) -> dict:
    """What flashgen's calls take beside the block mask: the causal mask a user would pass."""
    _check(mask)
    return {"causal": "top_left"} if mask.endswith("-causal") else {}


def declared_mask(mask: str, seqlen: int, xp) -> tuple:
    """(built-in mask mod, its captured tensors as arrays of module ``xp``) declaring ``mask`` without
    its causal part (``flashgen_options`` passes that): the documents' ids, or the window's width."""
    _check(mask)
    if mask.startswith("document8"):
        return "document", {"doc": (xp.arange(seqlen, dtype=xp.int32) * DOCUMENTS // seqlen)[None]}
    return "sliding_window", {"window": xp.asarray([WINDOW], dtype=xp.int32)}


def flashgen_block_mask(p: Point):
    """The point's mask as flashgen takes it, built on the GPU (broadcast over batch and heads)."""
    import cupy

    import flashgen

    mod, tensors = declared_mask(p.mask, p.seqlen, cupy)
    return flashgen.block_mask(mod, 1, 1, p.seqlen, p.seqlen, block=BLOCK, mod_tensors=tensors)


def flex_block_mask(p: Point, torch):
    from torch.nn.attention.flex_attention import create_block_mask

    arange = lambda n: torch.arange(n, device="cuda")  # noqa: E731
    return create_block_mask(mask_mod(p.mask, p.seqlen, arange), None, None, p.seqlen, p.seqlen, device="cuda",
                             BLOCK_SIZE=BLOCK)


def entries(p: Point, impls: List[str], sets, t_sets, torch) -> List[Timed]:
    """Each asked implementation's forward and backward under the point's mask (``bench_point``)."""
    out: List[Timed] = []
    if "flashgen" in impls or "flashgen-torch" in impls:
        mask, options = flashgen_block_mask(p), flashgen_options(p.mask)
        if "flashgen" in impls:
            out += flashgen_entries(sets, torch, block_mask=mask, **options)
        if "flashgen-torch" in impls:
            out += flashgen_torch_entries(sets, torch, block_mask=mask, **options)
    for impl in impls:
        if impl == "fa4" or impl.startswith("sdpa-"):
            out += [Timed(impl, direction, None, error="takes no block mask") for direction in ("fwd", "bwd")]
    if "flex" in impls:
        out += flex_entries(p, t_sets, torch, flex_block_mask(p, torch))
    return out
