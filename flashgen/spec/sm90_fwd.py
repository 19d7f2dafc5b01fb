"""``sm90_fwd``: flashgen's own Hopper forward (``flashgen/csrc/flashgen/sm90_fwd.h``).

Template: ``flashgen::sm90::FwdKernel<Element, kHeadDim, kBlockM, kBlockN,
kStages, kBand, kBias, kSparse, kStagedO, kDropout, ScoreMod_>`` -- wgmma tiles of 64 query rows per consumer warpgroup,
K/V streamed by TMA through a ``kStages``-deep shared-memory ring, one
producer warpgroup.  Launch: block (threads_per_block, 1, 1), a persistent
grid (min(tiles, SMs), 1, 1) over the ceil(M / block_m) x heads x (batch or
sequences) tiles, which ``FwdKernel::Schedule`` hands out (band instances in
pairs); dynamic shared memory ``shared_memory_bytes``.  Built only for ``sm_90a`` (wgmma and setmaxnreg do
not exist in plain sm_90 code).

Inputs reach the kernel as TMA tensor maps (``runtime/tensormap.py``): every
pointer and every stride of a dimension longer than 1 must be a multiple of 16
bytes.  A head dim below the kernel's ``max_k`` works (TMA reads the missing
columns as zeros and the kernel does not store them) as long as it is a multiple
of 8.  The lse is written like the example-41 forward's: [B, H, rows padded to
32], +inf in the padding, so the mem-eff backward takes it as it is.

Masks: a ``band`` instance shows query i the keys i + band_lo .. i + band_hi
(``runtime/families/sm90_common.band``: causal masks and sliding windows, either alignment) and
skips the key blocks outside; the others show every key.  Soft-capping is a
run-time option of every instance: ``softcap_in`` = scale / softcap (0: off),
``softcap_out`` = softcap / scale.

Packed (varlen) batches are a run-time option too: ``seqstart_q/k`` point at
the int32 [S+1] offsets of S sequences packed along dim 1 of a batch of 1
(nullptr: fixed length), M is the longest sequence's length and the lse is
[S, H, rows]; with ``band_from_end`` every sequence's band is shifted onto its
own bottom-right diagonal (the runtime then passes the top-left bounds).

A ``bias`` instance adds a bias [B, H, M, N] to the scaled, soft-capped scores before the mask
and the softmax.  It reads it through the tensor map ``bias_map`` (``runtime/tensormap.bias_view``:
extent 1 in each dim the bias broadcasts, boxes of 64 keys x 64 rows, 128-byte swizzle), a tile
per key block through a shared-memory ring beside K/V's; ``bias_batch_step``, ``bias_head_step``
and ``bias_row_step`` are 0 for a broadcast dim (read at coordinate 0), else 1.  It is compiled
in: the plain instances do not carry its ring.  No packed batches.

A ``sparse`` instance serves a ``flashgen.block_mask`` of 128 x 128 blocks (its tile): it visits only
the key blocks the mask lists for each (batch, head, query block), partial ones first, and hides the
keys of a partial block whose bit in the mask's ``partial_bits`` is 0 (``runtime/block_masks.py``
documents the arrays).  The ``sparse_*`` fields point at the lists; ``sparse_batch_step`` and
``sparse_head_step`` step through the mask's rows (0 where it broadcasts).  Compiled in, like the
bias; a causal mask or a window is folded into the block mask rather than combined with it.

A ``staged_o`` instance stores O through shared memory (stmatrix, then whole rows in 16-byte stores)
for tiles of at most 16 key blocks; its constant ``staged_max_key_blocks`` is the most key blocks a
call may have for the runtime to send it there (0: any, in band instances, whose tiles near the
diagonal visit few blocks).  Longer unmasked calls take a tile without the path (its code slowed the
main loop by 2-4% at 4k-16k keys even where it was not taken): at head dim 128 the 176-key tile, whose
longer key blocks mean fewer row-max and rescale rounds (+3-9% over its 128-key twin at 4k-16k keys on
an H200); the twin stays for the tuning tables.

A ``dropout`` instance drops elements of P after the softmax (the lse and the normalisation are of
the whole P) and scales O by ``dropout_scale`` = 1 / (1 - p): element (sequence, head, row, key) is
kept when its 8 Philox-4x32-10 bits, drawn from ``dropout_seed`` and ``dropout_offset`` by the rule
in ``flashgen/csrc/flashgen/dropout.h`` (``runtime/dropout.py``), are below
``dropout_keep`` (of 256).  ``sm90_bwd``'s dropout instances redraw the same mask; each dropout instance here
has a backward twin (same dtype, tier and band).  Compiled in, like the bias.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashgen.spec.core import DTYPES, Constant, Field, Rule
from flashgen.spec.contract import DROPOUT_FIELDS, FORWARD_OUTPUT_FIELDS, FORWARD_SHAPE_FIELDS
from flashgen.spec.sm90_tile import (MOD_FIELDS, SCORE_MOD_AXIS, SPARSE_POINTER_FIELDS, Sm90Tile, score_mod_rules,
                                    tile_constants)


@dataclass(frozen=True)
class Sm90Fwd(Sm90Tile):
    bias: bool  # an additive attention bias compiled in (FwdKernel::kBias)
    sparse: bool  # a block mask's lists and bits compiled in (FwdKernel::kSparse)
    staged_o: bool  # O stored through shared memory for tiles of few key blocks (FwdKernel::kStagedO)
    dropout: bool  # Philox dropout of P compiled in (FwdKernel::kDropout)
    score_mod: str  # a score mod compiled in (FwdKernel's ScoreMod_, spec/score_mods.py); "": none

    FAMILY = "sm90_fwd"
    DIRECTION = "fwd"
    TEMPLATE = "sm90_fwd.cu.j2"
    HEADER = "flashgen/sm90_fwd.h"
    KERNEL = "flashgen::sm90::FwdKernel"
    FLAGS = ("band", "bias", "sparse", "staged_o", "dropout")
    AXES = {
        "arch": ("sm90a",),
        "dtype": ("f16", "bf16"),
        "max_k": (64, 96, 128, 192, 256),
        "block_m": (128, 192),
        "block_n": (128, 112, 80, 176),
        "stages": (2, 3),
        "band": (False, True),
        "bias": (False, True),
        "sparse": (False, True),
        "staged_o": (False, True),
        "dropout": (False, True),
        "score_mod": SCORE_MOD_AXIS,
    }
    RULES = (
        Rule("192 query rows are three consumer warpgroups beside the producer's: at most 160 registers "
             "each, which only head dim 64 fits without spilling",
             lambda k: k.block_m == 192 and k.max_k > 64),
        Rule("the Q tile, the K and V rings (and the bias ring with its 1 KB of barriers) exceed the 227 KB of "
             "shared memory of a Hopper block",
             lambda k: 2 * k.max_k * (k.block_m + 2 * k.stages * k.block_n) + 1024 + 256
             + k.bias * (2 * k.stages * k.block_m * k.block_n + 1024) > 227 * 1024),
        Rule("one key-tile width per head-dim tier: 128 up to head dim 128, else the widest whose two "
             "K/V stages fit beside the Q tile (112 for 192, 80 for 256)",
             lambda k: k.block_n != {192: 112, 256: 80}.get(k.max_k, 128) and k.block_n != 176),
        Rule("176 keys only on head dim 128's plain unmasked two-stage tile, the one long calls take: "
             "fewer row-max and rescale rounds per key where the key loop is long",
             lambda k: k.block_n == 176 and (k.max_k != 128 or k.band or k.bias or k.sparse or k.dropout
                                             or bool(k.score_mod) or k.staged_o or k.stages != 2)),
        # bias: only the tiles the priority order picks, on three tiers (each instance is a build job)
        Rule("bias on tiers 64 and 128 only: 96 runs on 128 (TMA zero-fills); 192 and 256 leave no room for a "
             "bias ring beside their K/V rings, and such calls stay on example 41",
             lambda k: k.bias and k.max_k not in (64, 128)),
        Rule("bias instances keep the default two stages: a third never won by more than noise",
             lambda k: k.bias and k.stages != 2),
        Rule("band bias at head dim 64 takes 128 query rows: the 192-row band tile spills 4 bytes (a value "
             "reloaded once per tile) at 160 registers per consumer",
             lambda k: k.bias and k.band and k.block_m == 192),
        # sparse: one tile per dtype and tier (each instance is a build job)
        Rule("sparse tiles are the block mask's 128 x 128 blocks (flashgen.block_mask's default)",
             lambda k: k.sparse and (k.block_m, k.block_n) != (128, 128)),
        Rule("sparse on tiers 64 and 128 only: smaller head dims run on them (TMA zero-fills), larger ones "
             "stay on the dense fallback",
             lambda k: k.sparse and k.max_k not in (64, 128)),
        Rule("sparse instances keep the default two stages", lambda k: k.sparse and k.stages != 2),
        Rule("sparse without band: a causal mask or window is folded into the block mask",
             lambda k: k.sparse and k.band),
        Rule("sparse without bias: such calls stay on the dense fallback", lambda k: k.sparse and k.bias),
        # staged_o: measured on an H200 against the register stores, same run
        Rule("staged O at head dim 128 only: at 64 it gained nothing and lost 4% from 4k tokens on",
             lambda k: k.staged_o and k.max_k != 128),
        Rule("staged O on the plain two-stage tiles only: its O tile leaves no room for a bias ring or a "
             "third stage, and the sparse tiles keep their loop as measured",
             lambda k: k.staged_o and (k.bias or k.sparse or k.stages != 2)),
        Rule("staged O not with dropout: its keep bits take the registers the staged store needs",
             lambda k: k.staged_o and k.dropout),
        Rule("staged O not with score mods: a mod's registers beside the staged store's, on tiles measured "
             "as they are", lambda k: k.staged_o and bool(k.score_mod)),
        Rule("the plain band tile at head dim 128 is built staged only: it serves every length (its tiles "
             "near the diagonal visit few blocks, +3-7% at 512-2k tokens, even beyond)",
             lambda k: k.band and not k.staged_o and k.max_k == 128 and not (k.bias or k.sparse or k.dropout or k.score_mod)
             and k.stages == 2),
        # dropout: one instance per dtype, tier and band, each with a backward twin (a call's mask is
        # drawn by both directions' instances or by neither)
        Rule("dropout on tiers 64 and 128, the backward's (its 256 tier splits the head dim); 96 runs on 128",
             lambda k: k.dropout and k.max_k not in (64, 128)),
        Rule("dropout on 128 query rows and two stages: 192 rows leave 160 registers per consumer, none for the "
             "keep bits", lambda k: k.dropout and (k.block_m != 128 or k.stages != 2)),
        Rule("dropout without bias or block-mask lists: such calls stay on example 41",
             lambda k: k.dropout and (k.bias or k.sparse)),
        # score mods: one tile per dtype, tier and band (each mod's instances are build jobs)
        *score_mod_rules("score mods on tiers 64 and 128 only: smaller head dims run on them (TMA zero-fills); "
                         "larger ones are not built"),
        Rule("score mods on the default tile of their tier: two stages, 128 keys, 192 query rows at head dim 64",
             lambda k: k.score_mod and (k.block_m, k.block_n, k.stages) != (192 if k.max_k == 64 else 128, 128, 2)),
    )

    @property
    def priority(self) -> tuple:
        # the smallest head-dim tier that fits, then the default tile (tuning tables pick per bucket):
        # 192 query rows where they exist (head dim 64: +5-15% from 512 to 16k tokens on an H200,
        # within noise of 128 for causal 1k), two stages (a third never won by more than noise), the
        # staged-O tile before its twins (it refuses calls of more key blocks than it serves), then the
        # widest key tile (head dim 128's 176-key tile for long unmasked calls)
        return (tuple(DTYPES).index(self.dtype), self.band, self.bias, self.sparse, self.dropout, self.score_mod,
                self.max_k, -self.block_m, self.stages, not self.staged_o, -self.block_n)

    # `flashgen::sm90::FwdParams`
    ABI = (
        Field("q_map", "tensor_map"),
        Field("k_map", "tensor_map"),
        Field("v_map", "tensor_map"),
        Field("out_ptr", "ptr"),
        Field("lse_ptr", "ptr"),
        Field("out_stride_b", "i64"),
        *FORWARD_OUTPUT_FIELDS,
        Field("seqstart_q", "ptr"),
        Field("seqstart_k", "ptr"),
        *FORWARD_SHAPE_FIELDS,
        Field("bias_batch_step", "i32"),
        Field("bias_head_step", "i32"),
        Field("bias_row_step", "i32"),
        Field("bias_map", "tensor_map"),
        *SPARSE_POINTER_FIELDS,
        Field("sparse_batch_step", "i32"),
        Field("sparse_head_step", "i32"),
        Field("sparse_key_blocks", "i32"),
        *DROPOUT_FIELDS,
        *MOD_FIELDS,
    )

    CONSTANTS = tile_constants("flashgen::sm90::FwdParams") + (
        Constant("staged_max_key_blocks", "Kernel::kServedKeyBlocks"),
    )
