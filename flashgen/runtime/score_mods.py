"""Score mods at run time: which declaration a call asks for, its captured tensors checked once, and
the Params fields that point the kernels at them.

``attention_forward(q, k, v, score_mod="alibi", mod_tensors={"slope": s})`` runs an sm90_fwd
instance built with that mod (spec/score_mods.py); the backward takes the same two arguments.  A
mod is named by a string (a built-in's name, or one a mods file declared and ``flashgen build
--mods`` built) or given as its ``ScoreMod`` declaration, which finds the instances built from the
same declaration whatever their name.  Selection takes only instances whose recorded digest is
that of the declaration asked for (``select.rejection``), so a kernel built from an edited mods
file is refused rather than run.

A score-mod call takes a launch plan like any other (api.py): its captured tensors, by name in
sorted order, end the plan's arrays, and their pointers the plan's per-call words
(``BoundScoreMod.plan_pointers``); their shapes, strides and dtypes are in the plan's key, so
a call that replays one has tensors this module would have accepted.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Tuple

from flashgen.errors import UnsupportedError
from flashgen.mods import BUILTIN_MODS, ModError, ScoreMod
from flashgen.runtime.arrays import as_array, elem_strides
from flashgen.spec import score_mods


@dataclass(frozen=True)
class BoundScoreMod:
    """A call's score mod: its name in the manifests, the digest instances must carry, and the
    captured tensors (their names and CuPy views), in the declaration's order."""

    name: str
    digest: str
    mod: ScoreMod
    names: Tuple[str, ...]
    arrays: Tuple[object, ...]

    def fields(self) -> dict:
        """The Params fields of the captured tensors (mod_ptr[i], mod_stride[i][d], in elements)."""
        out = {}
        for i, x in enumerate(self.arrays):
            out[f"mod_ptr_{i}"] = x.data.ptr
            out.update((f"mod_stride_{i}_{d}", s) for d, s in enumerate(elem_strides(x)))
        return out

    def plan_pointers(self) -> Tuple[str, ...]:
        """The Params fields of the captured tensors' pointers in the order a planned call passes the
        tensors (api.py: by name, sorted), not the declaration's."""
        return tuple(f"mod_ptr_{self.names.index(t)}" for t in sorted(self.names))


def _contiguous(x) -> bool:
    """Row-major without gaps (dims of one element may have any stride)."""
    step = 1
    for n, s in zip(reversed(x.shape), reversed(elem_strides(x))):
        if n > 1 and s != step:
            return False
        step *= n
    return True


def build_command(name: str, builtin: bool) -> str:
    """The command that builds score mod ``name``'s instances for Hopper."""
    mods = "" if builtin else "--mods <the mods file declaring it> "
    return f"flashgen build {mods}--arch sm90a --kernels '*_mod_{name}_*' --out <dir>"


def not_built(name: str, builtin: bool) -> UnsupportedError:
    return UnsupportedError(f"score mod {name!r} is not built: build its sm90 instances with "
                            f"`{build_command(name, builtin)}` and put <dir> on FLASHGEN_KERNEL_PATH "
                            "(flashgen.set_kernel_path)")


def _declaration(score_mod, registry) -> Tuple[str, ScoreMod]:
    """(name, declaration) of what the caller asked for."""
    recorded = {}  # name -> the manifests' record of a mod, the first found
    for binary in registry.binaries.values():
        if binary.score_mod is not None:
            recorded.setdefault(binary.score_mod["name"], binary.score_mod)
    if isinstance(score_mod, ScoreMod):
        digest = score_mod.digest()
        name = next((n for n, rec in recorded.items() if rec["digest"] == digest), None)
        if name is None:
            raise not_built("<its name in your mods file>", False)
        return name, score_mod
    if not isinstance(score_mod, str):
        raise TypeError(f"score_mod must be a mod's name or a flashgen.mods.ScoreMod; got {type(score_mod).__name__}")
    builtin = BUILTIN_MODS.get(score_mod)
    if score_mod == "softcap":
        raise UnsupportedError("the built-in softcap mod is the run-time option softcap=c of every sm90 kernel: "
                               "pass that instead of score_mod='softcap'")
    if builtin is not None and not isinstance(builtin, ScoreMod):
        raise ValueError(f"{score_mod!r} is a mask mod: pass it as a block mask, block_mask=flashgen.block_mask("
                         f"{score_mod!r}, B, H, M, N, mod_tensors=...)")
    if builtin is not None:
        return score_mod, builtin
    if score_mod not in recorded:
        raise not_built(score_mod, False)
    try:
        return score_mod, score_mods.from_record(recorded[score_mod])
    except ModError as e:
        raise UnsupportedError(str(e)) from None


def _refusal(call_options: Mapping, p) -> Optional[str]:
    """What a score-mod call has that no score-mod instance takes, or None."""
    if call_options["attn_bias"] is not None:
        return "attn_bias (add the bias in the mod's expression)"
    if call_options["block_mask"] is not None:
        return "a block mask"
    if p.softcap:
        return "softcap (soft-cap in the mod's expression: tanh)"
    if p.dropout_p:
        return "dropout"
    if p.seqstart_q is not None:
        return "cu_seqlens (packed batches)"
    if p.mask == 2 and p.M > p.N:  # bottom_right (validate.MASKS): rows without keys are split off, shifting q_idx
        return "causal='bottom_right' with more queries than keys"
    return None


def check_no_grad(mod: str, name: str, tensor) -> None:
    """Refuse a captured tensor that requires grad: no gradient flows into captured tensors."""
    if getattr(tensor, "requires_grad", False):
        raise UnsupportedError(f"score mod {mod!r}: mod_tensors[{name!r}] requires grad, but gradients into "
                               f"captured tensors are not computed; pass it detached ({name}.detach())")


def bind(options: Mapping, p, q, k) -> Optional[BoundScoreMod]:
    """The call's score mod with its captured tensors checked (names, dtype, shape, device,
    contiguity), or None without one; raises before anything is launched."""
    score_mod, tensors = options.get("score_mod"), options.get("mod_tensors")
    if score_mod is None:
        if tensors:
            raise ValueError("mod_tensors without score_mod: name the mod that captures them")
        return None
    name, mod = _declaration(score_mod, options["registry"])
    why = _refusal(options, p)
    if why is not None:
        raise UnsupportedError(f"score mod {name!r} with {why} is not supported")
    if tensors is not None and not isinstance(tensors, Mapping):
        raise TypeError(f"mod_tensors must be a dict of name -> tensor; got {type(tensors).__name__}")
    tensors = dict(tensors or {})
    for t, x in tensors.items():
        check_no_grad(name, t, x)
    sizes = dict(B=p.B, H=p.H, Hk=k.shape[2], M=q.shape[1], N=k.shape[1])
    given = mod.bind(tensors, sizes, name)
    names, arrays = tuple(mod.specs(name)), []
    for t in names:
        x = as_array(given[t], f"mod_tensors[{t!r}]")
        if x.device.id != p.device:
            raise ValueError(f"score mod {name!r}: mod_tensors[{t!r}] is on GPU {x.device.id}, q is on GPU {p.device}")
        if not _contiguous(x):
            raise ValueError(f"score mod {name!r}: mod_tensors[{t!r}] must be contiguous (the kernels read it as "
                             f"declared); pass a contiguous copy")
        arrays.append(x)
    return BoundScoreMod(name, mod.digest(name), mod, names, tuple(arrays))
