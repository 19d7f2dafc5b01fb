"""Declared score and mask modifications ("AOT Flex", issue 17): the language, checked once.

A mods file is Python that binds names to declarations::

    alibi = ScoreMod("score - slope[h] * abs(q_idx - kv_idx)", tensors={"slope": "f32[H]"}, grad="1")
    document = MaskMod("doc[b, q_idx] == doc[b, kv_idx]", tensors={"doc": "i32[B, N]"})

Each expression is a small C subset over ``b, h, q_idx, kv_idx`` (and ``score`` in a score
mod) and the captured tensors, indexed with exactly their declared rank.  ``grad`` is the
derivative of the modified score with respect to ``score`` (an expression of the same names):
gradients into captured tensors are not computed.  Everything is parsed here, before anything
is generated or launched, so a typo is reported with its line and column, not by nvcc.

One parse yields the three things the rest of flashgen needs from a mod: the C++ expression a
kernel instance compiles (``cpp``), the same expression over NumPy or CuPy index arrays
(``function``: what ``flashgen.block_mask`` evaluates, and what references compute), and a
``digest`` of its canonical form for the manifest.  Until kernels compile mask mods, one runs
through the block mask it derives: ``flashgen.block_mask("document", B, H, M, N, mod_tensors={"doc": ids})``.
"""
from __future__ import annotations

import hashlib
import json
import re
import runpy
from dataclasses import dataclass, field
from typing import Dict, Mapping, Optional, Tuple

INDICES = ("b", "h", "q_idx", "kv_idx")
DIMS = ("B", "H", "Hk", "M", "N")
# a captured tensor's dtype, as declared: the array dtype it must have
DTYPES = {"f16": "float16", "bf16": "bfloat16", "f32": "float32", "i32": "int32", "i64": "int64", "bool": "bool"}
# name: (arity, C++ for float operands, C++ for integer operands)
FUNCTIONS = {"abs": (1, "fabsf", "abs"), "min": (2, "fminf", "min"), "max": (2, "fmaxf", "max"),
             "exp": (1, "expf", None), "log": (1, "logf", None), "tanh": (1, "tanhf", None),
             "sqrt": (1, "sqrtf", None), "floor": (1, "floorf", None), "ceil": (1, "ceilf", None)}
_TOKEN = re.compile(r"\s*(?:(?P<num>\d+\.\d*(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+|\.\d+(?:[eE][-+]?\d+)?|\d+)"
                    r"|(?P<name>[A-Za-z_]\w*)|(?P<op>&&|\|\||==|!=|<=|>=|[-+*/%<>!?:(),\[\]]))")
_BINARY = (("||",), ("&&",), ("==", "!="), ("<", "<=", ">", ">="), ("+", "-"), ("*", "/", "%"))
_LOGICAL = {"||", "&&", "==", "!=", "<", "<=", ">", ">="}


class ModError(ValueError):
    """A declaration that cannot be compiled: the mod, the place, what was expected."""


@dataclass(frozen=True)
class TensorSpec:
    """A captured tensor's declared dtype and dims (names from DIMS or fixed sizes), e.g. ``i32[B, N]``."""

    dtype: str
    dims: Tuple[object, ...]

    @classmethod
    def parse(cls, spec: str, where: str) -> "TensorSpec":
        match = re.fullmatch(r"\s*(\w+)\s*\[([^\]]*)\]\s*", spec) if isinstance(spec, str) else None
        dims = tuple(d.strip() for d in match.group(2).split(",")) if match else ()
        if not match or match.group(1) not in DTYPES or not all(d in DIMS or d.isdigit() for d in dims):
            raise ModError(f"{where}: tensor spec {spec!r} is not dtype[dims], dtype one of {', '.join(DTYPES)}, "
                           f"dims from {', '.join(DIMS)} or sizes (e.g. 'i32[B, N]')")
        return cls(match.group(1), tuple(d if d in DIMS else int(d) for d in dims))

    def __str__(self) -> str:
        return f"{self.dtype}[{', '.join(map(str, self.dims))}]"


