"""Bench points under a score mod: flashgen's compiled-in mod beside flex_attention's ``score_mod``.

A ``Point`` with ``score_mod`` set times attention whose scores that mod rewrites, causal or not as
the point says.  The one mod the bench knows is the built-in ``alibi``,
``score - slope[h] * |q_idx - kv_idx|`` with the ALiBi paper's slopes 2^(-8 (h + 1) / H): flashgen
runs its ALiBi instances (``score_mod="alibi"``, the slopes as ``mod_tensors``), flex the same
expression as a Python ``score_mod`` that torch.compile turns into its Triton kernels (compiled once
per shape, during the warm-up).  SDPA and FlashAttention-4 take no score mod: their cells say so.
A mod costs no FLOPs in FlashAttention's count, so TFLOP/s compare with the plain points' too.
"""
from __future__ import annotations

from typing import List

from flashgen.bench import Point, Timed, causal_option, flashgen_entries, flashgen_torch_entries, flex_entries

SCORE_MODS = ("alibi",)


def slopes(heads: int, torch, device):
    """The ALiBi paper's geometric slopes, one per query head, float32 on ``device`` (the inputs')."""
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / heads) for h in range(heads)], dtype=torch.float32, device=device)


def flex_score_mod(mod: str, slope):
    """The point's mod as flex's ``score_mod(score, b, h, q_idx, kv_idx)`` over torch tensors."""
    if mod not in SCORE_MODS:
        raise ValueError(f"unknown bench score mod {mod!r}; the bench knows {', '.join(SCORE_MODS)}")
    return lambda score, b, h, q_idx, kv_idx: score - slope[h] * abs(q_idx - kv_idx)


def entries(p: Point, impls: List[str], sets, t_sets, torch) -> List[Timed]:
    """Each asked implementation's forward and backward under the point's score mod (``bench_point``)."""
    flex_score_mod(p.score_mod, None)  # an unknown mod fails before anything is set up
    causal = causal_option(p)
    t_slopes = slopes(p.heads, torch, device=sets[0][0].device)
    out: List[Timed] = []
    if "flashgen" in impls:
        import cupy

        out += flashgen_entries(sets, torch, score_mod=p.score_mod, mod_tensors={"slope": cupy.from_dlpack(t_slopes)},
                                **causal)
    if "flashgen-torch" in impls:
        out += flashgen_torch_entries(sets, torch, score_mod=p.score_mod, mod_tensors={"slope": t_slopes}, **causal)
    for impl in impls:
        if impl == "fa4" or impl.startswith("sdpa-"):
            out += [Timed(impl, direction, None, error="takes no score mod") for direction in ("fwd", "bwd")]
    if "flex" in impls:
        out += flex_entries(p, t_sets, torch, score_mod=flex_score_mod(p.score_mod, t_slopes))
    return out
