"""Score mods compiled into the Hopper kernels: which mods the families know, and the C++ functor of each.

A kernel instance of ``sm90_fwd`` or ``sm90_bwd`` with ``score_mod="alibi"`` compiles the declaration
``BUILTIN_MODS["alibi"]`` (flashgen/mods.py) into a functor struct that its source defines before the
kernel type, passed as the kernels' last template parameter (``ScoreMod_``).  The functor has two static
members over the kernel's Params, ``apply(p, score, b, h, q_idx, kv_idx)`` (the new score from the
scaled score) and ``grad(...)`` (its derivative in ``score``), and reads its captured tensors through the
Params' ``mod_ptr[i]`` / ``mod_stride[i][d]`` (tensor i of the declaration's, in declaration order;
strides in elements).  Plain instances take ``flashgen::sm90::NoScoreMod`` instead, which compiles to
nothing.

Which declaration a name means: the built-in score mods, and those a mods file adds for one command
(``flashgen generate/build --mods FILE``: ``declare``).  The kernel spec keeps only the name, so that
a manifest entry still makes its spec (and its name) without the file; the declaration's expression
and digest go into the manifest beside it (``record``).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Dict, Iterable, List, Mapping

from flashgen.mods import BUILTIN_MODS, ModError, ScoreMod, load_mods

# captured tensors and dims a score mod may have: the size of the Params' pointer and stride arrays
MAX_TENSORS = 4
MAX_DIMS = 4
# the score mods in the default set (the others are built from a mods file); soft-capping is a
# run-time option of every instance already
DEFAULT_SCORE_MODS = ("alibi",)

_declared: Dict[str, ScoreMod] = {name: mod for name, mod in BUILTIN_MODS.items() if isinstance(mod, ScoreMod)}

# C++ for a captured element read as a value: (pointee type, read of element `at` of pointer `t`)
_READS = {"f32": ("float", "__ldg(t + at)"), "i32": ("int", "__ldg(t + at)"), "i64": ("long long", "__ldg(t + at)"),
          "f16": ("unsigned short", "static_cast<float>(cutlass::half_t::bitcast(__ldg(t + at)))"),
          "bf16": ("unsigned short", "static_cast<float>(cutlass::bfloat16_t::bitcast(__ldg(t + at)))"),
          "bool": ("unsigned char", "__ldg(t + at) != 0")}


def declare(mods: Mapping[str, object]) -> List[str]:
    """Make the score mods of a mods file (``load_mods``' result) known by name, for the kernels of
    this process to compile; their names, sorted.  A name may repeat a built-in's only with the
    same declaration (``load_mods`` checks that); mask mods are skipped: block masks serve them."""
    names = []
    for name, mod in mods.items():
        if isinstance(mod, ScoreMod):
            check_limits(name, mod)
            _declared[name] = mod
            names.append(name)
    return sorted(names)


def declare_file(path) -> List[str]:
    """``declare`` of the mods in ``path`` (ModError names the mod and the place)."""
    return declare(load_mods(path))


def lookup(name: str) -> ScoreMod:
    """The declaration of score mod ``name``: a built-in, or one a mods file declared."""
    try:
        return _declared[name]
    except KeyError:
        raise ModError(f"score mod {name!r} is not declared: built-ins are {', '.join(sorted(BUILTIN_MODS))}; "
                       "declare others in a mods file (flashgen generate/build --mods FILE)") from None


def check_limits(name: str, mod: ScoreMod) -> None:
    """The Params hold MAX_TENSORS captured tensors of up to MAX_DIMS dims each."""
    specs = mod.specs(name)
    if len(specs) > MAX_TENSORS or any(len(s.dims) > MAX_DIMS for s in specs.values()):
        raise ModError(f"ScoreMod {name}: the kernels take at most {MAX_TENSORS} captured tensors of at most "
                       f"{MAX_DIMS} dims each")
    mod.digest(name)  # parses the expression and its derivative (a backward needs it): line and column


def record(name: str) -> dict:
    """What the manifest records of a score mod instance: the declaration and its digest."""
    mod = lookup(name)
    return {"name": name, "expr": mod.expr, "grad": mod.grad, "tensors": dict(mod.tensors),
            "digest": mod.digest(name)}


def from_record(rec: Mapping) -> ScoreMod:
    """The declaration a manifest records, checked against the digest recorded with it (a record
    edited by hand, or canonicalised by another flashgen, fails here: ModError)."""
    mod = ScoreMod(rec["expr"], tensors=dict(rec.get("tensors", {})), grad=rec.get("grad"))
    if mod.digest(rec["name"]) != rec.get("digest"):
        raise ModError(f"score mod {rec['name']!r}: the manifest's declaration does not match its digest; "
                       "rebuild the kernels")
    return mod


def cpp_type(name: str) -> str:
    """The functor type a kernel with score mod ``name`` passes as ScoreMod_ ("": none)."""
    return f"ScoreMod_{name}" if name else "flashgen::sm90::NoScoreMod"


def functor(name: str) -> str:
    """The C++ of score mod ``name``'s functor (see the module docstring); "" without one."""
    if not name:
        return ""
    mod = lookup(name)
    specs = list(mod.specs(name).items())
    lines = [f"// score mod {name} (digest {mod.digest(name)[:16]}): {' '.join(mod.expr.split())}",
             f"// d/dscore: {' '.join(mod.grad.split())}",
             f"struct {cpp_type(name)} {{",
             "  static constexpr bool kEnabled = true;"]
    members = (("apply", mod.tree(name), mod.cpp(name)), ("grad", mod.grad_tree(name), mod.grad_cpp(name)))
    for member, tree, cpp in members:
        used = _tensors_in(tree)
        lines += ["  template <class Params>",
                  f"  static __device__ __forceinline__ float {member}(Params const& p, float score, int b, int h, "
                  "int q_idx, int kv_idx) {"]
        for i, (tensor, spec) in enumerate(specs):
            if tensor not in used:
                continue
            pointee, read = _READS[spec.dtype]
            dims = ", ".join(f"long long i{d}" for d in range(len(spec.dims)))
            at = " + ".join(f"i{d} * p.mod_stride[{i}][{d}]" for d in range(len(spec.dims))) or "0"
            lines += [f"    auto {tensor} = [&]({dims}) {{",
                      f"      {pointee} const* t = static_cast<{pointee} const*>(p.mod_ptr[{i}]);",
                      f"      long long const at = {at};",
                      f"      return {read};",
                      "    };"]
        lines += [f"    return static_cast<float>({cpp});", "  }"]
    lines.append("};")
    return "\n".join(lines) + "\n"


def _tensors_in(node) -> set:
    """The captured tensors an expression tree reads."""
    found = {node.value} if node.kind == "tensor" else set()
    for arg in node.args:
        found |= _tensors_in(arg)
    return found


def kernels_with(names: Iterable[str], default_set) -> list:
    """The instances of score mods ``names`` of one family: those of the built-in ALiBi's tiles and
    options (the family's rules pick them), each with the mod's name instead."""
    alibi = [k for k in default_set if k.score_mod == DEFAULT_SCORE_MODS[0]]
    return [replace(k, score_mod=name) for name in names for k in alibi]