@dataclass(frozen=True)
class _Node:
    kind: str  # num, name, tensor, call, unary, binary, ternary
    value: str
    args: Tuple["_Node", ...]
    at: int  # offset into the expression, for errors
    floating: bool = False  # the value is a float (else an integer or a bool)
    boolean: bool = False


@dataclass(frozen=True)
class _Mod:
    expr: str
    tensors: Mapping[str, str] = field(default_factory=dict)

    KIND = ""
    NAMES = INDICES  # what the expression may name besides its tensors

    def specs(self, name: str = "") -> Dict[str, TensorSpec]:
        where = f"{self.KIND} {name}".strip()
        if not isinstance(self.tensors, Mapping):
            raise ModError(f"{where}: tensors must be a dict of name -> spec, got {type(self.tensors).__name__}")
        for t in self.tensors:
            if not _identifier(t) or t in self.NAMES or t in FUNCTIONS:
                raise ModError(f"{where}: captured tensor name {t!r} must be an identifier that is not an index "
                               "name, 'score' or a function")
        return {t: TensorSpec.parse(spec, f"{where}, tensor {t!r}") for t, spec in self.tensors.items()}

    def tree(self, name: str = "") -> _Node:
        return _Parser(self.expr, self.NAMES, self.specs(name), f"{self.KIND} {name}".strip()).parse()

    def cpp(self, name: str = "") -> str:
        """The C++ expression: indices and ``score`` as themselves, tensor ``t`` as ``t(i, j)`` (the
        generated functor defines an accessor per tensor: pointer and element strides)."""
        return _cpp(self.tree(name))

    def digest(self, name: str = "") -> str:
        """sha256 of the canonical form (kind, expressions as re-emitted, tensor specs): spaces do not
        change it, anything a kernel would compile differently does."""
        canon = {"kind": self.KIND, "expr": self.cpp(name), "grad": self._grad_cpp(name),
                 "tensors": {t: str(s) for t, s in sorted(self.specs(name).items())}}
        return hashlib.sha256(json.dumps(canon, sort_keys=True).encode()).hexdigest()

    def _grad_cpp(self, name: str) -> Optional[str]:
        return None

    def bind(self, tensors: Mapping[str, object], sizes: Mapping[str, int], name: str = "") -> Dict[str, object]:
        """The captured tensors checked against their specs before anything runs: every one given and
        nothing else, dtype, rank and the sizes known in ``sizes`` (the call's B, H, M, N, Hk)."""
        where = f"{self.KIND} {name}".strip()
        specs, given = self.specs(name), dict(tensors or {})
        if set(given) != set(specs):
            raise ModError(f"{where} captures {sorted(specs) or 'no tensors'}; got {sorted(given) or 'none'}")
        for t, spec in specs.items():
            x = given[t]
            dtype = str(getattr(x, "dtype", type(x).__name__)).replace("torch.", "")
            if dtype != DTYPES[spec.dtype]:
                raise TypeError(f"{where}: tensor {t!r} must be {DTYPES[spec.dtype]} ({spec}), got {dtype}")
            shape = tuple(getattr(x, "shape", ()))
            want = tuple(d if isinstance(d, int) else sizes.get(d) for d in spec.dims)
            if len(shape) != len(want) or any(w is not None and n != w for n, w in zip(shape, want)):
                known = ", ".join(f"{d}={sizes[d]}" for d in spec.dims if d in sizes)
                raise ModError(f"{where}: tensor {t!r} is declared {spec}{f' ({known})' if known else ''}; "
                               f"got shape {shape}")
        return given

    def function(self, tensors: Mapping[str, object] = None, xp=None, name: str = ""):
        """``fn(b, h, q_idx, kv_idx, score=None)`` over broadcastable index arrays of ``xp`` (NumPy or
        CuPy; by default the tensors' kind): a mask mod's is what ``flashgen.block_mask`` takes, a score
        mod's gives references their modified scores.  Integer / and % truncate toward zero, as in C."""
        tree = self.tree(name)
        return lambda b, h, q_idx, kv_idx, score=None: _evaluate(
            tree, dict(b=b, h=h, q_idx=q_idx, kv_idx=kv_idx, score=score), tensors, _xp(xp, tensors))


