"""Block-sparse attention masks: which (query block, key block) tiles a kernel has to visit.

``block_mask(mask, B, H, M, N, block=(128, 128))`` evaluates an element mask once, on the
GPU with CuPy (or with NumPy on the host, ``device="cpu"``), and records per (batch, head,
query block) the key blocks whose elements are all visible ("full": no element mask needed)
and those with some visible and some hidden ("partial": the element mask applies there);
key blocks with nothing visible are left out, so a kernel never visits them.  The
transposed lists, per (batch, head, key block), serve a backward that walks key blocks.
A call that passes ``causal`` or ``window`` beside a mask runs on the mask with that band folded
into its lists (``BlockMask.with_band``: built once per mask and band, then kept with it).
The layout is the one FlexAttention-like kernels read: ``kv_num_blocks`` [B, H, QB] int32
and ``kv_indices`` [B, H, QB, KB] int32, the first ``kv_num_blocks`` entries of a row being
its listed blocks in ascending order and the rest the other blocks, also ascending (each row
is a permutation of 0..KB-1, so no entry is ever out of range).

The element mask is evaluated in chunks of whole query blocks, so [B, H, M, N] never exists
at once for long sequences; a mask that ignores the batch or head index costs [rows, N] per
chunk, not B * H times that.  A block at the ragged end of M or N counts only its existing
elements: bounds are the kernels' business, as for any call.

Partial blocks also keep their element mask, bit-packed, for kernels that apply it in place of
a dense bias (``sm90_fwd``'s ``sparse`` instances).  With the key-block width a multiple of 32:

* ``partial_bits`` uint32 [P, block_m, block_n / 32], one tile per partial block: bit j of
  word w of row r is 1 iff key ``w * 32 + j`` of the tile is visible to its query row r.  Rows
  and keys past M or N are 0.  P is the number of partial blocks (memory is that, not
  B * H * QB * KB tiles); P == 0 leaves a [1, block_m, block_n / 32] tile of zeros, so the
  array always has an address.
* ``partial_index`` int32 [B, H, QB, KB]: the partial block's tile in ``partial_bits``, -1
  where the block is not partial.  Tiles are numbered in the order (query block, batch, head,
  key block), so the partial blocks of one (batch, head, query block) have consecutive tiles
  in ascending key-block order: the t-th entry of its ``kv_indices`` has tile
  ``partial_index[b, h, qb, kv_indices[b, h, qb, 0]] + t``, which is how a kernel finds them
  with one lookup per query block.  (That order is also what lets each chunk of query rows
  append its tiles without a second pass.)

With another key-block width the bits are not recorded (both are None): no kernel reads them.
"""
from __future__ import annotations

import contextlib
import numbers
from dataclasses import dataclass, field
from typing import Optional, Tuple

import numpy as np

from flashgen.runtime.arrays import as_array, cupy_module, dtype_name, padded_rows

CHUNK_ELEMENTS = 1 << 26  # mask elements per evaluated chunk (64 MiB of booleans)


