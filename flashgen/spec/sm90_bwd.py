"""``sm90_bwd``: flashgen's own Hopper backward (``flashgen/csrc/flashgen/sm90_bwd.h``).

Template: ``flashgen::sm90::BwdKernel<Element, kHeadDim, kBlockM, kBlockN,
kStages, kBand, kSoftcap, kBias, kSparse, kDropout, ScoreMod_>`` -- one CTA per ``block_n`` keys of one (sequence, k/v head),
one consumer warpgroup per 64 of them, Q/dO/lse/delta streamed by a producer
warpgroup through a ``kStages``-deep ring of ``block_m``-query tiles.  Each instance
holds three entry points, launched in order on one stream:

* ``<name>_prep``: grid (ceil(M / block_m), heads, batch or sequences), ``aux_threads``
  threads -- delta, the lse in log2, zeroed dQ accumulator and counters;
* ``<name>``: grid (ceil(N / block_n), k/v heads, batch or sequences), ``threads_per_block``
  threads, ``shared_memory_bytes`` of dynamic shared memory;
* ``<name>_convert``: grid as prep -- dQ from the fp32 accumulator.

Workspace (float32 unless said): lse_log2 and delta [B, H, rows_padded], the dQ
accumulator [B, H, rows_padded, max_k], int32 counters for the deterministic
order [B, H, rows_padded / block_m]; rows_padded is M rounded up
to ``block_m``.  Packed (varlen) batches (``seqstart_q/k`` as in ``sm90_fwd``, M and N
the longest sequence's lengths, B = 1): sequence b's workspace rows start at
floor((seqstart_q[b] + b * block_m) / block_m) * block_m, and rows_padded is
floor((total queries + S * block_m) / block_m) * block_m.  q, k, v and dO reach the kernel as TMA tensor maps (16-byte
aligned pointers and strides, head dim a multiple of 8, up to ``max_k``); O as a
pointer with the same alignment.  dq, dk, dv are written with the strides given.
Masks and soft-capping as in ``sm90_fwd`` (the same ``band_lo``/``band_hi`` and
``softcap_in``/``softcap_out`` fields), but soft-capping needs a ``softcap`` instance.
A ``bias`` instance reads the bias through ``bias_map`` and the ``bias_*_step`` fields as the
forward does (a step's tile into the dS buffer the step writes later: no extra shared memory)
and, where ``dbias_ptr`` is not null, writes dS (the gradient of the biased score, in the input
dtype) into dbias [B, H, M, N] (rows of ``dbias_row_stride`` elements, packed otherwise) by TMA
stores through ``dbias_map`` (the bias map's boxes, as wide as the row pitch) at every (query, key)
its CTAs visit; the rest is the caller's, except where the constant ``zeroes_hidden_dbias`` is 1
(band bias instances): their main kernel writes the zeros outside the band too, for fixed-length
batches.  A bias instance's ``_dbias_sum`` kernel then adds dbias's planes over the batch or heads
where the caller's bias has extent 1 (``dbias_sum_*``), in float, rounded once; or, with
``dbias_add`` (the constant ``adds_dbias``), the main kernel adds its tiles straight into a zeroed
gradient of the bias's shape by TMA reduce-adds in the input dtype (no planes, no fixed order).

A ``sparse`` instance serves a ``flashgen.block_mask`` of 128 x 128 blocks, the forward's: the CTA of a
key block visits only the query blocks the mask's transposed lists (``q_*``) give for it, per query
head of its k/v group, partial ones first, each in 128 / ``block_m`` steps, and zeroes P (so dS) where
a partial block's bit is 0.  The ``sparse_*`` fields point at the lists, ``partial_index`` and
``partial_bits``; ``sparse_batch_step`` (H of the mask, 0 where it broadcasts the batch) and
``sparse_head_step`` (1, or 0 where it broadcasts the heads) pick a (batch, head)'s plane of them,
``sparse_query_blocks`` and ``sparse_key_blocks`` are the mask's block counts.  No deterministic order
(``deterministic`` must be 0), no packed batches.

A ``dropout`` instance redraws the mask of ``sm90_fwd``'s dropout twin (same ``dropout_*`` fields, the
rule in ``flashgen/csrc/flashgen/dropout.h``): dV = (P o mask)^T dO / (1 - p) and dS = P o (dP o mask /
(1 - p) - delta), delta = rowsum(dO * O) of the dropped output O.

An 80-query instance (``block_m`` 80, head dim 128) computes dQ transposed, which changes no field;
its constant ``min_queries`` (1024) is the fewest queries a sequence of a call it serves (shorter
calls take the 64-query tile); 0 elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass

from flashgen.spec.core import DTYPES, Constant, Field, Rule
from flashgen.spec.contract import (BACKWARD_BATCH_STRIDE_FIELDS, BACKWARD_POINTER_FIELDS, BACKWARD_SHAPE_FIELDS,
                                     DROPOUT_FIELDS)
from flashgen.spec.sm90_tile import (MOD_FIELDS, SCORE_MOD_AXIS, SPARSE_POINTER_FIELDS, Sm90Tile, score_mod_rules,
                                    tile_constants)


@dataclass(frozen=True)
class Sm90Bwd(Sm90Tile):
    softcap: bool  # soft-capping compiled in: it needs registers the plain path spares (BwdKernel::kSoftcap)
    bias: bool     # an additive attention bias, and dbias, compiled in (BwdKernel::kBias)
    sparse: bool   # a block mask's transposed lists and bits compiled in (BwdKernel::kSparse)
    dropout: bool  # the forward's Philox dropout mask, redrawn (BwdKernel::kDropout)
    score_mod: str  # a score mod compiled in (BwdKernel's ScoreMod_, spec/score_mods.py); "": none

    FAMILY = "sm90_bwd"
    DIRECTION = "bwd"
    TEMPLATE = "sm90_bwd.cu.j2"
    HEADER = "flashgen/sm90_bwd.h"
    KERNEL = "flashgen::sm90::BwdKernel"
    FLAGS = ("band", "softcap", "bias", "sparse", "dropout")
    AXES = {
        "arch": ("sm90a",),
        "dtype": ("f16", "bf16"),
        "max_k": (64, 128, 192, 256),
        "block_m": (64, 80, 128),
        "block_n": (128, 64),
        "stages": (2,),
        "band": (False, True),
        "softcap": (False, True),
        "bias": (False, True),
        "sparse": (False, True),
        "dropout": (False, True),
        "score_mod": SCORE_MOD_AXIS,
    }
    RULES = (
        Rule("a 64-query step of head dim 64 would split dQ into 32-column halves, less than one "
             "128-byte swizzle atom per warpgroup",
             lambda k: k.max_k == 64 and k.block_m == 64),
        Rule("128 queries at head dim 128 need 256 accumulator registers per thread (S, dP, dK, dV); "
             "setmaxnreg gives a consumer 240",
             lambda k: k.max_k == 128 and k.block_m == 128),
        Rule("80-query steps (dQ leaves transposed) only for the plain head-dim-128 tile: bias, block masks, "
             "dropout, soft-capping and score mods keep the 64-query step their code is laid out for",
             lambda k: k.block_m == 80 and (k.max_k != 128 or k.softcap or k.bias or k.sparse or k.dropout
                                             or k.score_mod)),
        Rule("head dims 192 and 256 split their columns between the two warpgroups of one 64-key, 64-query "
             "tile (BwdKernel::kSplitCols): dK and dV of 64 keys fill a warpgroup's registers at 128 already",
             lambda k: k.max_k > 128 and (k.block_n != 64 or k.block_m != 64)),
        Rule("64-key CTAs are for the split head dim only: up to 128 two warpgroups of 64 keys each "
             "share one K/V load",
             lambda k: k.block_n == 64 and k.max_k <= 128),
        Rule("bias up to head dim 128 (as in the forward): the split head dim would load and write a step's "
             "bias twice, once per warpgroup; such calls stay on example 41",
             lambda k: k.bias and k.max_k > 128),
        Rule("no soft-capping with bias at head dim 64: tanh's slope beside a 128-query step's bias and dbias "
             "spills 284 bytes; such calls run on the 128 tier's instance (TMA reads zeros past head dim 64)",
             lambda k: k.bias and k.softcap and k.max_k == 64),
        # sparse: one instance per dtype and tier (each is a build job)
        Rule("sparse on tiers 64 and 128 only: smaller head dims run on them (TMA zero-fills); the split head "
             "dim's 64-key CTAs are half a mask block, and such calls stay on the dense fallback",
             lambda k: k.sparse and k.max_k not in (64, 128)),
        Rule("sparse without band: a causal mask or window is folded into the block mask",
             lambda k: k.sparse and k.band),
        Rule("sparse without soft-capping: its slope's registers beside the mask's are not built; such calls "
             "are refused (the dense fallback has no soft-capping either)",
             lambda k: k.sparse and k.softcap),
        Rule("sparse without bias: such calls stay on the dense fallback", lambda k: k.sparse and k.bias),
        # dropout: the forward's twins (each tier has one tile here)
        Rule("dropout up to head dim 128, as in the forward: the split head dim would draw each mask twice",
             lambda k: k.dropout and k.max_k > 128),
        Rule("dropout without soft-capping, bias or block-mask lists: the forward's twins have none; such calls "
             "stay on example 41", lambda k: k.dropout and (k.softcap or k.bias or k.sparse)),
        # score mods: one instance per dtype, tier and band (each mod's instances are build jobs)
        *score_mod_rules("score mods on tiers 64 and 128 only: smaller head dims run on them (TMA zero-fills); "
                         "the split head dim is not built"),
        Rule("score mods without soft-capping: soft-capping is a score mod of its own (tanh in the mod's expression)",
             lambda k: k.score_mod and k.softcap),
    )

    @property
    def priority(self) -> tuple:
        # 80-query steps first where built (the plain head-dim-128 tile): fewer steps, each reading K
        # and V for more queries
        return (tuple(DTYPES).index(self.dtype), self.band, self.softcap, self.bias, self.sparse, self.dropout,
                self.score_mod, self.max_k, self.block_m % 64 == 0, self.block_m, self.stages, self.block_n)

    # `flashgen::sm90::BwdParams`
    ABI = (
        Field("q_map", "tensor_map"),
        Field("k_map", "tensor_map"),
        Field("v_map", "tensor_map"),
        Field("do_map", "tensor_map"),
        *BACKWARD_POINTER_FIELDS,
        *BACKWARD_BATCH_STRIDE_FIELDS,
        *BACKWARD_SHAPE_FIELDS,
        Field("dbias_sum_ptr", "ptr"),
        Field("dbias_sum_batch", "i32"),
        Field("dbias_sum_heads", "i32"),
        Field("dbias_add", "i32"),
        Field("bias_batch_step", "i32"),
        Field("bias_head_step", "i32"),
        Field("bias_row_step", "i32"),
        Field("bias_map", "tensor_map"),
        Field("dbias_map", "tensor_map"),
        *SPARSE_POINTER_FIELDS,
        Field("sparse_batch_step", "i32"),
        Field("sparse_head_step", "i32"),
        Field("sparse_query_blocks", "i32"),
        Field("sparse_key_blocks", "i32"),
        *DROPOUT_FIELDS,
        *MOD_FIELDS,
    )

    # prep and convert run aux_threads threads; a sparse instance reads mask blocks of mask_rows queries
    # (its block_m-query steps cover them in turn) and block_n keys
    CONSTANTS = tile_constants("flashgen::sm90::BwdParams") + (Constant("aux_threads", "Kernel::kAuxThreads"),
                                                                Constant("mask_rows", "Kernel::kMaskRows"),
                                                                Constant("min_queries", "Kernel::kMinQueries"),
                                                                Constant("zeroes_hidden_dbias",
                                                                         "Kernel::kZeroesHiddenDbias"),
                                                                Constant("adds_dbias", "Kernel::kAddsDbias"))
