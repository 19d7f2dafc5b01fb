"""Running ``sm80_fwd`` (spec/sm80_fwd.py): flashgen's Ampere-class forward, on 8.0 GPUs and later.

It takes the calls flashgen's Hopper forward takes (f16/bf16, equal q/v head dims, band
masks, soft-capping, grouped-query k/v read in place, packed batches), through the same
``Params`` fields, on any GPU from compute capability 8.0 on; on a 9.0 GPU ``sm90_fwd``
comes first in the dispatch order.  Its inputs only need 8-element (16-byte) alignment,
which selection checks per kernel.  An attention bias is compiled in, as in ``sm90_fwd``
(``bias`` instances): a call with one runs on those, one without on the others, and a bias call
that no bias instance takes (none built, a head dim past their tiers) is refused with each
kernel's reason, so example 41 takes it.  Dropout is compiled into ``dropout`` instances that
draw by the rule of the sm90 pair (``runtime/dropout.py``: a dropout call runs here when the sm80
pair draws its mask, in both directions).
"""
from __future__ import annotations

from flashgen.runtime import dropout, plans
from flashgen.runtime.arrays import cupy_module, elem_strides
from flashgen.runtime.families import visible_lse
from flashgen.runtime.families.sm90_common import (AmpereFamily, ampere_bias_fields, band_fields, check_compiled,
                                                   packed_ends, replay_forward, trailing_pointers,
                                                   zero_unpacked_rows)
from flashgen.runtime.launch import fill, handle, launch, params_buffer
from flashgen.runtime.limits import check_int32, lse_rows
from flashgen.runtime.registry import KernelBinary
from flashgen.runtime.validate import Call
from flashgen.spec.sm80_fwd import Sm80Fwd

POINTERS = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "lse_ptr")  # per-call pointers, in the order replay passes them
# a bias call's: its bias follows v among the caller's arrays (api.py's signature order)
BIAS_POINTERS = POINTERS[:3] + ("bias_ptr",) + POINTERS[3:]


class Sm80FwdRuntime(AmpereFamily):
    spec = Sm80Fwd

    def launch(self, call: Call, binary: KernelBinary):
        """(out, lse) of the forward on ``binary`` (on the call's device, api.py makes it current)."""
        check_compiled(binary, call)
        cupy, p, q, k, v = cupy_module(), call.p, call.q, call.k, call.v
        kc = binary.constants
        rows = lse_rows(p.M)
        out = cupy.empty((q.shape[0], q.shape[1], p.H, p.Kv), dtype=q.dtype)
        lse = cupy.empty((p.batches, p.H, rows), dtype=cupy.float32)
        qs, ks, vs = elem_strides(q), elem_strides(k), elem_strides(v)
        strides = dict(q_stride_m=qs[1], q_stride_h=qs[2], k_stride_m=ks[1], k_stride_h=ks[2], v_stride_m=vs[1],
                       v_stride_h=vs[2], out_stride_m=p.H * p.Kv, out_stride_h=p.Kv, lse_stride_b=p.H * rows,
                       lse_stride_h=rows)
        check_int32(**strides)
        params = params_buffer(Sm80Fwd)
        fill(params, q_ptr=q.data.ptr, k_ptr=k.data.ptr, v_ptr=v.data.ptr, out_ptr=out.data.ptr, lse_ptr=lse.data.ptr,
             q_stride_b=qs[0], k_stride_b=ks[0], v_stride_b=vs[0], out_stride_b=out.shape[1] * p.H * p.Kv,
             lse_rows=rows, num_queries=p.M, num_keys=p.N, num_heads=p.H, num_sequences=p.batches, head_dim=p.K,
             head_group=p.group, **strides, **band_fields(p), **ampere_bias_fields(call.bias),
             **dropout.fields(p))
        grid = (-(-p.M // kc["block_m"]), p.H, p.batches)
        block = (kc["threads_per_block"], 1, 1)
        launch(call.registry, binary, p.device, grid, block, params, call.stream)
        zero_unpacked_rows(p, out)
        if call.plan_key is not None:  # packed offsets' pointers end the plan's (``trailing``)
            trailing = trailing_pointers(call)
            plans.remember(call.plan_key, plans.LaunchPlan.from_params(
                handle(call.registry, binary, p.device), p.device, grid, block, kc["shared_memory_bytes"], params,
                (POINTERS if call.bias is None else BIAS_POINTERS) + trailing, p.dropout_p > 0,
                {"out": out.shape, "lse": lse.shape, "M": p.M, "trailing": len(trailing),
                 "packed_ends": packed_ends(p)}, family=self.name, rng_fields=dropout.RNG_FIELDS))
        return out, visible_lse(lse, p.M)

    def replay(self, plan, memory, arrays, seed, offset, stream):
        return replay_forward(plan, memory, arrays, stream, seed, offset)


RUNTIME = Sm80FwdRuntime()
