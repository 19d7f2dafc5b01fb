"""What flashgen's two Ampere-class families (``sm80_fwd``, ``sm80_bwd``) share at run time:
the calls they refuse (and why), and what a call asks of their kernels.

Both take what the Hopper families take (f16/bf16, equal q/v head dims, band masks,
soft-capping, grouped-query k/v read in place, packed batches), through the same ``Params``
fields, on any GPU from compute capability 8.0 on; on a 9.0 GPU the sm90 families come first
in the dispatch order.  Their inputs only need 8-element (16-byte) alignment, which selection
checks per kernel.  Bias and dropout are the example-41 families': a call with either is
refused with the reason, and the next family is asked.
"""
from __future__ import annotations

from typing import Optional, Sequence

from flashgen.errors import UnsupportedError
from flashgen.runtime.arrays import alignment
from flashgen.runtime.device import device_info
from flashgen.runtime.families import RuntimeFamily, selector
from flashgen.runtime.families.sm90_common import PACKED_ROWS_LIMIT, UNBOUNDED
from flashgen.runtime.select import Request
from flashgen.runtime.validate import Call

MIN_CC = 80  # mma.sync on bf16, ldmatrix, cp.async


class AmpereFamily(RuntimeFamily):
    """A family of flashgen's mma.sync kernels: what they cannot take, and their request."""

    def inputs(self, call: Call) -> Sequence:
        """The arrays the kernels read by 16-byte cp.async (or at that alignment)."""
        return (call.q, call.k, call.v)

    def unfit(self, call: Call) -> Optional[str]:
        """What the call needs that no kernel of the family has, or None."""
        p = call.p
        if call.bias is not None:
            return "no attn_bias (the example-41 families take it)"
        if p.dropout_p > 0:
            return "no dropout (the example-41 families draw it)"
        if p.dtype == "f32":
            return "float16 or bfloat16 only; the call is float32"
        if p.K != p.Kv:
            return f"equal q/v head dims only; the call has {p.K} and {p.Kv}"
        limit = UNBOUNDED if p.seqstart_q is None else PACKED_ROWS_LIMIT  # sm90_common.band()'s range
        if max(call.q.shape[1], call.k.shape[1]) >= limit:
            return f"fewer than {limit} rows per call (the band arithmetic's range)"
        info = device_info(p.device)
        if info.cc < MIN_CC:
            return f"a GPU of compute capability 8.0 or newer; GPU {p.device} is {info.name} (sm_{info.cc})"
        return None

    def request(self, call: Call) -> Request:
        p = call.p
        arrays = [x for x in self.inputs(call) if x is not None]
        return Request(self.name, p.dtype, p.K, p.Kv, alignment(arrays, (p.K, p.Kv)), False, False,
                       device_info(p.device), band=p.mask != 0 or p.window is not None, softcap=p.softcap > 0)

    def refusal(self, call: Call) -> Optional[str]:
        """``unfit``, or none of the kernels accepts the call (a head dim over the largest tier,
        inputs aligned to fewer than 8 elements, too little shared memory): the next family is asked."""
        why = self.unfit(call)
        if why is not None:
            return why
        req = self.request(call)
        if self.kernel(call, req) is not None:
            return None
        try:
            verdicts = dict.fromkeys(why for _, _, why in selector(call.registry).explain(req))
        except UnsupportedError as e:  # nothing of this family built for the GPU
            return str(e)
        return "none of its kernels accepts the call: " + "; ".join(verdicts)
