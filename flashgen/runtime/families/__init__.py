"""The runtime side of the kernel families: one module per spec family, asked in the spec's order.

The public functions validate a call once (``validate.py``), then ask the families
that serve its direction, in the order of ``flashgen.spec.FAMILIES``, whether they
can take it (``refusal``); the first that can runs it (``run``), and may leave a
launch plan whose ``replay`` serves the same signature next time.  A family's
runtime lives in ``flashgen/runtime/families/<family>.py`` as one ``RUNTIME``
object, a :class:`RuntimeFamily`: adding a family adds that module and its spec to
the spec's list; nothing here or in ``api.py`` names a family.

``FLASHGEN_FAMILIES`` (comma-separated family names; unset or empty: all) limits the
families asked, for testing and benchmarking one family where an earlier one would
serve the call (``FLASHGEN_FAMILIES=sm80_fwd,sm90_bwd`` on an H100 runs the Ampere
forward).  It is read on every dispatch, and it is part of a launch plan's key
(``plans.find``): a plan replays only under the setting it was made with.
"""
from __future__ import annotations

import importlib
import os
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple, Type

from flashgen.errors import UnsupportedError
from flashgen.runtime import tuning
from flashgen.runtime.device import device_info
from flashgen.runtime.plans import FAMILIES_VARIABLE
from flashgen.runtime.registry import KernelBinary, Registry
from flashgen.runtime.select import Request, Selector
from flashgen.runtime.validate import Call, Problem
from flashgen.spec import FAMILIES
from flashgen.spec.core import KernelSpec

Row = Tuple[str, str, str]  # (kernel, target, verdict), as explain() lists them


class RuntimeFamily:
    """How the runtime serves calls from one kernel family (``spec``)."""

    spec: ClassVar[Type[KernelSpec]]
    # whether some kernels of the family read a block mask's lists (a call with one is then asked as
    # it is; the others are asked, if at all, with the mask as a dense bias: block_fallback)
    reads_block_masks: ClassVar[bool] = False

    @property
    def name(self) -> str:
        return self.spec.FAMILY

    def unfit(self, call: Call) -> Optional[str]:
        """What ``call`` needs that no kernel of this family has (bias, dropout, a GPU), or None."""
        return None

    def refusal(self, call: Call) -> Optional[str]:
        """Why this family does not serve ``call`` (the next family is asked), or None: by default
        only ``unfit``; a family may also refuse when none of its kernels accepts the call."""
        return self.unfit(call)

    def request(self, call: Call) -> Request:
        """What ``call`` needs of a kernel of this family (selection, explain, tuning)."""
        raise NotImplementedError

    def run(self, call: Call):
        """Select a kernel and launch it: the outputs of the public function."""
        return self.launch(call, self.kernel(call, self.request(call)))

    def launch(self, call: Call, binary: KernelBinary):
        """Size, allocate and launch ``binary`` for ``call`` (tests call it for each kernel)."""
        raise NotImplementedError

    def replay(self, plan, memory, arrays: Sequence, seed, offset, stream):
        """Serve a call whose signature left ``plan``: allocate (through ``memory``: the caller's
        kind of array), point, launch (plans.py)."""
        raise NotImplementedError

    def kernel(self, call: Call, req: Request) -> Optional[KernelBinary]:
        """The first kernel that accepts ``req``, the tuning table's tile first (None: none does)."""
        return selector(call.registry).find(req, tuned(req, call.p))

    def explain(self, call: Call) -> List[Row]:
        """This family's kernels for the call's GPU in the order tried, each with its verdict."""
        try:
            kernels = call.registry.for_device(self.name, device_info(call.p.device))
        except UnsupportedError:
            return []  # nothing of this family is built for the GPU
        why = score_mod_refusal(self, call) or self.unfit(call)
        if why is not None:
            return [(b.name, b.target, why) for b in kernels]
        req = self.request(call)
        return selector(call.registry).explain(req, tuned(req, call.p))


_selectors: Dict[int, Selector] = {}


def selector(registry: Registry) -> Selector:
    sel = _selectors.get(id(registry))
    if sel is None or sel.registry is not registry:
        sel = _selectors[id(registry)] = Selector(registry)
    return sel


def tuned(req: Request, p: Problem) -> Optional[tuning.Choice]:
    """The tuning table's choice for this call's shape bucket on this device, if any.  None for a packed
    batch: tables are measured on fixed-length calls, and a packed batch's bucket (its longest sequence,
    sequences x heads) says little of its work (the H200 table's bf16 d128 causal 2k entry, a k192 tile
    1% ahead at 8 x 2048, put a packed step's head-dim-128 backward on a tile with half again its work)."""
    if p.seqstart_q is not None:
        return None
    bucket = tuning.Bucket.of(req.family, p.dtype, p.K, p.Kv, p.mask != 0, p.M, p.N, p.batches * p.H,
                              p.group)
    return tuning.choice(req.device, bucket)