@dataclass(frozen=True, eq=False)
class BlockMask:
    """A block-sparse mask over [B, H, M, N] scores (B and H may be 1: the mask then broadcasts).

    Built by ``block_mask``; the ``kv_*`` lists drive a forward (per query block), the ``q_*``
    lists a backward (per key block).  ``mask`` is what it was built from (the callable or the
    boolean array), kept because partial blocks still need their elements and because the dense
    fallback (``to_dense``) is made from it.  ``device`` is the GPU the arrays live on, None for
    NumPy arrays on the host (inspection and tests; attention calls refuse those)."""

    shape: Tuple[int, int, int, int]
    block: Tuple[int, int]
    device: Optional[int]
    kv_num_blocks: object = field(repr=False)  # [B, H, QB] partial key blocks per query block
    kv_indices: object = field(repr=False)  # [B, H, QB, KB]
    full_kv_num_blocks: object = field(repr=False)  # [B, H, QB] full key blocks per query block
    full_kv_indices: object = field(repr=False)
    q_num_blocks: object = field(repr=False)  # [B, H, KB] partial query blocks per key block
    q_indices: object = field(repr=False)  # [B, H, KB, QB]
    full_q_num_blocks: object = field(repr=False)
    full_q_indices: object = field(repr=False)
    mask: object = field(repr=False)
    partial_index: object = field(default=None, repr=False)  # [B, H, QB, KB] int32 tile in partial_bits, or -1
    partial_bits: object = field(default=None, repr=False)  # [P, block_m, block_n / 32] uint32 element mask
    # (lo, hi): also hides key j from query i unless i + lo <= j <= i + hi (None: that side unbounded),
    # a causal mask or window folded in (``with_band``)
    band: Optional[Tuple[Optional[int], Optional[int]]] = None
    _folded: dict = field(default_factory=dict, repr=False)  # band -> this mask with that band folded in
    _views: dict = field(default_factory=dict, repr=False)  # (arrays, convert) -> converted arrays

    @property
    def num_blocks(self) -> Tuple[int, int]:
        """(query blocks, key blocks): QB and KB."""
        (_, _, M, N), (bm, bn) = self.shape, self.block
        return -(-M // bm), -(-N // bn)

    @property
    def xp(self):
        """The array module of the lists: CuPy for a GPU mask, NumPy for a host one."""
        return np if self.device is None else cupy_module()

    def kernel_arrays(self) -> tuple:
        """What a sparse forward reads, in its order: partial counts and lists, full counts and
        lists, partial_index, partial_bits (the last two None where the key blocks are not a
        multiple of 32 wide: no kernel reads such a mask)."""
        return (self.kv_num_blocks, self.kv_indices, self.full_kv_num_blocks, self.full_kv_indices,
                self.partial_index, self.partial_bits)

    def backward_arrays(self) -> tuple:
        """What a sparse backward reads, in its order: the transposed lists (partial counts and lists,
        full counts and lists, per key block), then partial_index and partial_bits as for the forward."""
        return (self.q_num_blocks, self.q_indices, self.full_q_num_blocks, self.full_q_indices,
                self.partial_index, self.partial_bits)

    def arrays_as(self, which: str, convert) -> tuple:
        """``kernel_arrays()`` or ``backward_arrays()`` (``which``), each passed through ``convert``
        (a torch caller's ``torch.from_dlpack``: zero-copy views) once per mask and then kept, so a
        caller's launch plans can key on arrays of its own kind."""
        key = (which, convert)
        if key not in self._views:
            self._views[key] = tuple(None if x is None else convert(x) for x in getattr(self, which)())
        return self._views[key]

    def with_band(self, lo: Optional[int], hi: Optional[int]) -> "BlockMask":
        """This mask with a band folded in: key j also hidden from query i unless i + lo <= j <= i + hi
        (None: that side unbounded; a causal mask is hi = 0 top-left, N - M bottom-right).  Built on
        the first call and then kept with this mask, so that calls passing ``causal`` or ``window``
        beside it run the sparse kernels on stable lists."""
        band = _narrower(self.band, (lo, hi))
        if band not in self._folded:
            with _on(self.device):
                self._folded[band] = _build(self.mask, self.xp, self.device, self.shape, self.block, band)
        return self._folded[band]

    def density(self) -> float:
        """Visited blocks (full and partial) over all blocks: the share of the dense work a kernel
        that reads the lists does (reads the counts back to the host)."""
        total = float((self.kv_num_blocks.sum() + self.full_kv_num_blocks.sum()).item())
        B, H, _, _ = self.shape
        QB, KB = self.num_blocks
        return total / (B * H * QB * KB)

    def to_dense(self, dtype=np.float32):
        """The mask as an additive [B, H, M, N] bias of ``dtype`` (float32, float16 or bfloat16): 0 where
        a key is visible, -inf where it is not.  A row with no visible key is all -inf here; the
        attention calls give such rows output 0 and lse -inf instead of a softmax over nothing."""
        bias, _ = self.additive(dtype)
        return self.xp.ascontiguousarray(bias)

    def additive(self, dtype):
        """(bias, empty): the additive bias as ``to_dense`` makes it, in rows padded to 8 elements
        (``padded_rows``: the layout the kernels read a bias in), and which (b, h, query) rows see no
        key [B, H, M] (a band folded in by ``with_band`` applies)."""
        if dtype_name(dtype) is None:
            raise TypeError(f"dtype must be float32, float16 or bfloat16; got {dtype!r}")
        xp, (B, H, M, N) = self.xp, self.shape
        with _on(self.device):
            bias = padded_rows(xp, (B, H, M, N), dtype)
            empty = xp.empty((B, H, M), dtype=bool)
            for start, stop in _row_chunks(M, self.block[0], B * H * N):
                visible = _in_band(xp, _visible(self.mask, xp, self.shape, start, stop), start, self.band)
                empty[:, :, start:stop] = ~visible.any(axis=-1)
                bias[:, :, start:stop] = xp.where(visible, np.float32(0), np.float32(-np.inf)).astype(dtype)
        return bias, empty


def block_mask(mask, B: int, H: int, M: int, N: int, block=(128, 128), *, device=None,
               mod_tensors=None) -> BlockMask:
    """A :class:`BlockMask` over [B, H, M, N] scores from ``mask``, built once and reused by every call.

    ``mask`` is either ``mask_fn(b, h, q_idx, kv_idx) -> bool array``, called with integer index
    arrays of shapes [B, 1, 1, 1], [1, H, 1, 1], [1, 1, rows, 1] and [1, 1, 1, N] of the array
    module in use (CuPy, or NumPy with ``device="cpu"``; so ``q_idx >= kv_idx`` is causal and
    ``doc[q_idx] == doc[kv_idx]`` a document mask for a ``doc`` array of that module), its result
    broadcastable to [B, H, rows, N]; or a boolean array broadcastable to [B, H, M, N]
    (True: the key is visible); or a mask mod -- a ``flashgen.mods.MaskMod`` or the name of a
    built-in one ("document", "prefix_lm", "causal", "sliding_window") -- with its captured tensors
    in ``mod_tensors`` (checked against its declaration for B, H, M, N before anything runs; CuPy or
    other DLPack GPU arrays such as torch's, NumPy with ``device="cpu"``).  B and H may be 1: the
    mask then serves any batch and head count.  ``block``: (query rows, key columns) per block.
    ``device``: None for the mask's (or the mod tensors') own GPU, else CuPy's current one; an int
    for that GPU; "cpu" for NumPy on the host."""
    B, H, M, N = (_positive(name, n) for name, n in (("B", B), ("H", H), ("M", M), ("N", N)))
    if not isinstance(block, (tuple, list)) or len(block) != 2:
        raise TypeError(f"block must be (query rows, key columns), e.g. (128, 128); got {block!r}")
    block = (_positive("block's query rows", block[0]), _positive("block's key columns", block[1]))
    mask, device = _mask_mod_function(mask, mod_tensors, dict(B=B, H=H, M=M, N=N), device)
    xp, device, mask = _placed(mask, device)
    shape = (B, H, M, N)
    with _on(device):
        if not callable(mask):
            _check_mask_array(mask, shape)
        return _build(mask, xp, device, shape, block, None)


def fold_band(block_mask, causal, window):
    """(block_mask, causal, window) as a call runs them: a causal mask and a window beside a BlockMask
    folded into it (``BlockMask.with_band``, the band the kernels' own masks would apply: the window
    on the causal diagonal, top-left unless "bottom_right", a causal mask capping its right side at
    0), so the sparse kernels, which take neither, serve the call.  Anything malformed is returned
    as given, for validation to name."""
    well_formed = window is None or (isinstance(window, (tuple, list)) and len(window) == 2 and all(
        w is None or (isinstance(w, (int, np.integer)) and not isinstance(w, bool) and w >= 0) for w in window))
    if (not isinstance(block_mask, BlockMask) or causal not in (None, "top_left", "bottom_right") or not well_formed
            or (causal is None and (window is None or tuple(window) == (None, None)))):
        return block_mask, causal, window
    M, N = block_mask.shape[2:]
    diagonal = N - M if causal == "bottom_right" else 0
    left, right = window if window is not None else (None, None)
    lo = None if left is None else diagonal - int(left)
    hi = None if right is None else diagonal + int(right)
    if causal is not None:
        hi = diagonal if hi is None else min(hi, diagonal)
    return block_mask.with_band(lo, hi), None, None


def _narrower(band, other):
    """The intersection of two bands (None: no band; a None side: unbounded)."""
    if band is None or other is None:
        return other if band is None else band
    (lo1, hi1), (lo2, hi2) = band, other
    lo = lo2 if lo1 is None else lo1 if lo2 is None else max(lo1, lo2)
    hi = hi2 if hi1 is None else hi1 if hi2 is None else min(hi1, hi2)
    return lo, hi


def _build(mask, xp, device, shape, block, band) -> BlockMask:
    """The lists of ``mask`` (checked, on ``device`` made current), keys outside ``band`` hidden."""
    B, H, M, N = shape
    QB, KB = -(-M // block[0]), -(-N // block[1])
    full, partial = xp.zeros((B, H, QB, KB), dtype=bool), xp.zeros((B, H, QB, KB), dtype=bool)
    tiles = []  # partial_bits, chunk by chunk (bits: the key-block width is a multiple of 32)
    for start, stop in _row_chunks(M, block[0], B * H * N):
        rows = slice(start // block[0], -(-stop // block[0]))
        blocks = _blocked(xp, _in_band(xp, _visible(mask, xp, shape, start, stop), start, band), block)
        full[:, :, rows], partial[:, :, rows] = _classify(xp, blocks, stop - start, N)
        if block[1] % 32 == 0:
            tiles.append(_packed_partials(xp, blocks, partial[:, :, rows], (B, H)))
    lists = {} if not tiles else _partial_tiles(xp, partial, tiles, block)
    for name, flags in (("kv", partial), ("full_kv", full), ("q", partial.transpose(0, 1, 3, 2)),
                        ("full_q", full.transpose(0, 1, 3, 2))):
        lists[f"{name}_num_blocks"], lists[f"{name}_indices"] = _listed(xp, flags)
    return BlockMask(shape, block, device, mask=mask, band=band, **lists)


def _in_band(xp, visible, start: int, band):
    """``visible`` [b, h, rows, N] for query rows from ``start``, keys outside ``band`` hidden."""
    if band is None or band == (None, None):
        return visible
    rows, N = visible.shape[-2:]
    offset = xp.arange(N)[None, :] - xp.arange(start, start + rows)[:, None]  # j - i
    lo, hi = band
    keep = (offset >= lo) if lo is not None else xp.ones_like(offset, dtype=bool)
    return visible & (keep if hi is None else keep & (offset <= hi))


def _positive(name: str, n) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        raise TypeError(f"{name} must be an int; got {n!r}")
    if n < 1:
        raise ValueError(f"{name} must be >= 1; got {n}")
    return int(n)


def _on(device: Optional[int]):
    """``device`` made CuPy's current one (nothing for the host)."""
    return contextlib.nullcontext() if device is None else cupy_module().cuda.Device(device)


def _mask_mod_function(mask, mod_tensors, sizes, device):
    """(mask, device): a mask mod (or a built-in's name) as the mask_fn that evaluates its declaration
    over its bound tensors, on their GPU unless ``device`` says otherwise; any other mask as given."""
    from flashgen.mods import BUILTIN_MODS, MaskMod, ScoreMod

    if isinstance(mask, str):
        mod, name = BUILTIN_MODS.get(mask), mask
        if not isinstance(mod, MaskMod):
            mask_mods = sorted(n for n, m in BUILTIN_MODS.items() if isinstance(m, MaskMod))
            raise ValueError(f"{mask!r} is not a built-in mask mod ({', '.join(mask_mods)}); pass a MaskMod "
                             "declaration for one of your own")
    elif isinstance(mask, MaskMod):
        mod, name = mask, ""
    elif isinstance(mask, ScoreMod):
        raise TypeError("a ScoreMod changes scores, not which keys are visible: pass it to the attention call "
                        "as score_mod=")
    else:
        if mod_tensors is not None:
            raise TypeError(f"mod_tensors go with a mask mod (a MaskMod or a built-in's name); the mask is a "
                            f"{type(mask).__name__}")
        return mask, device
    tensors = mod.bind(mod_tensors or {}, sizes, name)
    if device == "cpu":
        on_gpu = [t for t, x in tensors.items() if not isinstance(x, np.ndarray)]
        if on_gpu:
            raise TypeError(f"with device='cpu' the mod tensors must be NumPy arrays; {on_gpu[0]!r} is a "
                            f"{type(tensors[on_gpu[0]]).__name__} (build on its GPU with device=None)")
        return mod.function(tensors, xp=np, name=name), device
    arrays = {t: as_array(x, f"mod tensor {t!r}") for t, x in tensors.items()}
    devices = {x.device.id for x in arrays.values()} | ({device} if device is not None else set())
    if len(devices) > 1:
        raise ValueError(f"the mod tensors and device= name different GPUs ({sorted(devices)}): build the mask "
                         "where its tensors are")
    return mod.function(arrays, xp=cupy_module(), name=name), next(iter(devices), None)


def _placed(mask, device):
    """(array module, device, mask): the mask's arrays moved to where the lists are built."""
    if device is not None and device != "cpu" and (isinstance(device, bool) or not isinstance(device, int)
                                                   or device < 0):
        raise ValueError(f"device must be None, a GPU index or 'cpu'; got {device!r}")
    on_gpu = not isinstance(mask, np.ndarray) and not callable(mask)
    if device == "cpu":
        if on_gpu:
            raise TypeError(f"with device='cpu' the mask must be a callable or a NumPy array; got "
                            f"{type(mask).__name__} (build on its GPU with device=None)")
        return np, None, mask
    cupy = cupy_module()
    if on_gpu:
        mask = as_array(mask, "mask")
        if device is not None and mask.device.id != device:
            raise ValueError(f"the mask is on GPU {mask.device.id}, device={device}")
        return cupy, mask.device.id, mask
    device = cupy.cuda.runtime.getDevice() if device is None else device
    if isinstance(mask, np.ndarray):
        with cupy.cuda.Device(device):
            mask = cupy.asarray(mask)
    return cupy, device, mask


def _check_mask_array(mask, shape):
    if mask.dtype != np.bool_:
        raise TypeError(f"a mask array must be boolean (True: the key is visible); got {mask.dtype} "
                        f"(an additive mask goes in attn_bias)")
    if not _broadcasts(mask.shape, shape):
        raise ValueError(f"the mask of shape {tuple(mask.shape)} does not broadcast to [B, H, M, N] = {shape}")


def _broadcasts(have, want) -> bool:
    return len(have) <= len(want) and all(h in (1, w) for h, w in zip(have[::-1], want[::-1]))


def _row_chunks(M: int, block_rows: int, row_elements: int):
    """(start, stop) of query-row chunks of whole blocks, each about CHUNK_ELEMENTS mask elements."""
    step = max(1, CHUNK_ELEMENTS // max(row_elements * block_rows, 1)) * block_rows
    return [(start, min(start + step, M)) for start in range(0, M, step)]


def _visible(mask, xp, shape, start: int, stop: int):
    """The element mask for query rows start:stop as a boolean [b, h, rows, N] (b, h: 1 or B, H)."""
    B, H, _, N = shape
    want = (B, H, stop - start, N)
    if callable(mask):
        got = xp.asarray(mask(xp.arange(B).reshape(B, 1, 1, 1), xp.arange(H).reshape(1, H, 1, 1),
                              xp.arange(start, stop).reshape(1, 1, -1, 1), xp.arange(N).reshape(1, 1, 1, N)))
        if got.dtype != np.bool_:
            raise TypeError(f"mask_fn must return a boolean array; it returned {got.dtype} "
                            f"(compare, e.g. q_idx >= kv_idx, rather than returning 0/1 or a bias)")
        if not _broadcasts(got.shape, want):
            raise ValueError(f"mask_fn returned shape {tuple(got.shape)} for rows {start}:{stop}, which does not "
                             f"broadcast to [B, H, rows, N] = {want}: combine the index arguments with "
                             f"broadcasting operators rather than reshaping them")
    else:
        got = mask[..., start:stop, :] if mask.ndim >= 2 and mask.shape[-2] != 1 else mask
    got = got.reshape((1,) * (4 - got.ndim) + tuple(got.shape))
    return xp.broadcast_to(got, got.shape[:2] + want[2:])


def _blocked(xp, visible, block):
    """``visible`` [b, h, rows, N] as [b, h, qb, block_m, kb, block_n] blocks, the ragged ends padded
    with hidden (False) elements."""
    (b, h, rows, N), (bm, bn) = visible.shape, block
    qb, kb = -(-rows // bm), -(-N // bn)
    if rows % bm or N % bn:
        padded = xp.zeros((b, h, qb * bm, kb * bn), dtype=bool)
        padded[:, :, :rows, :N] = visible
        visible = padded
    return visible.reshape(b, h, qb, bm, kb, bn)


def _classify(xp, blocks, rows: int, N: int):
    """(full, partial) flags [b, h, qb, kb] of ``_blocked``'s blocks of ``rows`` x ``N`` elements: full
    where every existing element is visible, partial where some but not all are."""
    _, _, qb, bm, kb, bn = blocks.shape
    counts = blocks.sum(axis=(3, 5), dtype=np.int32)
    sizes = (xp.minimum(bm, rows - bm * xp.arange(qb))[:, None] * xp.minimum(bn, N - bn * xp.arange(kb))[None, :])
    full = counts == sizes.astype(np.int32)
    return full, (counts > 0) & ~full


def _packed_partials(xp, blocks, partial, BH):
    """The element masks of a chunk's partial blocks, bit-packed, as uint32 [p, block_m, block_n / 32]
    in (query block, batch, head, key block) order; ``partial`` [B, H, qb, kb] flags them (``blocks``
    may have 1 for B or H: the mask broadcasts there)."""
    qb_i, b_i, h_i, kb_i = xp.nonzero(partial.transpose(2, 0, 1, 3))
    b_i = b_i if blocks.shape[0] == BH[0] else xp.zeros_like(b_i)
    h_i = h_i if blocks.shape[1] == BH[1] else xp.zeros_like(h_i)
    chosen = blocks[b_i, h_i, qb_i, :, kb_i, :]  # [p, block_m, block_n]: only the partial blocks
    p, bm, bn = chosen.shape
    weights = xp.left_shift(xp.uint32(1), xp.arange(32, dtype=np.uint32))  # bit j: key j of its 32
    return (chosen.reshape(p, bm, bn // 32, 32) * weights).sum(axis=-1, dtype=np.uint32)


def _partial_tiles(xp, partial, tiles, block):
    """``partial_index`` and ``partial_bits`` (see the module docstring) from the partial flags
    [B, H, QB, KB] and each chunk's packed tiles."""
    B, H, QB, KB = partial.shape
    order = partial.transpose(2, 0, 1, 3).reshape(-1).astype(np.int32)  # (qb, b, h, kb): the tiles' order
    numbered = (xp.cumsum(order, dtype=np.int32) - 1).reshape(QB, B, H, KB).transpose(1, 2, 0, 3)
    index = xp.ascontiguousarray(xp.where(partial, numbered, np.int32(-1)))
    bits = xp.concatenate(tiles) if sum(t.shape[0] for t in tiles) else xp.zeros((1, block[0], block[1] // 32),
                                                                                   dtype=np.uint32)
    return {"partial_index": index, "partial_bits": xp.ascontiguousarray(bits)}


def _listed(xp, flags):
    """(counts [.., R] int32, indices [.., R, C] int32) of boolean ``flags`` [.., R, C]: per row the
    flagged columns in ascending order, then the others in ascending order.  Sorting keys that
    put the unflagged columns after all flagged ones gives both orders in one sort, whatever
    the sort's stability."""
    C = flags.shape[-1]
    columns = xp.arange(C, dtype=np.int32)
    keys = xp.sort(xp.where(flags, columns, columns + C), axis=-1)
    indices = xp.where(keys < C, keys, keys - C).astype(np.int32)
    return flags.sum(axis=-1, dtype=np.int32), xp.ascontiguousarray(indices)
