"""Running ``sm90_fwd`` (spec/sm90_fwd.py): Params with three TMA tensor maps, one launch.

A call with a ``block_mask`` runs here, sparse, when a ``sparse`` instance reads the mask's blocks
(selection matches their size with the kernel's tile, from the cubin's constants) and the call has
nothing such an instance lacks (``block_mask_refusal``); else the mask goes dense (block_fallback).
Such a call leaves a launch plan like any other: the mask's arrays end its signature (api.py) and their
pointers follow out's and lse's (SPARSE_POINTERS), so a replay reads the call's own mask; a score
mod's captured tensors do the same (``trailing_pointers``).
"""
from __future__ import annotations

import contextlib
from dataclasses import replace

import numpy as np

from flashgen.runtime import dropout, plans
from flashgen.runtime.arrays import cupy_module
from flashgen.runtime.device import device_info
from flashgen.runtime.families import visible_lse
from flashgen.runtime.families.sm90_common import (SPARSE_POINTERS, HopperFamily, band_fields, bias_fields,
                                                   check_compiled, encode_bias_map, encode_maps, mod_fields,
                                                   packed_ends, replay_forward, sparse_refusal, trailing_pointers,
                                                   zero_unpacked_rows)
from flashgen.runtime.launch import fill, handle, launch, params_buffer
from flashgen.runtime.limits import check_int32, lse_rows
from flashgen.runtime.registry import KernelBinary
from flashgen.runtime.validate import Call
from flashgen.spec.sm90_fwd import Sm90Fwd

MAPS = ("q_map", "k_map", "v_map")
POINTERS = ("out_ptr", "lse_ptr")  # per-call pointers after the tensor maps', in Params order (a mask's follow)


# float32's smallest normal: as a zero scale, it gives every visible key the weight 1.0 exactly
# (each exp2 argument stays under 2**-24 while |q.k| < 2**100)
SMALLEST_SCALE = float(np.finfo(np.float32).tiny)


def _positive_scale(call: Call) -> Call:
    """The same forward with a positive scale, the only sign the kernel orders scores right for:
    it takes each row's running max on q.k and scales it after (one FMA per score; handling the
    sign inside measured 2-3% slower).  A negative scale is |scale| on -q (negation is exact: a
    flip of the sign bit, on the call's stream); zero makes every score 0, soft-capped or not,
    which the smallest normal float32 scale does too.  Neither call leaves a plan (a replay would
    skip the negation)."""
    p = call.p
    if p.scale == 0:
        return replace(call, p=replace(p, scale=SMALLEST_SCALE, softcap=0.0), plan_key=None)
    cupy = cupy_module()
    with call.stream if call.stream is not None else contextlib.nullcontext():
        bits = call.q.view(cupy.uint16) ^ cupy.uint16(0x8000)  # f16 and bf16 keep the sign in bit 15
    return replace(call, q=bits.view(call.q.dtype), p=replace(p, scale=-p.scale), plan_key=None)


def sparse_fields(block_mask) -> dict:
    """The Params fields of a block mask (``FwdParams``' sparse_*): its arrays' pointers, and the steps
    from (batch, head) to its rows, 0 where it broadcasts; nothing without one."""
    if block_mask is None:
        return {}
    B, H = block_mask.shape[:2]
    QB, KB = block_mask.num_blocks
    pointers = {name: x.data.ptr for name, x in zip(SPARSE_POINTERS, block_mask.kernel_arrays())}
    return {**pointers, "sparse_batch_step": H * QB if B > 1 else 0, "sparse_head_step": QB if H > 1 else 0,
            "sparse_key_blocks": KB}


class Sm90FwdRuntime(HopperFamily):
    spec = Sm90Fwd
    reads_block_masks = True

    def block_mask_refusal(self, call: Call):
        """What of a block-mask call the sparse instances lack, or None (``sparse_refusal``)."""
        return sparse_refusal(call)

    def launch(self, call: Call, binary: KernelBinary):
        """(out, lse) of the forward on ``binary`` (on the call's device, api.py makes it current)."""
        check_compiled(binary, call)
        if call.p.scale <= 0:
            call = _positive_scale(call)
        cupy, p, q, k, v = cupy_module(), call.p, call.q, call.k, call.v
        kc = binary.constants
        rows = lse_rows(p.M)
        out = cupy.empty((q.shape[0], q.shape[1], p.H, p.Kv), dtype=q.dtype)
        lse = cupy.empty((p.batches, p.H, rows), dtype=cupy.float32)
        check_int32(lse_stride_b=p.H * rows)
        params = params_buffer(Sm90Fwd)
        fill(params, out_ptr=out.data.ptr, lse_ptr=lse.data.ptr, out_stride_b=out.shape[1] * p.H * p.Kv,
             out_stride_m=p.H * p.Kv, out_stride_h=p.Kv, lse_stride_b=p.H * rows, lse_stride_h=rows,
             lse_rows=rows, num_queries=p.M, num_keys=p.N, num_heads=p.H, num_sequences=p.batches, head_dim=p.K,
             head_group=p.group, **band_fields(p), **bias_fields(call.bias),
             **sparse_fields(call.block_mask), **dropout.fields(p), **mod_fields(call))
        encode_maps(params, MAPS, (q, k, v), (kc["block_m"], kc["block_n"], kc["block_n"]), p, kc)
        encode_bias_map(params, call.bias, p)
        tiles = -(-p.M // kc["block_m"]) * p.H * p.batches
        # persistent: a CTA per SM (one fits, see the spec), each walking its share of the work units
        # (FwdKernel::Schedule: tiles, or pairs of them); a CTA that finds no unit left exits at once
        grid = (min(tiles, device_info(p.device).multiprocessors), 1, 1)
        block = (kc["threads_per_block"], 1, 1)
        launch(call.registry, binary, p.device, grid, block, params, call.stream)
        zero_unpacked_rows(p, out)
        # a bias's map follows q's, k's and v's (replay: the arrays in order); a block mask's, a score
        # mod's or packed offsets' arrays end the call's, their pointers the plan's (``trailing``)
        if call.plan_key is not None:
            trailing = trailing_pointers(call)
            plans.remember(call.plan_key, plans.LaunchPlan.from_params(
                handle(call.registry, binary, p.device), p.device, grid, block, kc["shared_memory_bytes"], params,
                POINTERS + trailing, p.dropout_p > 0,
                {"out": out.shape, "lse": lse.shape, "M": p.M, "trailing": len(trailing),
                 "packed_ends": packed_ends(p)},
                tensor_maps=MAPS + (() if call.bias is None else ("bias_map",)), family=self.name,
                rng_fields=dropout.RNG_FIELDS))
        return out, visible_lse(lse, p.M)

    def replay(self, plan, memory, arrays, seed, offset, stream):
        return replay_forward(plan, memory, arrays, stream, seed, offset)


RUNTIME = Sm90FwdRuntime()
