"""Running ``sm80_bwd`` (spec/sm80_bwd.py): flashgen's Ampere-class backward, on 8.0 GPUs and later.

Three kernels (prep, main, convert) over one allocation, launched and replayed as ``sm90_bwd``'s
(``ThreeKernelBackward``: the kernels share its workspace layout), so a training step costs
one pool call per backward; only q, k and v go by pointer here, not by tensor map.  What the
family takes and refuses is what flashgen's Ampere-class families share (``AmpereFamily``),
with ``out`` and ``grad_out`` read at the inputs' 8-element alignment too.  A bias call runs on
the ``bias`` instances, which also write dbias when asked (``ThreeKernelBackward.own_outputs``),
except with soft-capping: dbias leaves the kernel from the buffer that holds dS times tanh's
slope, so such a call is refused (example 41 has no soft-capping either).  Its ``dropout``
instances redraw the mask of ``sm80_fwd``'s (or ``sm90_fwd``'s: one rule, ``runtime/dropout.py``).
"""
from __future__ import annotations

from flashgen.runtime import dropout
from flashgen.runtime.arrays import elem_strides
from flashgen.runtime.families.sm90_bwd import ThreeKernelBackward
from flashgen.runtime.families.sm90_common import AmpereFamily, ampere_bias_fields
from flashgen.runtime.validate import Call
from flashgen.spec.sm80_bwd import Sm80Bwd

# per-call pointers, in Params order: the caller's arrays (replay's order), then those buffers() carves
POINTERS = ("q_ptr", "k_ptr", "v_ptr", "out_ptr", "dout_ptr", "lse_ptr", "lse_log2_ptr", "delta_ptr", "dq_accum_ptr",
            "dq_counter_ptr", "dq_ptr", "dk_ptr", "dv_ptr")
# a bias call's: the bias's pointer after v's (api.py's signature: the bias follows the backward's own arrays)
BIAS_POINTERS = POINTERS[:3] + ("bias_ptr",) + POINTERS[3:]


class Sm80BwdRuntime(ThreeKernelBackward, AmpereFamily):
    spec = Sm80Bwd
    POINTERS = POINTERS
    BIAS_POINTERS = BIAS_POINTERS
    BIAS_AT = 3  # replay_pointers': after q's, k's and v's

    def unfit(self, call: Call):
        why = super().unfit(call)
        if why is None and call.p.softcap and call.options.get("bias_requires_grad"):
            why = ("softcap with bias_requires_grad: the sm80 backward writes dbias from the buffer that holds dS "
                   "times tanh's slope (without bias_requires_grad it serves the call)")
        return why

    def own_fields(self, call: Call):
        """q, k and v by pointer and strides (sm90_bwd's Params has tensor maps of them), the bias's and
        dropout's."""
        q, k, v = call.q, call.k, call.v
        qs, ks, vs = elem_strides(q), elem_strides(k), elem_strides(v)
        return (dict(q_stride_m=qs[1], q_stride_h=qs[2], k_stride_m=ks[1], k_stride_h=ks[2], v_stride_m=vs[1],
                     v_stride_h=vs[2]),
                dict(q_ptr=q.data.ptr, k_ptr=k.data.ptr, v_ptr=v.data.ptr, q_stride_b=qs[0], k_stride_b=ks[0],
                     v_stride_b=vs[0], **ampere_bias_fields(call.bias), **dropout.fields(call.p)))

    def replay_pointers(self, ptr, q, k, v, out, grad_out, lse) -> tuple:
        return ptr(q), ptr(k), ptr(v), ptr(out), ptr(grad_out), ptr(lse)


RUNTIME = Sm80BwdRuntime()
