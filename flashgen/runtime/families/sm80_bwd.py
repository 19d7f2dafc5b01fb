"""Running ``sm80_bwd`` (spec/sm80_bwd.py): flashgen's Ampere-class backward, on 8.0 GPUs and later.

Three kernels (prep, main, convert) over one allocation, as ``sm90_bwd`` runs them: the
outputs and the workspace are carved by that family's ``layout`` and ``buffers`` (the kernels
share its workspace layout), so a training step costs one pool call per backward.  What the
family takes and refuses is what flashgen's Ampere-class families share (``AmpereFamily``),
with ``out`` and ``grad_out`` read at the inputs' 8-element alignment too.
"""
from __future__ import annotations

from flashgen.runtime import plans
from flashgen.runtime.arrays import cupy_module, elem_strides
from flashgen.runtime.families.sm90_bwd import buffers, layout
from flashgen.runtime.families.sm90_common import AmpereFamily, band_fields, zero_unpacked_rows
from flashgen.runtime.launch import fill, handle, launch, on_device, params_buffer
from flashgen.runtime.limits import check_int32
from flashgen.runtime.memory import CupyMemory
from flashgen.runtime.registry import KernelBinary
from flashgen.runtime.validate import Call
from flashgen.spec.sm80_bwd import Sm80Bwd

# per-call pointers, in Params order: the caller's arrays (replay's order), then those buffers() carves
POINTERS = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "dout_ptr", "lse_ptr", "lse_log2_ptr", "delta_ptr", "dq_accum_ptr",
            "dq_counter_ptr", "dq_ptr", "dk_ptr", "dv_ptr")


class Sm80BwdRuntime(AmpereFamily):
    spec = Sm80Bwd

    def launch(self, call: Call, binary: KernelBinary):
        """(dq, dk, dv) on ``binary`` (on the call's device, api.py makes it current)."""
        cupy, p, q, k, v = cupy_module(), call.p, call.q, call.k, call.v
        out, grad_out, lse, plan_key = call.out, call.grad_out, call.lse, call.plan_key
        kc = binary.constants
        if p.M > 1 and lse.strides[2] != 4:
            lse = cupy.ascontiguousarray(lse)  # the prep kernel reads a row's lse with unit stride
            plan_key = None  # a per-call copy: not a plan
        rows, *offsets = layout(kc, p, q, k)
        dq, dk, dv, (lse_log2, delta, accum, counters, *_), _ = buffers(CupyMemory(cupy), offsets, q, k, v)
        qs, ks, vs, os_, gos, ls = (elem_strides(x) for x in (q, k, v, out, grad_out, lse))
        strides = dict(q_stride_m=qs[1], q_stride_h=qs[2], k_stride_m=ks[1], k_stride_h=ks[2], v_stride_m=vs[1],
                       v_stride_h=vs[2], out_stride_m=os_[1], out_stride_h=os_[2], dout_stride_m=gos[1],
                       dout_stride_h=gos[2], dq_stride_m=p.H * p.K, dq_stride_h=p.K, dkv_stride_n=k.shape[2] * p.K,
                       dkv_stride_h=p.K, lse_stride_b=ls[0], lse_stride_h=ls[1])
        check_int32(rows_padded=rows * p.H * p.B, **strides)
        params = params_buffer(Sm80Bwd)
        fill(params, q_ptr=q.data.ptr, k_ptr=k.data.ptr, v_ptr=v.data.ptr, out_ptr=out.data.ptr,
             dout_ptr=grad_out.data.ptr, lse_ptr=lse.data.ptr, lse_log2_ptr=lse_log2, delta_ptr=delta,
             dq_accum_ptr=accum, dq_counter_ptr=counters, dq_ptr=dq.data.ptr, dk_ptr=dk.data.ptr, dv_ptr=dv.data.ptr,
             q_stride_b=qs[0], k_stride_b=ks[0], v_stride_b=vs[0], out_stride_b=os_[0], dout_stride_b=gos[0],
             dq_stride_b=q.shape[1] * p.H * p.K, dkv_stride_b=k.shape[1] * k.shape[2] * p.K, num_queries=p.M,
             num_keys=p.N, num_heads=p.H, head_dim=p.K, head_group=p.H // k.shape[2], rows_padded=rows,
             deterministic=int(call.options["deterministic"]), scale=p.scale, **strides, **band_fields(p))
        aux_grid, aux_block = (-(-p.M // kc["block_m"]), p.H, p.batches), (kc["aux_threads"], 1, 1)
        grid, block = (-(-p.N // kc["block_n"]), k.shape[2], p.batches), (kc["threads_per_block"], 1, 1)
        launch(call.registry, binary, p.device, aux_grid, aux_block, params, call.stream, "_prep")
        launch(call.registry, binary, p.device, grid, block, params, call.stream)
        launch(call.registry, binary, p.device, aux_grid, aux_block, params, call.stream, "_convert")
        zero_unpacked_rows(p, dq, dk, dv)
        if plan_key is not None:
            entry = lambda name: handle(call.registry, binary, p.device, name)  # noqa: E731
            plans.remember(plan_key, plans.LaunchPlan.from_params(
                entry(""), p.device, grid, block, kc["shared_memory_bytes"], params, POINTERS, False,
                {"layout": tuple(offsets)}, family=self.name,
                before=[(entry("_prep"), aux_grid, aux_block)], after=[(entry("_convert"), aux_grid, aux_block)]))
        return dq, dk, dv

    def replay(self, plan, memory, arrays, seed, offset, stream):
        grad_out, q, k, v, out, lse = arrays
        ptr = memory.ptr
        with on_device(cupy_module(), plan.device):
            dq, dk, dv, carved, workspace = buffers(memory, plan.sizes["layout"], q, k, v)
            plan.launch((ptr(q), ptr(k), ptr(v), ptr(out), ptr(grad_out), ptr(lse)) + carved, 0, 0,
                        memory.stream(stream, plan.device))
            del workspace  # after the launch: the allocator reuses it in stream order
        return dq, dk, dv


RUNTIME = Sm80BwdRuntime()
