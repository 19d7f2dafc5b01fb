"""Running ``mem_eff_bwd`` (spec/mem_eff_bwd.py): CUTLASS example 41's backward, on every GPU.

Three kinds of call reach its kernels changed, by re-entering ``attention_backward``
(``Call.again``): grouped-query k/v repeated per q head (gradients summed per
group), f16/bf16 head dims that are not multiples of 8 zero-padded (results
sliced), and bottom-right causal calls with more queries than keys split so the
rows that see no key are left out (their gradient is 0).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from flashgen.runtime import plans, tensormap
from flashgen.runtime.arrays import alignment, cupy_module, elem_strides
from flashgen.runtime.device import device_info
from flashgen.runtime.families import RuntimeFamily, selector, tuned
from flashgen.runtime.families.mem_eff_fwd import repeat_heads, unfit_example41
from flashgen.runtime.launch import fill, handle, launch, on_device, packed_offsets, params_buffer
from flashgen.runtime.memory import CupyMemory
from flashgen.runtime.limits import check_int32
from flashgen.runtime.registry import KernelBinary
from flashgen.runtime.select import Request, num_splits_key, seq_multiples, workspace_bytes
from flashgen.runtime.validate import Call, rows_without_keys, varlen_lengths
from flashgen.spec.mem_eff_bwd import MemEffBwd

POINTERS = ("query_ptr", "key_ptr", "value_ptr", "logsumexp_ptr", "output_ptr", "grad_output_ptr", "delta_ptr",
            "grad_query_ptr", "grad_key_ptr", "grad_value_ptr", "workspace")
LSE_ROW_BLOCK = 128  # the largest backward block I: the kernel reads lse a whole row block at a time
LSE_ALIGNMENT = 16  # bytes: the kernel reads lse in vectors (compute-sanitizer: 8-byte reads of a 4-byte-aligned view)


def sum_groups(grad, heads_kv: int):
    """The gradient of ``repeat_heads``: [B, S, H, D] summed over each group -> [B, S, heads_kv, D]."""
    B, S, H, D = grad.shape
    cupy = cupy_module()
    return cupy.ascontiguousarray(grad.reshape(B, S, heads_kv, H // heads_kv, D).astype(cupy.float32).sum(axis=3)
                                  .astype(grad.dtype))


def padded_lse(memory, lse, batches: int, heads: int, rows: int, seq_rows=None):
    """lse as the backward reads it: every row block complete, +inf past each sequence's last query
    (``seq_rows``: each packed sequence's query count with cu_seqlens, else None).

    The kernel loads lse for all rows of a block and relies on exp(s - inf) = 0 for rows that
    do not exist; the forward pads only to 32 rows, so a 64- or 128-row block would read past
    its (batch, head) row, past the buffer for the last one (compute-sanitizer: invalid reads,
    NaN gradients).  A copy of B*H*M floats costs nothing next to the backward itself.
    """
    padded = memory.full_f32((batches, heads, -(-max(rows, 1) // LSE_ROW_BLOCK) * LSE_ROW_BLOCK), np.inf, lse)
    if seq_rows is None:
        padded[:, :, :rows] = lse[:, :, :rows]
    else:  # rows past a sequence's own length were never written by the forward
        for seq, n in enumerate(seq_rows):
            padded[seq, :, :n] = lse[seq, :, :n]
    return padded


def lse_needs_copy(p, lse, block_i: int) -> bool:
    """Whether the kernel must read lse from a ``padded_lse`` copy rather than the caller's array:
    a packed batch, rows that end inside a row block, rows that are not unit-stride, or a view
    whose start or batch/head strides break ``LSE_ALIGNMENT`` (the last rows of a forward's lse,
    say, which is how the queries after those that see no key get theirs)."""
    if p.seqstart_q is not None or p.M % block_i or (p.M > 1 and lse.strides[2] != 4):
        return True
    strides = (s for s, n in zip(lse.strides[:2], lse.shape[:2]) if n > 1)
    return bool(lse.data.ptr % LSE_ALIGNMENT or any(s % LSE_ALIGNMENT for s in strides))


def without_rows(call: Call, skip: int):
    """The backward of the last M - skip queries (as api.py's forward ran them: rows_without_keys);
    dq (and dbias) zero for the first ``skip``.  Flashgen's pairs' dropout calls come here too: their
    mask numbers rows as the forward's call did."""
    cupy, p = cupy_module(), call.p
    part_lse = call.lse[:, :, skip:p.M]  # launch copies it if this view breaks LSE_ALIGNMENT
    part = call.again(call.grad_out[:, skip:], call.q[:, skip:], call.k, call.v, call.out[:, skip:], part_lse,
                      attn_bias=None if call.bias is None else call.bias[:, :, skip:], scale=p.scale)
    dq = cupy.zeros((p.B, p.M, p.H, p.K), dtype=call.q.dtype)
    dq[:, skip:] = part[0]
    if not call.options["bias_requires_grad"]:
        return dq, part[1], part[2]
    dbias = cupy.zeros((p.B, p.H, p.M, p.N), dtype=call.q.dtype)
    dbias[:, :, skip:] = part[3]
    return dq, part[1], part[2], dbias


class MemEffBwdRuntime(RuntimeFamily):
    spec = MemEffBwd

    def unfit(self, call: Call) -> Optional[str]:
        if call.p.scale == 0 and call.p.mask:
            return "no zero scale with a causal mask (the kernel's masked scores become 0 * -inf = NaN)"
        return unfit_example41(call)

    def request(self, call: Call) -> Request:
        p = call.p
        arrays = [x for x in (call.q, call.k, call.v, call.out, call.grad_out, call.bias) if x is not None]
        return Request(self.name, p.dtype, p.K, p.Kv, alignment(arrays, (p.K, p.Kv)), p.dropout_p > 0,
                       call.bias is not None, device_info(p.device), seq_multiples(p.M, p.N, p.seqstart_q is not None))

    def run(self, call: Call):
        cupy, p, q, k, v, out, grad_out = cupy_module(), call.p, call.q, call.k, call.v, call.out, call.grad_out
        if k.shape[2] != p.H:  # gradients of the repeated k/v, summed per group
            grads = call.again(grad_out, q, repeat_heads(k, p.H), repeat_heads(v, p.H), out, call.lse, scale=p.scale)
            return (grads[0], sum_groups(grads[1], k.shape[2]), sum_groups(grads[2], k.shape[2])) + tuple(grads[3:])
        if p.dtype != "f32" and (p.K % 8 or p.Kv % 8):
            # The f16/bf16 backward writes dQ/dK/dV rows in 16-byte pieces whatever its alignment
            # (compute-sanitizer: misaligned stores for head dims that are not multiples of 8), so
            # such head dims run zero-padded to the next multiple of 8 and the result is sliced.
            pad = lambda x, n: cupy.pad(x, ((0, 0), (0, 0), (0, 0), (0, -(-n // 8) * 8 - n)))  # noqa: E731
            grads = call.again(pad(grad_out, p.Kv), pad(q, p.K), pad(k, p.K), pad(v, p.Kv), pad(out, p.Kv), call.lse,
                               scale=p.scale)
            return (grads[0][..., :p.K], grads[1][..., :p.K], grads[2][..., :p.Kv]) + tuple(grads[3:])
        skip = rows_without_keys(p, q, k)
        if skip:  # see rows_without_keys: the first `skip` queries see no key and get no gradient
            return without_rows(call, skip)
        if elem_strides(out)[1:] != (p.H * p.Kv, p.Kv, 1):
            out = cupy.ascontiguousarray(out)  # the kernel derives out's row stride from H * Kv
            call = replace(call, out=out, plan_key=None)  # a per-call copy: not a plan
        if tensormap.bmhk_problem(out) or tensormap.bmhk_problem(grad_out):
            # Even the unaligned kernels read out and grad_out 16 bytes at a time (compute-sanitizer:
            # misaligned 16-byte reads, then a fault): such inputs (those a TMA tensor map could not
            # describe either) run from fresh, aligned copies.
            out, grad_out = (x.copy() if tensormap.bmhk_problem(x) else x for x in (out, grad_out))
            call = replace(call, out=out, grad_out=grad_out, plan_key=None)
        req = self.request(call)
        prefer = tuned(req, p)
        binary = selector(call.registry).select(req, prefer)
        call.extra["splits"] = prefer.splits if prefer is not None and prefer.matches(binary.spec) else "auto"
        return self.launch(call, binary)

    def launch(self, call: Call, binary: KernelBinary):
        """(dq, dk, dv[, dbias]) on ``binary`` (on the call's device, api.py makes it current)."""
        cupy, p, q, k, v, bias = cupy_module(), call.p, call.q, call.k, call.v, call.bias
        out, grad_out, lse, memory = call.out, call.grad_out, call.lse, CupyMemory(cupy)
        # varlen: the kernel never visits the queries of a sequence without keys; their dq is 0
        dq = (cupy.zeros_like if p.seqstart_q is not None else cupy.empty_like)(q, order="C")
        dk, dv = cupy.empty_like(k, order="C"), cupy.empty_like(v, order="C")
        # zeros: with a causal mask the kernel skips key blocks no query sees and never writes their dbias
        dbias_full = None
        if call.options["bias_requires_grad"]:
            dbias_full = cupy.zeros((p.B, p.H, q.shape[1], -(-k.shape[1] // 8) * 8), dtype=q.dtype)
        split_policy = "one" if call.options["deterministic"] else call.extra.get("splits", "auto")
        kc = binary.constants
        pad_lse = lse_needs_copy(p, lse, kc["block_i"])
        if pad_lse:
            lse = padded_lse(memory, lse, p.batches, p.H, p.M, None if p.seqstart_q is None else varlen_lengths(p)[1])
        if p.seqstart_q is not None:  # the kernel indexes delta as [H, total_q]
            delta = cupy.empty((p.H, q.shape[1]), dtype=cupy.float32)
            delta_strides = (0, q.shape[1])
        else:
            delta = cupy.empty((p.B, p.H, p.M), dtype=cupy.float32)
            delta_strides = (p.H * p.M, p.M)
        if not kc["kernel_computes_delta"]:  # delta = rowsum(dO * O), for the f32 kernels
            memory.row_sums(grad_out, out, delta)
        splits = num_splits_key(binary, p.batches, p.H, p.N, device_info(p.device), p.K, p.Kv, split_policy)
        ws_bytes = workspace_bytes(binary, p.batches, p.H, p.M, p.N, p.K, p.Kv, splits)
        workspace = (cupy.zeros if splits > 1 else cupy.empty)(ws_bytes // 4, dtype=cupy.float32) if ws_bytes else None
        qs, ks, vs, os_ = elem_strides(q), elem_strides(k), elem_strides(v), elem_strides(out)
        gos, ls = elem_strides(grad_out), elem_strides(lse)
        bs = elem_strides(bias) if bias is not None else (0, 0, 0, 0)
        gbs = elem_strides(dbias_full) if dbias_full is not None else (0, 0, 0, 0)
        check_int32(q_strideM=qs[1], k_strideM=ks[1], v_strideM=vs[1], q_strideH=qs[2], k_strideH=ks[2],
                    v_strideH=vs[2], gO_strideM=gos[1], bias_strideM=bs[2], gB_strideM=gbs[2],
                    num_queries=q.shape[1], num_keys=k.shape[1])
        params = params_buffer(MemEffBwd)
        fill(params, query_ptr=q.data.ptr, key_ptr=k.data.ptr, value_ptr=v.data.ptr,
             bias_ptr=bias.data.ptr if bias is not None else 0, logsumexp_ptr=lse.data.ptr,
             output_ptr=out.data.ptr, grad_output_ptr=grad_out.data.ptr, delta_ptr=delta.data.ptr,
             cu_seqlens_q_ptr=p.seqstart_q.data.ptr if p.seqstart_q is not None else 0,
             cu_seqlens_k_ptr=p.seqstart_k.data.ptr if p.seqstart_k is not None else 0,
             grad_query_ptr=dq.data.ptr, grad_key_ptr=dk.data.ptr, grad_value_ptr=dv.data.ptr,
             grad_bias_ptr=dbias_full.data.ptr if dbias_full is not None else 0,
             workspace=workspace.data.ptr if workspace is not None else 0,
             scale=p.scale, head_dim=p.K, head_dim_value=p.Kv, num_queries=p.M, num_keys=p.N, num_heads=p.H,
             custom_mask_type=p.mask, q_strideM=qs[1], k_strideM=ks[1], v_strideM=vs[1], bias_strideM=bs[2],
             gO_strideM=gos[1], gB_strideM=gbs[2], gQKV_strideM_multiplier=1,
             rng_engine_inputs_seed=p.seed, rng_engine_inputs_offset=p.offset, dropout_prob=p.dropout_p,
             o_strideH=os_[2], q_strideH=qs[2], k_strideH=ks[2], v_strideH=vs[2], bias_strideH=bs[1],
             o_strideB=os_[0], q_strideB=qs[0], k_strideB=ks[0], v_strideB=vs[0], bias_strideB=bs[0],
             lse_strideB=ls[0], lse_strideH=ls[1], delta_strideB=delta_strides[0], delta_strideH=delta_strides[1],
             num_batches=p.batches, num_splits_key=splits,
             gO_strideB=gos[0], gQ_strideB=elem_strides(dq)[0], gK_strideB=elem_strides(dk)[0],
             gV_strideB=elem_strides(dv)[0], gB_strideB=gbs[0], gO_strideH=gos[2], gQ_strideH=p.K,
             gK_strideH=p.K, gV_strideH=p.Kv, gB_strideH=gbs[1])
        grid, block = (splits, p.H, p.batches), (kc["threads_per_block"], 1, 1)
        launch(call.registry, binary, p.device, grid, block, params, call.stream)
        if call.plan_key is not None and bias is None and p.seqstart_q is None:  # replay passes no bias, no offsets
            plans.remember(call.plan_key, plans.LaunchPlan.from_params(
                handle(call.registry, binary, p.device), p.device, grid, block, kc["shared_memory_bytes"], params,
                POINTERS, p.dropout_p > 0,
                {"delta": delta.shape, "delta_in_kernel": bool(kc["kernel_computes_delta"]),
                 "offsets": packed_offsets(dq.nbytes, dk.nbytes, dv.nbytes, delta.nbytes, ws_bytes),
                 "workspace_bytes": ws_bytes, "zero_workspace": splits > 1,
                 "lse_rows": (p.batches, p.H, p.M), "pad_lse": pad_lse}, family=self.name))
        if dbias_full is None:
            return dq, dk, dv
        return dq, dk, dv, dbias_full[..., :k.shape[1]]

    def replay(self, plan, memory, arrays, seed, offset, stream):
        sizes, ptr = plan.sizes, memory.ptr
        grad_out, q, k, v, out, lse = arrays
        with on_device(cupy_module(), plan.device):
            # the plan's key holds lse's strides but only the alignment all pointers share
            if sizes["pad_lse"] or ptr(lse) % LSE_ALIGNMENT:
                lse = padded_lse(memory, lse, *sizes["lse_rows"])
            # dq, dk, dv, delta and the workspace in one allocation (CuPy): four pool calls fewer per
            # step (the gradients keep it alive together; each is still its own contiguous array)
            at_dk, at_dv, at_delta, at_workspace, total = sizes["offsets"]
            handle_ = memory.stream(stream, plan.device)
            (dq, dk, dv, delta), base, workspace = memory.carve(
                ((0, q.shape, q), (at_dk, k.shape, k), (at_dv, v.shape, v), (at_delta, sizes["delta"], None)),
                at_workspace, total, handle_)
            workspace_ptr = base + at_workspace if sizes["workspace_bytes"] else 0
            if not sizes["delta_in_kernel"]:
                memory.row_sums(grad_out, out, delta)
            if sizes["zero_workspace"]:
                cupy_module().cuda.runtime.memsetAsync(workspace_ptr, 0, sizes["workspace_bytes"], handle_)
            plan.launch((ptr(q), ptr(k), ptr(v), ptr(lse), ptr(out), ptr(grad_out), ptr(delta), ptr(dq), ptr(dk),
                         ptr(dv), workspace_ptr), seed or 0, offset, handle_)
            del workspace  # after the launch: the allocator reuses it in stream order
        return dq, dk, dv


RUNTIME = MemEffBwdRuntime()
