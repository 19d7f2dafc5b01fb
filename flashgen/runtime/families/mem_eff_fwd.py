"""Running ``mem_eff_fwd`` (spec/mem_eff_fwd.py): CUTLASS example 41's forward, on every GPU.

It takes what flashgen's Hopper kernels do not (bias, dropout, float32, q/v head
dims that differ, any 4-element alignment) but has no sliding window or
soft-capping, and needs one k/v head per q head: grouped-query k and v reach it
repeated.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from flashgen.runtime import dropout, limits, plans
from flashgen.runtime.arrays import alignment, cupy_module, elem_strides
from flashgen.runtime.device import device_info
from flashgen.runtime.families import RuntimeFamily, planned_forward_outputs, selector, tuned, visible_lse
from flashgen.runtime.launch import fill, handle, launch, on_device, params_buffer
from flashgen.runtime.limits import check_int32, lse_rows
from flashgen.runtime.registry import KernelBinary
from flashgen.runtime.select import Request
from flashgen.runtime.validate import Call, varlen_lengths
from flashgen.spec.mem_eff_fwd import MemEffFwd

POINTERS = ("query_ptr", "key_ptr", "value_ptr", "output_ptr", "output_accum_ptr", "logsumexp_ptr")


def unfit_example41(call: Call) -> Optional[str]:
    """What neither example-41 family has (both directions refuse the same calls), and the dropout
    calls whose mask one of flashgen's pairs draws: both directions must draw it alike (runtime/dropout.py)."""
    if call.p.window is not None or call.p.softcap:
        return ("no sliding window or soft-capping (flashgen's own kernels only, f16/bf16 with equal head dims: "
                "sm90_fwd/sm90_bwd on a 9.0 GPU, the sm80_fwd forward from 8.0 on)")
    if call.p.dropout_p > 0:
        pair, _ = dropout.drawing_pair(call)
        if pair is not None:
            return f"the {pair.name} pair draws this dropout call's mask, in both directions (runtime/dropout.py)"
        return limits.dropout_offsets_refusal(call.p)  # validation let it through for flashgen's pairs
    return None


def repeat_heads(x, heads: int):
    """[B, S, Hk, D] -> [B, S, heads, D], each k/v head repeated for its group of q heads."""
    return cupy_module().repeat(x, heads // x.shape[2], axis=2)


class MemEffFwdRuntime(RuntimeFamily):
    spec = MemEffFwd

    def unfit(self, call: Call) -> Optional[str]:
        return unfit_example41(call)

    def request(self, call: Call) -> Request:
        p = call.p
        arrays = [call.q, call.k, call.v] + ([call.bias] if call.bias is not None else [])
        return Request(self.name, p.dtype, p.K, p.Kv, alignment(arrays, (p.K, p.Kv)), p.dropout_p > 0,
                       call.bias is not None, device_info(p.device))

    def run(self, call: Call):
        if call.k.shape[2] != call.p.H:  # the kernels need one k/v head per q head
            # per-call copies: not a plan
            call = replace(call, k=repeat_heads(call.k, call.p.H), v=repeat_heads(call.v, call.p.H), plan_key=None)
        req = self.request(call)
        return self.launch(call, selector(call.registry).select(req, tuned(req, call.p)))

    def launch(self, call: Call, binary: KernelBinary):
        """(out, lse) on ``binary``, k and v with q's head count (on the call's device)."""
        cupy, p, q, k, v, bias = cupy_module(), call.p, call.q, call.k, call.v, call.bias
        kc = binary.constants
        out = cupy.empty((q.shape[0], q.shape[1], p.H, p.Kv), dtype=q.dtype)
        lse = cupy.empty((p.batches, p.H, lse_rows(p.M)), dtype=cupy.float32)
        accum = cupy.empty(out.shape, dtype=cupy.float32) if kc["needs_output_accum_buffer"] else None
        qs, ks, vs = elem_strides(q), elem_strides(k), elem_strides(v)
        bs = elem_strides(bias) if bias is not None else (0, 0, 0, 0)
        check_int32(q_strideM=qs[1], k_strideM=ks[1], v_strideM=vs[1], q_strideH=qs[2], k_strideH=ks[2],
                    v_strideH=vs[2], bias_strideM=bs[2], o_strideM=p.H * p.Kv, num_queries=q.shape[1],
                    num_keys=k.shape[1])
        params = params_buffer(MemEffFwd)
        fill(params, query_ptr=q.data.ptr, key_ptr=k.data.ptr, value_ptr=v.data.ptr,
             attn_bias_ptr=bias.data.ptr if bias is not None else 0,
             seqstart_q_ptr=p.seqstart_q.data.ptr if p.seqstart_q is not None else 0,
             seqstart_k_ptr=p.seqstart_k.data.ptr if p.seqstart_k is not None else 0,
             output_ptr=out.data.ptr, output_accum_ptr=accum.data.ptr if accum is not None else 0,
             logsumexp_ptr=lse.data.ptr, scale=p.scale, head_dim=p.K, head_dim_value=p.Kv,
             num_queries=p.M, num_keys=p.N, num_keys_absolute=p.N, custom_mask_type=p.mask,
             q_strideM=qs[1], k_strideM=ks[1], v_strideM=vs[1], bias_strideM=bs[2], o_strideM=p.H * p.Kv,
             q_strideH=qs[2], k_strideH=ks[2], v_strideH=vs[2], bias_strideH=bs[1],
             q_strideB=qs[0], k_strideB=ks[0], v_strideB=vs[0], bias_strideB=bs[0],
             num_batches=p.batches, num_heads=p.H, use_dropout=p.dropout_p > 0, dropout_prob=p.dropout_p,
             rng_engine_inputs_seed=p.seed, rng_engine_inputs_offset=p.offset)
        grid = (-(-p.M // kc["queries_per_block"]), p.H, p.batches)
        block = (32, kc["warps_per_block"], 1)
        launch(call.registry, binary, p.device, grid, block, params, call.stream)
        if call.plan_key is not None and p.seqstart_q is None and bias is None:  # replay passes no bias
            plans.remember(call.plan_key, plans.LaunchPlan.from_params(
                handle(call.registry, binary, p.device), p.device, grid, block, kc["shared_memory_bytes"], params,
                POINTERS, p.dropout_p > 0, {"out": out.shape, "lse": lse.shape, "accum": accum is not None, "M": p.M},
                family=self.name))
        if p.seqstart_q is not None:  # a sequence with queries but no keys: 0/0 in the kernel
            starts, q_lens, k_lens = varlen_lengths(p)
            for seq in np.nonzero((q_lens > 0) & (k_lens == 0))[0]:
                out[0, starts[seq]:starts[seq + 1]] = 0
                lse[seq, :, :q_lens[seq]] = -np.inf
        return out, visible_lse(lse, p.M)

    def replay(self, plan, memory, arrays, seed, offset, stream):
        sizes, ptr = plan.sizes, memory.ptr
        q, k, v = arrays
        with on_device(cupy_module(), plan.device):
            out, lse = planned_forward_outputs(memory, sizes, q)
            accum = memory.empty(sizes["out"], q, f32=True) if sizes["accum"] else None
            plan.launch((ptr(q), ptr(k), ptr(v), ptr(out), ptr(accum) if accum is not None else 0, ptr(lse)),
                        seed or 0, offset, memory.stream(stream, plan.device))
        return out, visible_lse(lse, sizes["M"])


RUNTIME = MemEffFwdRuntime()