@dataclass(frozen=True)
class MaskMod(_Mod):
    """A boolean expression: True where key ``kv_idx`` stays visible to query ``q_idx``."""

    KIND = "MaskMod"

    def tree(self, name: str = "") -> _Node:
        node = super().tree(name)
        if not node.boolean:
            raise ModError(_where(f"MaskMod {name}".strip(), self.expr, node.at,
                                  "a mask mod must be boolean: a comparison, && / || / ! or a bool tensor"))
        return node


@dataclass(frozen=True)
class ScoreMod(_Mod):
    """A new score from ``score`` (the scaled q.k) and the indices; ``grad`` its derivative in ``score``."""

    grad: Optional[str] = None

    KIND = "ScoreMod"
    NAMES = INDICES + ("score",)

    def grad_tree(self, name: str = "") -> _Node:
        if not isinstance(self.grad, str):
            raise ModError(f"ScoreMod {name}: grad= (the derivative of the new score with respect to score, e.g. "
                           "'1' for an added bias) is required; gradients into captured tensors are not computed")
        return _Parser(self.grad, self.NAMES, self.specs(name), f"ScoreMod {name} grad".strip()).parse()

    def grad_cpp(self, name: str = "") -> str:
        """The C++ of ``grad``, as ``cpp`` translates the expression."""
        return _cpp(self.grad_tree(name))

    def _grad_cpp(self, name: str) -> Optional[str]:
        return self.grad_cpp(name)


# Built-ins.  causal, sliding_window and softcap are what the kernels' own options do already
# (causal=, window=, softcap=): declared here so that a mods file can name them, served by those.
BUILTIN_MODS: Dict[str, _Mod] = {
    "alibi": ScoreMod("score - slope[h] * abs(q_idx - kv_idx)", tensors={"slope": "f32[H]"}, grad="1"),
    "document": MaskMod("doc[b, q_idx] == doc[b, kv_idx]", tensors={"doc": "i32[B, N]"}),
    "prefix_lm": MaskMod("kv_idx < prefix[b] || kv_idx <= q_idx", tensors={"prefix": "i32[B]"}),
    "causal": MaskMod("kv_idx <= q_idx"),
    "sliding_window": MaskMod("kv_idx <= q_idx && q_idx - kv_idx < window[0]", tensors={"window": "i32[1]"}),
    "softcap": ScoreMod("cap[0] * tanh(score / cap[0])", tensors={"cap": "f32[1]"},
                        grad="1 - tanh(score / cap[0]) * tanh(score / cap[0])"),
}


def load_mods(path) -> Dict[str, _Mod]:
    """The ScoreMod and MaskMod values a mods file binds, by name, each checked (ModError names the
    mod and the place).  A name may repeat a built-in's only with the same declaration."""
    found = {name: value for name, value in runpy.run_path(str(path)).items() if isinstance(value, _Mod)}
    if not found:
        raise ModError(f"{path}: binds no ScoreMod or MaskMod (e.g. alibi = ScoreMod('score - ...', ...))")
    for name, mod in found.items():
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            raise ModError(f"{path}: mod name {name!r} is not a C identifier (it names kernel instances)")
        mod.digest(name)  # parses everything
        builtin = BUILTIN_MODS.get(name)
        if builtin is not None and builtin.digest(name) != mod.digest(name):
            raise ModError(f"{path}: {name!r} is a built-in mod with another declaration; choose another name")
    return found


