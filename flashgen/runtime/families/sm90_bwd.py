"""Running ``sm90_bwd`` (spec/sm90_bwd.py): three kernels (prep, main, convert) over one allocation.

The prep kernel turns lse into log2 units and computes delta = rowsum(dO * O); the
main kernel accumulates dQ in float32 and writes dK, dV; the convert kernel turns
the dQ accumulator into dq.  The outputs and that workspace are carved from one
allocation (``layout``), so a training step costs one pool call per backward.
``ThreeKernelBackward`` launches the three and replays their plan, for this family and for
sm80_bwd, whose kernels keep the same contract (dbias included).  Where the caller's bias broadcasts
over the batch or heads, this family's bias instances add their dbias tiles into the gradient of the
bias's shape (TMA reduce-adds), which a training step with a per-head bias would otherwise sum in
torch (5 ms for [4, 32, 4096, 4096] on an H200, far below memory speed); with ``deterministic`` they
write per-plane dbias and a fourth kernel, ``_dbias_sum``, adds the planes in a fixed order.

A call with a ``block_mask`` runs here, sparse, when a ``sparse`` instance reads the mask's blocks and
the call has nothing such an instance lacks (``block_mask_refusal``); else the mask goes dense
(block_fallback).  Such a call leaves a launch plan as the forward's does: the mask's transposed
arrays end its signature (api.py) and their pointers follow the family's own (SPARSE_POINTERS), so a
replay reads the call's own mask.
"""
from __future__ import annotations

import contextlib
from typing import Tuple

from flashgen.runtime import dropout, plans
from flashgen.runtime.arrays import cupy_module, elem_strides
from flashgen.runtime.families.sm90_common import (SPARSE_POINTERS, HopperFamily, band_fields, bias_fields,
                                                   check_compiled, dbias_fields, encode_bias_map, encode_dbias_map,
                                                   encode_maps, mod_fields, packed_ends, sparse_refusal,
                                                   trailing_pointers, zero_replayed_rows, zero_unpacked_rows)
from flashgen.runtime.launch import fill, handle, launch, on_device, packed_offsets, params_buffer
from flashgen.runtime.memory import CupyMemory
from flashgen.runtime.limits import check_int32
from flashgen.runtime.registry import KernelBinary
from flashgen.runtime.validate import Call, Problem, dbias_folds
from flashgen.spec.sm90_bwd import Sm90Bwd

MAPS = ("q_map", "k_map", "v_map", "do_map")
MAX_GRID_Y = 65535  # the most output planes one _dbias_sum grid covers (grid y); more: the API sums
# per-call pointers after the four tensor maps' (q, k, v, grad_out), in Params order
POINTERS = ("out_ptr", "dout_ptr", "lse_ptr", "lse_log2_ptr", "delta_ptr", "dq_accum_ptr", "dq_counter_ptr",
            "dq_ptr", "dk_ptr", "dv_ptr")


def sparse_fields(block_mask) -> dict:
    """The Params fields of a block mask (``BwdParams``' sparse_*): the pointers of its transposed lists,
    partial_index and bits, the steps from (batch, head) to its planes (0 where it broadcasts) and its
    block counts; nothing without one."""
    if block_mask is None:
        return {}
    B, H = block_mask.shape[:2]
    QB, KB = block_mask.num_blocks
    pointers = {name: x.data.ptr for name, x in zip(SPARSE_POINTERS, block_mask.backward_arrays())}
    return {**pointers, "sparse_batch_step": H if B > 1 else 0, "sparse_head_step": int(H > 1),
            "sparse_query_blocks": QB, "sparse_key_blocks": KB}