def planned_forward_outputs(memory, sizes, q):
    """The out and lse a forward plan allocates per call (shapes recorded in the plan's ``sizes``)."""
    return memory.empty(sizes["out"], q), memory.empty(sizes["lse"], q, f32=True)


def visible_lse(lse, rows: int):
    """lse without the padding rows the kernels write (a view; none when there are none)."""
    return lse if lse.shape[2] == rows else lse[:, :, :rows]


_runtimes: Dict[str, RuntimeFamily] = {}


def runtime(family: str) -> RuntimeFamily:
    """The runtime of the spec family named ``family`` (its module's ``RUNTIME``)."""
    found = _runtimes.get(family)
    if found is None:
        found = _runtimes[family] = importlib.import_module(f"{__name__}.{family}").RUNTIME
    return found


def forced_families() -> Optional[Tuple[str, ...]]:
    """The families ``FLASHGEN_FAMILIES`` allows, or None when it is unset or empty (all).
    A name no family has is a ValueError listing the known ones: a typo must not silently
    dispatch as usual."""
    setting = os.environ.get(FAMILIES_VARIABLE, "")
    names = tuple(dict.fromkeys(n.strip() for n in setting.split(",") if n.strip()))
    if not names:
        return None
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        raise ValueError(f"{FAMILIES_VARIABLE}={setting!r} names no family {', '.join(map(repr, unknown))}; "
                         f"known: {', '.join(FAMILIES)}")
    return names


def serving(direction: str) -> List[RuntimeFamily]:
    """The runtime families of ``direction`` ("fwd" or "bwd"), in the spec's dispatch order
    (those ``FLASHGEN_FAMILIES`` allows)."""
    allowed = forced_families()
    return [runtime(name) for name, cls in FAMILIES.items()
            if cls.DIRECTION == direction and (allowed is None or name in allowed)]


def replay(plan, memory, arrays: Sequence, seed, offset, stream):
    """Serve a call from the launch plan a family left for its signature (that family is loaded)."""
    return _runtimes[plan.family].replay(plan, memory, arrays, seed, offset, stream)


def score_mod_refusal(family: RuntimeFamily, call: Call) -> Optional[str]:
    """A score-mod call goes only to families that compile score mods (a ``score_mod`` axis)."""
    if call.score_mod is not None and "score_mod" not in family.spec.AXES:
        return "no score mods (sm90 instances built with the mod take them)"
    return None


def dispatch(call: Call):
    """Run ``call`` on the first family that accepts it, or say what each family lacks."""
    refusals = []
    for family in serving(call.direction):
        why = score_mod_refusal(family, call) or family.refusal(call)
        if why is None:
            return family.run(call)
        refusals.append(f"  {family.name}: {why}")
    allowed = forced_families()
    if allowed is not None:
        refusals.append(f"  ({FAMILIES_VARIABLE} allows only {', '.join(allowed)})")
    raise UnsupportedError("no kernel family serves this call:\n" + "\n".join(refusals))


def sparse_family(call: Call) -> Optional[RuntimeFamily]:
    """The first family that reads ``call``'s block mask and takes the call (None: the mask goes
    dense, block_fallback)."""
    return next((f for f in serving(call.direction) if f.reads_block_masks and f.refusal(call) is None), None)


def explain(call: Call, dense: Optional[Call] = None) -> List[Row]:
    """Every family's candidates in the order tried; after the selected one, 'not tried'.  With a
    block mask, ``dense`` is the call as the fallback makes it (the mask as a bias): the families
    that read block masks are asked the call first, then, where none takes it, every family the
    dense call, as dispatch does."""
    if dense is None:
        rows = [row for family in serving(call.direction) for row in family.explain(call)]
    else:
        rows = [row for family in serving(call.direction) if family.reads_block_masks
                for row in family.explain(call)]
        if not any(verdict == "selected" for _, _, verdict in rows):
            rows += [row for family in serving(call.direction) for row in family.explain(dense)]
    chosen = next((i for i, (_, _, verdict) in enumerate(rows) if verdict == "selected"), len(rows))
    return rows[:chosen + 1] + [(name, target, "not tried: an earlier kernel was selected")
                                for name, target, _ in rows[chosen + 1:]]