def _identifier(name) -> bool:
    return isinstance(name, str) and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name) is not None


def _where(who: str, text: str, at: int, what: str) -> str:
    """``who`` at line:column of ``text`` (1-based) with the line and a caret under ``at``."""
    line = text.count("\n", 0, at) + 1
    start = text.rfind("\n", 0, at) + 1
    end = text.find("\n", at)
    source = text[start:end if end >= 0 else len(text)]
    return f"{who}, line {line}, column {at - start + 1}: {what}\n    {source}\n    {' ' * (at - start)}^"


class _Parser:
    """Recursive descent over the C subset, precedence as in C (lowest first: ?:, ||, &&, equality,
    relational, additive, multiplicative, unary)."""

    def __init__(self, text, names, specs: Dict[str, TensorSpec], who: str):
        if not isinstance(text, str) or not text.strip():
            raise ModError(f"{who}: the expression must be a non-empty string, got {text!r}")
        self.text, self.names, self.specs, self.who = text, names, specs, who
        self.tokens, at = [], 0
        while text[at:].strip():
            match = _TOKEN.match(text, at)
            if match is None or not match.lastgroup:
                bad = at + len(text[at:]) - len(text[at:].lstrip())
                raise ModError(_where(who, text, bad, f"unexpected character {text[bad]!r}"))
            self.tokens.append((match.lastgroup, match.group(match.lastgroup), match.start(match.lastgroup)))
            at = match.end()
        self.i = 0

    def parse(self) -> _Node:
        node = self._ternary()
        if self.i < len(self.tokens):
            self._fail("an operator or the end of the expression")
        return node

    def _peek(self, *ops) -> bool:
        return self.i < len(self.tokens) and self.tokens[self.i][0] == "op" and self.tokens[self.i][1] in ops

    def _fail(self, expected: str):
        at = self.tokens[self.i][2] if self.i < len(self.tokens) else len(self.text.rstrip())
        found = repr(self.tokens[self.i][1]) if self.i < len(self.tokens) else "the end"
        raise ModError(_where(self.who, self.text, at, f"expected {expected}, found {found}"))

    def _expect(self, op: str) -> None:
        if not self._peek(op):
            self._fail(repr(op))
        self.i += 1

    def _ternary(self) -> _Node:
        cond = self._binary(0)
        if not self._peek("?"):
            return cond
        self.i += 1
        a = self._ternary()
        self._expect(":")
        b = self._ternary()
        return _Node("ternary", "?", (cond, a, b), cond.at, a.floating or b.floating, a.boolean and b.boolean)

    def _binary(self, level: int) -> _Node:
        if level == len(_BINARY):
            return self._unary()
        node = self._binary(level + 1)
        while self._peek(*_BINARY[level]):
            op = self.tokens[self.i][1]
            self.i += 1
            right = self._binary(level + 1)
            floating = node.floating or right.floating
            if op == "%" and floating:
                raise ModError(_where(self.who, self.text, node.at, "% takes integers (use a float expression "
                                                                      "without it)"))
            node = _Node("binary", op, (node, right), node.at, floating and op not in _LOGICAL, op in _LOGICAL)
        return node

    def _unary(self) -> _Node:
        if self._peek("-", "!"):
            op, at = self.tokens[self.i][1], self.tokens[self.i][2]
            self.i += 1
            x = self._unary()
            return _Node("unary", op, (x,), at, x.floating and op == "-", op == "!")
        return self._primary()

    def _arguments(self, close: str) -> Tuple[_Node, ...]:
        args = [self._ternary()]
        while self._peek(","):
            self.i += 1
            args.append(self._ternary())
        self._expect(close)
        return tuple(args)

    def _primary(self) -> _Node:
        if self.i >= len(self.tokens):
            self._fail("a number, a name or '('")
        kind, text, at = self.tokens[self.i]
        self.i += 1
        if kind == "num":
            return _Node("num", text, (), at, floating=not text.isdigit())
        if kind == "op" and text == "(":
            node = self._ternary()
            self._expect(")")
            return node
        if kind != "name":
            self.i -= 1
            self._fail("a number, a name or '('")
        if text in FUNCTIONS and self._peek("("):
            self.i += 1
            args = self._arguments(")")
            arity, _, integer = FUNCTIONS[text]
            if len(args) != arity:
                raise ModError(_where(self.who, self.text, at, f"{text} takes {arity} argument(s), got {len(args)}"))
            floating = integer is None or any(a.floating for a in args)
            return _Node("call", text, args, at, floating)
        if text in self.specs:
            spec = self.specs[text]
            if not self._peek("["):
                raise ModError(_where(self.who, self.text, at, f"tensor {text} is {spec}: index it, {text}[...]"))
            self.i += 1
            args = self._arguments("]")
            if len(args) != len(spec.dims):
                raise ModError(_where(self.who, self.text, at, f"tensor {text} is {spec}: {len(spec.dims)} "
                                                                 f"index(es), got {len(args)}"))
            return _Node("tensor", text, args, at, spec.dtype in ("f16", "bf16", "f32"), spec.dtype == "bool")
        if text in self.names:
            return _Node("name", text, (), at, floating=text == "score")
        allowed = ", ".join(list(self.names) + list(self.specs))
        raise ModError(_where(self.who, self.text, at, f"unknown name {text!r} (this mod may use {allowed} and "
                                                         f"the functions {', '.join(FUNCTIONS)})"))


