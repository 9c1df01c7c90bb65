"""Loading a base's ``model.pt2`` without running code that a writer of the model folder controls.

``torch.export.load`` (torch 2.13) runs such code in two ways:

- it unpickles, with ``weights_only=False``, the weights and constants that are tensor subclasses
  and legacy weight files; custom and opaque objects with plain pickle; and it falls back to
  ``weights_only=False`` for sample inputs it cannot load safely;
- it hands every symbolic size's ``expr_str`` (``Symbol('s0', positive=True, integer=True)``,
  ``Mul(Integer(9), Symbol(...))``) to ``sympy.sympify``, which evaluates it as Python.

Our export writes no pickled objects (plain tensors are raw bytes plus JSON metadata), and its
expressions are sympy's ``srepr`` of sizes. So an archive holding an object file is refused,
every ``torch.load`` the loader makes is forced to ``weights_only=True``, and before anything is
loaded every ``expr_str`` in the archive's JSON must parse in ``EXPRESSION``'s grammar: calls of
a few sympy and torch size functions on integers and size symbols, nothing else (no names, no
attributes, no other calls), and not too long or deep.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from streamtrain.delivery.spec import FormatError

_FORCE_SAFE = "TORCH_FORCE_WEIGHTS_ONLY_LOAD"
_CUSTOM_OBJ = "custom_obj_"
_OPAQUE_OBJ = "opaque_obj_"
_LOAD_LOCK = threading.Lock()

# What a size expression may call: sympy's arithmetic and relations, and torch's integer size
# functions (torch/_export/serde/serialize.py's sympy_functions). Not Pow: 10**(10**12) is one
# short string that sympy would compute.
FUNCTIONS = frozenset(
    {
        "Add", "Mul", "Max", "Min", "Equality", "Unequality", "LessThan", "StrictLessThan", "GreaterThan",
        "StrictGreaterThan", "And", "Or", "Not", "FloorDiv", "CleanDiv", "CeilDiv", "Mod", "PythonMod",
        "ModularIndexing",
    }
)  # fmt: skip
# sympy's assumptions, as srepr writes them: Symbol('s0', positive=True, integer=True).
ASSUMPTIONS = frozenset({"integer", "positive", "nonnegative", "negative", "nonpositive", "real", "finite", "nonzero"})
EXPRESSION = """
    expression := Integer(<int>) | Symbol('<name>'[, <assumption>=True|False]...) | <function>(<expression>, ...)
    <int>: at most 19 digits, optionally negative; <name>: lower-case letters then digits (s0, u12)
"""
MAX_LENGTH = 65_536
MAX_DEPTH = 64
_TOKEN = re.compile(r"\s*(?:([A-Za-z]+)|(-?\d{1,19})(?!\d)|'([a-z]+\d+)'|([(),=]))")


class UnsafeBase(FormatError):
    """A base whose program would run code from its folder when loaded."""

    def __init__(self, message: str):
        super().__init__("unsafe_base", message)


def load_program(path: Path) -> torch.export.ExportedProgram:
    """``torch.export.load`` of ``path``, refused (``UnsafeBase``) if the archive holds pickled
    objects or an expression outside the grammar; the variable that forces ``weights_only`` is
    the process's, so it is set only around the load, under a lock."""
    check_archive(path)
    with _LOAD_LOCK:
        previous = os.environ.get(_FORCE_SAFE)
        os.environ[_FORCE_SAFE] = "1"
        try:
            return torch.export.load(path)
        except pickle.UnpicklingError as error:
            raise UnsafeBase(f"{path} holds a pickle that is not plain tensors: refused ({error})") from None
        finally:
            if previous is None:
                del os.environ[_FORCE_SAFE]
            else:
                os.environ[_FORCE_SAFE] = previous


def check_archive(path: Path) -> None:
    """Refuses an archive with a pickled object, a JSON file that is not JSON, or an ``expr_str``
    outside the grammar, reading its entries only."""
    with zipfile.ZipFile(path) as archive:
        for name in archive.namelist():
            leaf = name.rsplit("/", 1)[-1]
            if leaf.startswith((_CUSTOM_OBJ, _OPAQUE_OBJ)):
                raise UnsafeBase(f"{path} holds {name}, a pickled object: refused (a base holds tensors only)")
            if not name.endswith(".json"):
                continue
            try:
                document = json.loads(archive.read(name))
            except (ValueError, RecursionError) as error:
                raise UnsafeBase(f"{path}: {name} is not JSON ({error!r:.200}): refused") from None
            for expression in _expressions(document):
                why = expression_problem(expression)
                if why is not None:
                    raise UnsafeBase(
                        f"{path}: {name} holds the size expression {expression[:200]!r}, which {why}: refused "
                        f"(a base's expressions are {EXPRESSION.strip()})"
                    )


def _expressions(node: Any) -> Iterator[str]:
    """Every ``expr_str`` value in a JSON document, however deep (iteratively: no recursion limit)."""
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key == "expr_str":
                    yield value if isinstance(value, str) else repr(value)
                else:
                    stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)


def expression_problem(text: str) -> str | None:
    """Why ``text`` is not a size expression of the grammar; None when it is."""
    if len(text) > MAX_LENGTH:
        return f"is longer than {MAX_LENGTH} characters"
    tokens: list[tuple[str, str]] = []
    position, end = 0, len(text.rstrip())
    while position < end:
        match = _TOKEN.match(text, position)
        if match is None or match.lastindex is None:
            return f"has {text[position : position + 20].strip()!r} at {position}, not a token of the grammar"
        tokens.append((("word", "int", "name", "punct")[match.lastindex - 1], match[match.lastindex]))
        position = match.end()
    parser = _Parser(tokens)
    why = parser.expression(0)
    if why is None and parser.position != len(tokens):
        why = "goes on after its expression"
    return why


class _Parser:
    """A recursive-descent reader of ``EXPRESSION`` over tokens, bounded in depth."""

    def __init__(self, tokens: list[tuple[str, str]]):
        self.tokens = tokens
        self.position = 0

    def _take(self, kind: str, value: str | None = None) -> str | None:
        if self.position < len(self.tokens):
            found_kind, found = self.tokens[self.position]
            if found_kind == kind and (value is None or found == value):
                self.position += 1
                return found
        return None

    def expression(self, depth: int) -> str | None:
        if depth > MAX_DEPTH:
            return f"nests deeper than {MAX_DEPTH}"
        function = self._take("word")
        if function is None or self._take("punct", "(") is None:
            return "is not a call of Integer, Symbol or a size function"
        if function == "Integer":
            if self._take("int") is None:
                return "has an Integer of something else than up to 19 digits"
            return None if self._take("punct", ")") else "has an Integer of more than one number"
        if function == "Symbol":
            if self._take("name") is None:
                return "has a Symbol whose name is not letters then digits"
            while self._take("punct", ","):
                assumption = self._take("word")
                if assumption not in ASSUMPTIONS or not self._take("punct", "="):
                    return f"has a Symbol with {assumption!r}, not an assumption"
                if self._take("word", "True") is None and self._take("word", "False") is None:
                    return "has an assumption that is not True or False"
            return None if self._take("punct", ")") else "has a Symbol that does not end"
        if function not in FUNCTIONS:
            return f"calls {function!r}, not a size function"
        while True:
            why = self.expression(depth + 1)
            if why is not None:
                return why
            if self._take("punct", ")"):
                return None
            if self._take("punct", ",") is None:
                return f"has an argument of {function} that does not end"