def layout(kc: dict, p: Problem, q, k) -> tuple:
    """(rows_padded, byte offsets of dk, dv, lse_log2, delta, dq accumulator, counters, total) of
    the one allocation holding a call's outputs and workspace."""
    block_m = kc["block_m"]
    if p.seqstart_q is None:
        rows = -(-p.M // block_m) * block_m
    else:  # every sequence's rows start on a block boundary past the blocks of the ones before
        rows = (q.shape[1] + p.batches * block_m) // block_m * block_m
    heads_rows = p.B * p.H * rows
    dkv_bytes = k.size * k.itemsize
    return (rows,) + packed_offsets(q.size * q.itemsize, dkv_bytes, dkv_bytes, heads_rows * 4, heads_rows * 4,
                                    heads_rows * kc["max_k"] * 4, heads_rows // block_m * 4)


def buffers(memory, offsets, q, k, v, stream: int):
    """dq, dk, dv and the workspace laid out by ``offsets`` (``layout`` without its rows): the
    three arrays, the pointers of the workspace (lse_log2, delta, dq accumulator, counters) and
    of dq, dk, dv (the tail of ``POINTERS``), and the workspace's owner (keep it to the launch)."""
    at_dk, at_dv, at_lse2, at_delta, at_accum, at_counters, total = offsets
    (dq, dk, dv), base, owner = memory.carve(((0, q.shape, q), (at_dk, k.shape, k), (at_dv, v.shape, v)), at_lse2,
                                             total, stream)
    ptr = memory.ptr
    return dq, dk, dv, (base + at_lse2, base + at_delta, base + at_accum, base + at_counters, ptr(dq), ptr(dk),
                        ptr(dv)), owner


class ThreeKernelBackward:
    """Launch and replay of a backward with this file's contract, shared by sm90_bwd and sm80_bwd
    (whose kernels keep it): prep, main and convert kernels over one allocation carved by
    ``layout`` and ``buffers``, and a launch plan of the three.  A family says what its Params
    has beyond the shared fields (``own_fields``, ``encode``), what its kernels write beyond dq,
    dk, dv (``own_outputs``), which of its kernels a call must not reach (``check_launch``) and
    in what order its plan takes the caller's arrays (``replay_pointers``)."""

    POINTERS: Tuple[str, ...] = ()  # per-call pointers after the tensor maps', in Params order
    MAPS: Tuple[str, ...] = ()      # Params fields holding tensor maps (encoded per call)
    # a bias call's plan: its pointers and tensor maps, and where the bias goes among the caller's
    # arrays' addresses (replay_pointers'): by default its tensor map after the family's own
    BIAS_POINTERS: Tuple[str, ...] = ()
    BIAS_MAPS: Tuple[str, ...] = ()
    BIAS_AT = 0
    SUMS_DBIAS = False  # its bias instances have a ``_dbias_sum`` kernel (dbias_folds' sums on the GPU)
    DBIAS_MAPS: Tuple[str, ...] = ()  # dbias's tensor map, if the kernels store it by one (after the bias's)

    def own_fields(self, call: Call) -> Tuple[dict, dict]:
        """(int32 fields, other fields) that only this family's Params has."""
        return {}, {}

    def check_launch(self, call: Call, binary: KernelBinary) -> None:
        """Raise where ``binary`` must not run ``call`` (selection keeps them apart; this guards a
        launch that names its kernel itself), before anything touches the GPU."""
        check_compiled(binary, call)

    def own_outputs(self, call: Call, kc: dict) -> Tuple[tuple, dict, tuple]:
        """(arrays, their Params fields, workspace) of what the kernels (constants ``kc``) write beside
        dq, dk, dv: dbias where the call asks for it; ``launch`` returns the arrays after dq, dk, dv
        (and plans the call where a replay can remake them: ``replayable_dbias``).  Where the family
        sums dbias (``SUMS_DBIAS``) over the dims the caller's bias broadcasts in, the array is the sum
        and the workspace the kernels' dbias, which the launch keeps to the ``_dbias_sum`` kernel that
        reads it -- unless the kernels add their tiles into the sum themselves (constant
        ``adds_dbias``; not with ``deterministic``, whose sums must repeat bit for bit): then the sum,
        zeroed, is all there is.  The kernels add a tile where they read the bias's (batch and head
        times ``bias_*_step``), which is the sum's plane only where the dims the sum folds are the dims
        the bias is read at stride 0: not for a bias the caller expanded to the full batch at stride 0,
        which wants a gradient per batch."""
        if not call.options["bias_requires_grad"]:
            return (), {}, ()
        p, bias = call.p, call.bias
        batches, heads = dbias_folds(call.options["attn_bias"], p.B, p.H)
        folded = (p.B // batches, p.H // heads)
        reads_folded = all(n == 1 or (fold > 1) == (stride == 0)
                           for n, fold, stride in ((p.B, batches, bias.strides[0]), (p.H, heads, bias.strides[1])))
        if (self.SUMS_DBIAS and batches * heads > 1 and kc.get("adds_dbias") and reads_folded
                and not call.options["deterministic"]):
            summed = self.dbias(call, kc, planes=folded)
            return (summed,), dict(dbias_fields(summed), dbias_add=1), ()
        dbias = self.dbias(call, kc)
        fields = dbias_fields(dbias)
        if not self.SUMS_DBIAS or batches * heads == 1 or folded[0] * folded[1] > MAX_GRID_Y:
            return (dbias,), fields, ()
        rows = (dbias.shape[2], elem_strides(dbias)[2])  # M rows of the kernels' padded pitch
        summed = cupy_module().empty(folded + rows, dtype=dbias.dtype)
        summed = summed[..., :dbias.shape[3]]
        return (summed,), dict(fields, dbias_sum_ptr=summed.data.ptr, dbias_sum_batch=batches,
                               dbias_sum_heads=heads), (dbias,)

    @staticmethod
    def dbias_recipe(call: Call, kc: dict, planes=None) -> Tuple[tuple, bool]:
        """(shape, zeroed) of the array the kernels write dbias into: [B, H, M, N] in q's dtype as example
        41 returns it, rows padded to 8 elements.  The kernels write every (query, key) they visit: all of
        them without a band mask; band calls need zeros where no query sees a key, which kernels with the
        constant ``zeroes_hidden_dbias`` write themselves for fixed-length batches, and the rest get
        cleared.  With ``planes`` (batches, heads), the zeroed sum of that many planes the kernels add
        into (``dbias_add``)."""
        p = call.p
        band = p.mask != 0 or p.window is not None
        zeroed = planes is not None or (band and not (kc.get("zeroes_hidden_dbias") and p.seqstart_q is None))
        return tuple(planes or (p.B, p.H)) + (call.q.shape[1], -(-call.k.shape[1] // 8) * 8), zeroed

    @staticmethod
    def dbias(call: Call, kc: dict, planes=None):
        """dbias as ``dbias_recipe`` lays it out, N keys wide (a view of the padded rows)."""
        shape, zeroed = ThreeKernelBackward.dbias_recipe(call, kc, planes)
        cupy = cupy_module()
        return (cupy.zeros if zeroed else cupy.empty)(shape, dtype=call.q.dtype)[..., :call.k.shape[1]]

    def encode(self, params, call: Call, kc: dict, dbias) -> None:
        """Write what ``fill`` cannot (tensor maps) into the filled ``params``; ``dbias`` is the array
        the main kernel writes dbias into, or None."""

    def replay_pointers(self, ptr, q, k, v, out, grad_out, lse) -> tuple:
        """The caller's arrays as the plan's launch takes them: the tensor maps', then POINTERS' head."""
        raise NotImplementedError

    def launch(self, call: Call, binary: KernelBinary):
        """(dq, dk, dv) and ``own_outputs``' on ``binary`` (on the call's device, api.py makes it current)."""
        self.check_launch(call, binary)
        cupy, p, q, k, v = cupy_module(), call.p, call.q, call.k, call.v
        out, grad_out, lse, plan_key = call.out, call.grad_out, call.lse, call.plan_key
        kc = binary.constants
        if p.M > 1 and lse.strides[2] != 4:
            lse = cupy.ascontiguousarray(lse)  # the prep kernel reads a row's lse with unit stride
            plan_key = None  # a per-call copy: not a plan
        rows, *offsets = layout(kc, p, q, k)
        memory = CupyMemory(cupy)
        dq, dk, dv, (lse_log2, delta, accum, counters, *_), _ = buffers(memory, offsets, q, k, v,
                                                                          memory.stream(call.stream, p.device))
        os_, gos, ls = elem_strides(out), elem_strides(grad_out), elem_strides(lse)
        own_int32, own = self.own_fields(call)
        # a zeroed dbias is cleared in the launches' stream order
        with call.stream if call.stream is not None else contextlib.nullcontext():
            extra, extra_fields, dbias_planes = self.own_outputs(call, kc)
        strides = dict(out_stride_m=os_[1], out_stride_h=os_[2], dout_stride_m=gos[1], dout_stride_h=gos[2],
                       dq_stride_m=p.H * p.K, dq_stride_h=p.K, dkv_stride_n=k.shape[2] * p.K, dkv_stride_h=p.K,
                       lse_stride_b=ls[0], lse_stride_h=ls[1], **own_int32)
        check_int32(rows_padded=rows * p.H * p.B, **strides)
        params = params_buffer(self.spec)
        fill(params, out_ptr=out.data.ptr, dout_ptr=grad_out.data.ptr, lse_ptr=lse.data.ptr, lse_log2_ptr=lse_log2,
             delta_ptr=delta, dq_accum_ptr=accum, dq_counter_ptr=counters, dq_ptr=dq.data.ptr, dk_ptr=dk.data.ptr,
             dv_ptr=dv.data.ptr, out_stride_b=os_[0], dout_stride_b=gos[0], dq_stride_b=q.shape[1] * p.H * p.K,
             dkv_stride_b=k.shape[1] * k.shape[2] * p.K, num_queries=p.M, num_keys=p.N, num_heads=p.H, head_dim=p.K,
             head_group=p.group, rows_padded=rows,
             deterministic=int(call.options["deterministic"]), scale=p.scale, **strides, **own, **extra_fields,
             **band_fields(p))
        self.encode(params, call, kc, dbias_planes[0] if dbias_planes else extra[0] if extra else None)
        aux_grid, aux_block = (-(-p.M // kc["block_m"]), p.H, p.batches), (kc["aux_threads"], 1, 1)
        grid, block = (-(-p.N // kc["block_n"]), k.shape[2], p.batches), (kc["threads_per_block"], 1, 1)
        launch(call.registry, binary, p.device, aux_grid, aux_block, params, call.stream, "_prep")
        launch(call.registry, binary, p.device, grid, block, params, call.stream)
        launch(call.registry, binary, p.device, aux_grid, aux_block, params, call.stream, "_convert")
        if dbias_planes:  # dbias summed over the planes the caller's bias broadcasts in
            summed = extra[0]
            plane_chunks = summed.shape[2] * elem_strides(summed)[2] // 8
            sum_grid = (-(-plane_chunks // kc["aux_threads"]), summed.shape[0] * summed.shape[1], 1)
            launch(call.registry, binary, p.device, sum_grid, aux_block, params, call.stream, "_dbias_sum")
        zero_unpacked_rows(p, dq, dk, dv)
        remade = self.replayable_dbias(call, kc, extra, extra_fields, dbias_planes)
        # a bias's map or pointer where BIAS_AT says (replay: the arrays in order); a block mask's pointers, or
        # a score mod's tensors', follow POINTERS (their arrays end the replayed ones: the plan's ``trailing``);
        # dbias's map follows the bias's, its pointer (and its sum's) end them all
        if plan_key is not None and (not extra or remade is not None):
            entry = lambda name: handle(call.registry, binary, p.device, name)  # noqa: E731
            maps, pointers = (self.MAPS, self.POINTERS) if call.bias is None else (self.BIAS_MAPS, self.BIAS_POINTERS)
            trailing = trailing_pointers(call)
            sizes = {"layout": tuple(offsets), "trailing": len(trailing), "packed_ends": packed_ends(p)}
            after = [(entry("_convert"), aux_grid, aux_block)]
            if remade is not None:
                maps, trailing, sizes["dbias"] = maps + self.DBIAS_MAPS, trailing + ("dbias_ptr",), remade
                if dbias_planes:
                    trailing += ("dbias_sum_ptr",)
                    after.append((entry("_dbias_sum"), sum_grid, aux_block))
            plans.remember(plan_key, plans.LaunchPlan.from_params(
                entry(""), p.device, grid, block, kc["shared_memory_bytes"], params, pointers + trailing,
                p.dropout_p > 0, sizes, tensor_maps=maps, family=self.name,
                before=[(entry("_prep"), aux_grid, aux_block)], after=after, rng_fields=dropout.RNG_FIELDS))
        return (dq, dk, dv) + extra

    def replayable_dbias(self, call: Call, kc: dict, extra: tuple, fields: dict, workspace: tuple):
        """(shape, zeroed, sum's shape) a replay remakes the call's dbias from: the array the kernels
        write (``dbias_recipe``) and, where ``_dbias_sum`` folds its planes, the padded shape of the sum
        it writes (else None); or None where a replay could not stand in for the launch: no dbias asked
        for, or planes the API still has to fold (``fold_dbias``)."""
        if not extra:
            return None
        p = call.p
        batches, heads = dbias_folds(call.options["attn_bias"], p.B, p.H)
        folded = (p.B // batches, p.H // heads)
        if tuple(extra[0].shape[:2]) != folded:
            return None
        if workspace:  # the kernels' planes, which _dbias_sum adds into extra[0]
            shape, zeroed = self.dbias_recipe(call, kc)
            return shape, zeroed, folded + shape[2:]
        return self.dbias_recipe(call, kc, folded if fields.get("dbias_add") else None) + (None,)

    def replay(self, plan, memory, arrays, seed, offset, stream):
        lead = len(arrays) - plan.sizes.get("trailing", 0)  # a block mask's or a mod's arrays end ``arrays``
        (grad_out, q, k, v, out, lse, *bias), trailing = arrays[:lead], arrays[lead:]
        ptr = memory.ptr
        given = self.replay_pointers(ptr, q, k, v, out, grad_out, lse)
        if bias:  # its address where the plan was made to take it
            given = given[:self.BIAS_AT] + (ptr(bias[0]),) + given[self.BIAS_AT:]
        remade = plan.sizes.get("dbias")
        with on_device(cupy_module(), plan.device):
            handle_ = memory.stream(stream, plan.device)
            dq, dk, dv, carved, workspace = buffers(memory, plan.sizes["layout"], q, k, v, handle_)
            tail = tuple(map(ptr, trailing))
            if remade is not None:
                shape, zeroed, sum_shape = remade
                planes = memory.zeros(shape, q, handle_) if zeroed else memory.empty(shape, q)
                at = self.BIAS_AT + 1  # the bias's map, then dbias's
                given = given[:at] + (ptr(planes),) * len(self.DBIAS_MAPS) + given[at:]
                dbias = planes if sum_shape is None else memory.empty(sum_shape, q)
                tail += (ptr(planes),) + (() if sum_shape is None else (ptr(dbias),))
            zero_replayed_rows(memory, plan.sizes.get("packed_ends", ()), (dq, dk, dv), handle_)
            plan.launch(given + carved + tail, seed, offset, handle_)
            del workspace  # after the launch: the allocator reuses it (and the summed planes) in stream order
        return (dq, dk, dv) if remade is None else (dq, dk, dv, dbias[..., :k.shape[1]])


class Sm90BwdRuntime(ThreeKernelBackward, HopperFamily):
    spec = Sm90Bwd
    SUMS_DBIAS = True
    POINTERS = POINTERS
    MAPS = MAPS
    BIAS_POINTERS = POINTERS
    BIAS_MAPS = MAPS + ("bias_map",)
    BIAS_AT = len(MAPS)
    DBIAS_MAPS = ("dbias_map",)
    reads_block_masks = True

    def block_mask_refusal(self, call: Call):
        """What of a block-mask call the sparse instances lack, or None: the forward's refusals
        (``sparse_refusal``), soft-capping and the deterministic order."""
        why = sparse_refusal(call)
        if why is None and call.p.softcap:
            why = "a block mask with softcap: the sparse backward has no soft-capping"
        if why is None and call.options["deterministic"]:
            why = ("a block mask with deterministic=True: the sparse backward adds dQ in no fixed order (the "
                   "dense fallback runs it)")
        return why

    def check_launch(self, call: Call, binary: KernelBinary) -> None:
        super().check_launch(call, binary)
        if binary.spec.sparse and call.options["deterministic"]:
            raise ValueError(f"{binary.name} adds dQ in no fixed order: deterministic=True is not for it")

    def own_fields(self, call: Call):
        return {}, {**bias_fields(call.bias), **sparse_fields(call.block_mask), **dropout.fields(call.p),
                    **mod_fields(call)}

    def encode(self, params, call: Call, kc: dict, dbias) -> None:
        encode_maps(params, MAPS, (call.q, call.k, call.v, call.grad_out),
                    (kc["block_m"], kc["block_n"], kc["block_n"], kc["block_m"]), call.p, kc)
        encode_bias_map(params, call.bias, call.p)
        encode_dbias_map(params, dbias, call.p)

    def replay_pointers(self, ptr, q, k, v, out, grad_out, lse) -> tuple:
        # tensor maps (q, k, v, grad_out), then POINTERS' out, dout, lse
        return ptr(q), ptr(k), ptr(v), ptr(grad_out), ptr(out), ptr(grad_out), ptr(lse)


RUNTIME = Sm90BwdRuntime()