def _cpp(node: _Node) -> str:
    if node.kind == "num":
        return node.value + ("f" if node.floating else "")
    if node.kind == "name":
        return node.value
    args = [_cpp(a) for a in node.args]
    if node.kind == "tensor":
        return f"{node.value}({', '.join(args)})"
    if node.kind == "call":
        _, floating, integer = FUNCTIONS[node.value]
        return f"{floating if node.floating else integer}({', '.join(args)})"
    if node.kind == "unary":
        return f"{node.value}({args[0]})"
    if node.kind == "binary":
        return f"({args[0]} {node.value} {args[1]})"
    return f"({args[0]} ? {args[1]} : {args[2]})"


def _xp(xp, tensors):
    if xp is not None:
        return xp
    import numpy as np

    first = next(iter((tensors or {}).values()), None)
    return np if first is None or type(first).__module__.startswith("numpy") else __import__("cupy")


def _evaluate(node: _Node, names: dict, tensors: Mapping, xp):
    if node.kind == "num":
        return float(node.value) if node.floating else int(node.value)
    if node.kind == "name":
        if names[node.value] is None:
            raise ModError("score is needed to evaluate this mod: pass score= to the function")
        return names[node.value]
    args = [_evaluate(a, names, tensors, xp) for a in node.args]
    if node.kind == "tensor":
        return tensors[node.value][tuple(args)]
    if node.kind == "call":
        name = node.value
        return {"abs": xp.abs, "min": xp.minimum, "max": xp.maximum}.get(name, getattr(xp, name))(*args)
    if node.kind == "unary":
        return xp.logical_not(args[0]) if node.value == "!" else -args[0]
    if node.kind == "ternary":
        return xp.where(*args)
    a, b = args
    op = node.value
    if op in ("/", "%") and not node.floating:  # C: the quotient truncates toward zero
        remainder = xp.fmod(a, b)
        return remainder if op == "%" else (a - remainder) // b
    return {"+": lambda: a + b, "-": lambda: a - b, "*": lambda: a * b, "/": lambda: a / b,
            "<": lambda: a < b, "<=": lambda: a <= b, ">": lambda: a > b, ">=": lambda: a >= b,
            "==": lambda: a == b, "!=": lambda: a != b,
            "&&": lambda: xp.logical_and(a, b), "||": lambda: xp.logical_or(a, b)}[op]()
