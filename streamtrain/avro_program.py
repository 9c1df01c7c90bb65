"""Avro decoding compiled to a flat program, run by one numba interpreter over a whole batch.

A (writer schema, reader schema, feature plan) triple becomes a ``Program``: an int64 array of
opcodes with their operands inline, built once per writer schema in a fraction of a millisecond.
One generic interpreter, ``run_programs``, executes the programs of a whole batch in a single call
without the GIL. Compiling one interpreter instead of one function per schema means a single JIT compile,
cached on disk, and a new writer schema id arriving mid-stream costs nothing the trainer can feel.
``Program.describe()`` prints the program, so the "generated decoder" stays readable.

The interpreter trusts nothing in a payload: every read is checked against the payload's end
before it happens (which is why bounds checking can be off), varints are at most 10 bytes, and
every length or block count is checked against the bytes left. A bad payload ends with a status
code naming the reason; the interpreter never raises.

Resolution follows Avro's rules: fields matched by name, added reader fields take their default,
removed writer fields are skipped, int->long/float/double, long->float/double, float->double and
string<->bytes promote, unions pick the first reader branch that matches the writer's. A writer's
null that the reader cannot hold, where a feature or the label is read, is read as a null: no
value. A writer those rules cannot resolve (double -> float, a reader field without a default the
writer lacks, ...) raises ``Unresolvable``: no path can decode its events. Anything else
(recursive types, aliases, features under maps or arrays of records, ...) raises ``Unsupported``
and the caller falls back to fastavro.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import fastavro
import numpy as np
import numpy.typing as npt
from numba import njit

# The status and opcode tables are laid out by hand (packed rows, aligned comments), so the
# formatter leaves them alone.
# fmt: off
# Rejection reasons; a status code is an index into this tuple plus one (0 means decoded).
REASONS = (
    "empty_payload", "truncated", "trailing_bytes", "bad_varint", "bad_length", "bad_union_index",
    "bad_enum_index", "bad_magic_byte", "unknown_schema_id", "missing_label", "non_finite_dense",
    "undecodable", "bad_label", "bad_writer_schema", "unknown_sample_kind", "missing_impression",
    "label_without_positive",
)
OK = 0
(EMPTY_PAYLOAD, TRUNCATED, TRAILING_BYTES, BAD_VARINT, BAD_LENGTH, BAD_UNION_INDEX, BAD_ENUM_INDEX,
 BAD_MAGIC_BYTE, UNKNOWN_SCHEMA_ID, MISSING_LABEL, NON_FINITE_DENSE, UNDECODABLE,
 BAD_LABEL, BAD_WRITER_SCHEMA, UNKNOWN_SAMPLE_KIND, MISSING_IMPRESSION,
 LABEL_WITHOUT_POSITIVE) = range(1, len(REASONS) + 1)
# Not a reason: an event the interpreter must leave alone (its schema is decoded by fastavro).
NOT_MINE = 127

# Opcodes, with their operands in the order they follow the opcode.
END = 0            # payload consumed; then a known sample kind, required labels set, labels in [0, 1], a sample's
                   # impression read, a late label's positive, dense values finite
BOOL = 1           # -> int register
LONG = 2           # zigzag varint (int or long) -> int register
FLOAT = 3          # 4 bytes -> float register
DOUBLE = 4         # 8 bytes -> float register
STRING = 5         # length-prefixed bytes -> fnv1a64 in the hash register
SKIP_BYTES = 6     # length-prefixed bytes, unread
SKIP_FIXED = 7     # n: n bytes, unread
SKIP_VARINT = 8    # a varint, unread
ENUM = 9           # nsym, map[nsym]: writer index -> reader index (or -1: not a reader symbol)
UNION = 10         # n, target[n]: branch index -> jump target (-1: no reader branch matches)
JUMP = 11          # target
BLOCKS = 12        # min_item_bytes, exit_target: starts an array/map's block loop
NEXT_ITEM = 13     # body_target: ends one item; reads the next block count when a block is done
CONST_INT = 14     # value: a reader default
CONST_FLOAT = 15   # float64 bits: a reader default
CONST_HASH = 16    # fnv1a64: a reader default string
ID = 17            # table, num_embeddings, mode (0 modulo, 1 hash, 2 raw): appends the register as a row
DENSE = 18         # column, transform (0 none, 1 log1p)
LABEL = 19         # column: the task whose label this is
TIME = 20          # divisor (1 for milliseconds, 1000 for microseconds)
LONG_ID = 21       # table, num_embeddings, mode: LONG then ID, the commonest pair, in one dispatch
SAMPLE = 22        # slot, a, b: a late-label sample's field (SAMPLE_* below)

_OPERANDS = {END: 0, BOOL: 0, LONG: 0, FLOAT: 0, DOUBLE: 0, STRING: 0, SKIP_BYTES: 0, SKIP_FIXED: 1,
             SKIP_VARINT: 0, JUMP: 1, BLOCKS: 2, NEXT_ITEM: 1, CONST_INT: 1, CONST_FLOAT: 1, CONST_HASH: 1,
             ID: 3, DENSE: 2, LABEL: 1, TIME: 1, LONG_ID: 3, SAMPLE: 3}
_NAMES = ("END", "BOOL", "LONG", "FLOAT", "DOUBLE", "STRING", "SKIP_BYTES", "SKIP_FIXED", "SKIP_VARINT", "ENUM",
          "UNION", "JUMP", "BLOCKS", "NEXT_ITEM", "CONST_INT", "CONST_FLOAT", "CONST_HASH", "ID", "DENSE", "LABEL",
          "TIME", "LONG_ID", "SAMPLE")
# SAMPLE's slots, and the columns of the samples array: a sample's kind (a: the register's value for
# "impression", b: for "label", each a symbol index or a string's fnv1a64), its impression's id, its
# impression's time (a: the divisor to milliseconds). The last column's bits say which of the two
# were read: bit 1 the id, bit 2 the time (their slots' numbers).
SAMPLE_KIND, SAMPLE_IMPRESSION_ID, SAMPLE_IMPRESSION_TIME, SAMPLE_READ = 0, 1, 2, 3
# A sample's kind: no kind (a plain event, trained as without late labels), an impression, a late label.
PLAIN, IMPRESSION, LATE_LABEL = 0, 1, 2
# fmt: on

# Register kinds: what the last read left for the sinks.
KIND_INT, KIND_FLOAT, KIND_HASH = 0, 1, 2
MAX_NESTING = 16
# Items that take no bytes (nulls, empty records) could make a tiny payload claim billions of
# them; this many per payload is the most we walk.
MAX_EMPTY_ITEMS = 1 << 20
FLOAT32_MAX = float(np.finfo(np.float32).max)


class Unsupported(Exception):
    """The schemas use something the program compiler does not handle; decode with fastavro."""


class Unresolvable(Exception):
    """Avro's rules cannot resolve the writer schema to the reader: fastavro cannot read its events either."""


@lru_cache(maxsize=65536)
def fnv1a64(text: str | bytes) -> int:
    """FNV-1a, 64 bits, of the bytes (a string's UTF-8)."""
    h = 0xCBF29CE484222325
    for byte in text.encode("utf-8") if isinstance(text, str) else text:
        h = ((h ^ byte) * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


@dataclass(frozen=True)
class Sink:
    """An instruction that takes the value just read: ID, DENSE, LABEL or TIME, with its operands."""

    op: int
    operands: tuple[int, ...] = ()
    note: str = ""  # for describe(): which table, column, ...


@dataclass
class FeaturePlan:
    """Reader field paths -> sinks, from the feature config and the reader schema."""

    sinks: dict[tuple[str, ...], list[Sink]] = field(default_factory=dict)

    def add(self, path: str, sink: Sink) -> None:
        self.sinks.setdefault(tuple(path.split(".")), []).append(sink)

    def under(self, path: tuple[str, ...]) -> bool:
        return any(p[: len(path)] == path for p in self.sinks)


@dataclass
class Program:
    code: np.ndarray  # int64
    notes: dict[int, str] = field(default_factory=dict)  # position -> the field or feature it serves

    def describe(self) -> str:
        """One line per instruction: its position, name, operands, and what it is for."""
        lines, pc, code = [], 0, self.code.tolist()
        while pc < len(code):
            op = code[pc]
            count = 1 + code[pc + 1] if op in (ENUM, UNION) else _OPERANDS[op]
            operands = code[pc + 1 : pc + 1 + count]
            text = " ".join(str(o) for o in operands)
            if op == CONST_FLOAT:
                text = repr(struct.unpack("<d", struct.pack("<q", operands[0]))[0])
            elif op == CONST_HASH:
                text = f"0x{operands[0] & 0xFFFFFFFFFFFFFFFF:016x}"
            lines.append(f"{pc:5d}  {_NAMES[op]:<12} {text:<24} {self.notes.get(pc, '')}".rstrip())
            pc += 1 + count
        return "\n".join(lines)


_PRIMITIVES = {"null", "boolean", "int", "long", "float", "double", "bytes", "string"}
_PROMOTIONS = {
    ("int", "long"),
    ("int", "float"),
    ("int", "double"),
    ("long", "float"),
    ("long", "double"),
    ("float", "double"),
    ("string", "bytes"),
    ("bytes", "string"),
}
_NAMED = {"record", "error", "enum", "fixed"}


def _type(schema: Any) -> str:
    if isinstance(schema, list):
        return "union"
    return schema["type"] if isinstance(schema, dict) else schema


class _Compiler:
    def __init__(self, writer: dict, reader: dict, plan: FeaturePlan):
        self.writer_names: dict[str, Any] = {}
        self.reader_names: dict[str, Any] = {}
        self.writer = fastavro.parse_schema(writer, named_schemas=self.writer_names, _write_hint=False)
        self.reader = fastavro.parse_schema(reader, named_schemas=self.reader_names, _write_hint=False)
        self.plan = plan
        self.code: list[int] = []
        self.notes: dict[int, str] = {}
        self.pending_note = ""  # for the next instruction: the field it starts
        self.expanding: list[str] = []
        self.nesting = 0

    def compile(self) -> Program:
        self.resolve(self.writer, self.reader, ())
        self.emit(END)
        return Program(np.asarray(self.code, dtype=np.int64), self.notes)

    # Named types appear once in full, then by name; expanding one inside itself would not end.
    def deref(self, schema: Any, names: dict[str, Any]) -> Any:
        if isinstance(schema, str) and schema not in _PRIMITIVES:
            if schema not in names:
                raise Unsupported(f"unknown named type {schema}")
            if schema in self.expanding:
                raise Unsupported(f"recursive type {schema}")
            return names[schema]
        if isinstance(schema, dict) and schema.get("type") in _PRIMITIVES and "logicalType" not in schema:
            return schema["type"]
        return schema

    def matches(self, w: Any, r: Any) -> bool:
        """Avro's test for picking a reader union branch for a writer type."""
        w, r = self.deref(w, self.writer_names), self.deref(r, self.reader_names)
        wt, rt = _type(w), _type(r)
        if wt == "union" or rt == "union":
            return True
        if wt == rt:
            if wt in _NAMED:
                return w["name"].split(".")[-1] == r["name"].split(".")[-1]
            if wt == "array":
                return self.matches(w["items"], r["items"])
            if wt == "map":
                return self.matches(w["values"], r["values"])
            return True
        return (wt, rt) in _PROMOTIONS

    def emit(self, *words: int, note: str = "") -> int:
        if note or self.pending_note:
            self.notes[len(self.code)] = " ".join(filter(None, (self.pending_note, note)))
            self.pending_note = ""
        self.code.extend(int(w) for w in words)
        return len(self.code) - len(words)

    def sinks(self, path: tuple[str, ...], reader_type: str) -> None:
        for sink in self.plan.sinks.get(path, ()):
            if sink.op == ID and reader_type in ("float", "double"):
                raise Unsupported(f"{'.'.join(path)}: a float cannot be an id")
            if sink.op in (DENSE, LABEL, TIME) and reader_type in ("string", "bytes"):
                raise Unsupported(f"{'.'.join(path)}: a string cannot be a number")
            if sink.op == SAMPLE and (sink.operands[0] == SAMPLE_KIND) != (reader_type in ("string", "bytes", "enum")):
                raise Unsupported(f"{'.'.join(path)}: a {reader_type} cannot be this sample field")
            self.emit(sink.op, *sink.operands, note=sink.note)

    def resolve(self, w: Any, r: Any, path: tuple[str, ...]) -> None:
        w, r = self.deref(w, self.writer_names), self.deref(r, self.reader_names)
        wt, rt = _type(w), _type(r)
        if wt == "union":
            branches = [(b, self.union_branch(b, r, rt, path)) for b in w]
            self.branches(branches, lambda b, rb: self.resolve(b, rb, path))
            return
        if rt == "union":
            match = self.first_match(w, r)
            if match is None:
                raise Unresolvable(f"{'.'.join(path) or 'record'}: writer type {wt} matches no reader branch")
            self.resolve(w, match, path)
            return
        if not self.matches(w, r):
            raise Unresolvable(f"{'.'.join(path) or 'record'}: writer {wt} cannot be read as {rt}")
        if (
            path in self.plan.sinks
            and wt in ("record", "error", "array", "map", "fixed")
            and not (wt == "array" and _type(self.deref(r["items"], self.reader_names)) in _PRIMITIVES | {"enum"})
        ):
            raise Unsupported(f"{'.'.join(path)}: a {wt} cannot be a feature")
        if wt in ("record", "error"):
            self.record(w, r, path)
        elif wt == "enum":
            if "default" in r and r["default"] not in r["symbols"]:
                raise Unsupported("enum default is not a symbol")
            index = {s: i for i, s in enumerate(r["symbols"])}
            fallback = index.get(r.get("default"), -1)
            self.emit(ENUM, len(w["symbols"]), *[index.get(s, fallback) for s in w["symbols"]])
            self.sinks(path, "enum")
        elif wt in ("array", "map"):
            self.blocks(
                w,
                lambda: (
                    self.resolve(w["items"], r["items"], path)
                    if wt == "array"
                    else self.resolve(w["values"], r["values"], path + ("*",))
                ),
            )
        elif wt == "fixed":
            if w["size"] != r["size"]:
                raise Unresolvable(f"{'.'.join(path) or 'record'}: fixed sizes differ")
            self.emit(SKIP_FIXED, w["size"])
        elif wt == "null":
            pass
        else:
            self.primitive(wt, _type(r), path)

    def primitive(self, wt: str, rt: str, path: tuple[str, ...]) -> None:
        needed = path in self.plan.sinks
        if wt == "boolean":
            self.emit(BOOL)
        elif wt in ("int", "long"):
            sinks = self.plan.sinks.get(path, [])
            if rt in ("int", "long") and [sink.op for sink in sinks] == [ID]:
                self.emit(LONG_ID, *sinks[0].operands, note=sinks[0].note)
                return
            self.emit(LONG if needed else SKIP_VARINT)
        elif wt == "float":
            self.emit(FLOAT if needed else SKIP_FIXED, *(() if needed else (4,)))
        elif wt == "double":
            self.emit(DOUBLE if needed else SKIP_FIXED, *(() if needed else (8,)))
        elif wt in ("string", "bytes"):
            self.emit(STRING if needed else SKIP_BYTES)
        else:
            raise Unsupported(f"type {wt}")
        self.sinks(path, rt)

    def union_branch(self, w: Any, r: Any, rt: str, path: tuple[str, ...]) -> Any:
        """The reader type a writer union branch is read as; None: the reader cannot read it."""
        match = self.first_match(w, r) if rt == "union" else (r if self.matches(w, r) else None)
        if match is None and w == "null" and path in self.plan.sinks:
            return "null"  # a missing label or feature, not a broken payload
        return match

    def first_match(self, w: Any, branches: list) -> Any:
        return next((b for b in branches if self.matches(w, b)), None)

    def branches(self, branches: list[tuple[Any, Any]], body: Callable[[Any, Any], None]) -> None:
        """A union: jump on the branch index, run that branch, join after the last."""
        at = self.emit(UNION, len(branches), *([-1] * len(branches)))
        exits = []
        for i, (branch, reader_branch) in enumerate(branches):
            if reader_branch is None:
                continue  # the writer may write it, the reader cannot read it: a bad_union_index
            self.code[at + 2 + i] = len(self.code)
            body(branch, reader_branch)
            exits.append(self.emit(JUMP, -1))
        for jump in exits:
            self.code[jump + 1] = len(self.code)

    def blocks(self, w: dict[str, Any], body: Callable[[], None]) -> None:
        self.nesting += 1
        if self.nesting > MAX_NESTING:
            raise Unsupported("arrays or maps nested too deeply")
        item = w["items"] if w["type"] == "array" else w["values"]
        minimum = self.min_bytes(item, self.writer_names) + (1 if w["type"] == "map" else 0)
        at = self.emit(BLOCKS, minimum, -1)
        start = len(self.code)
        if w["type"] == "map":
            self.emit(SKIP_BYTES)  # the key
        body()
        self.emit(NEXT_ITEM, start)
        self.code[at + 2] = len(self.code)
        self.nesting -= 1

    def min_bytes(self, schema: Any, names: dict[str, Any]) -> int:
        schema = self.deref(schema, names)
        t = _type(schema)
        if t in ("record", "error"):
            self.expanding.append(schema["name"])
            total = sum(self.min_bytes(f["type"], names) for f in schema["fields"])
            self.expanding.pop()
            return total
        return {"null": 0, "float": 4, "double": 8}.get(t, schema["size"] if t == "fixed" else 1)

    def record(self, w: dict, r: dict, path: tuple[str, ...]) -> None:
        if any(f.get("aliases") for f in r["fields"]) or r.get("aliases"):
            raise Unsupported("aliases in the reader schema")
        self.expanding.append(w["name"])
        reader_fields = {f["name"]: f for f in r["fields"]}
        written = set()
        for f in w["fields"]:
            target = reader_fields.get(f["name"])
            if target is None:
                self.pending_note = f"{'.'.join(path + (f['name'],))}: not in the reader, skipped"
                self.skip(f["type"])
            else:
                written.add(f["name"])
                self.pending_note = ".".join(path + (f["name"],))
                self.resolve(f["type"], target["type"], path + (f["name"],))
        for name, f in reader_fields.items():
            if name not in written:
                if "default" not in f:
                    raise Unresolvable(f"reader field {'.'.join(path + (name,))} has no default")
                self.pending_note = f"{'.'.join(path + (name,))}: not written, the reader's default"
                self.default(f["type"], f["default"], path + (name,))
        self.expanding.pop()

    def skip(self, w: Any) -> None:
        w = self.deref(w, self.writer_names)
        t = _type(w)
        if t == "union":
            self.branches([(b, b) for b in w], lambda b, _rb: self.skip(b))
        elif t in ("record", "error"):
            self.expanding.append(w["name"])
            for f in w["fields"]:
                self.skip(f["type"])
            self.expanding.pop()
        elif t == "enum":
            self.emit(ENUM, len(w["symbols"]), *([0] * len(w["symbols"])))
        elif t in ("array", "map"):
            self.blocks(w, lambda: self.skip(w["items"] if t == "array" else w["values"]))
        elif t == "fixed":
            self.emit(SKIP_FIXED, w["size"])
        elif t in ("int", "long"):
            self.emit(SKIP_VARINT)
        elif t in ("string", "bytes"):
            self.emit(SKIP_BYTES)
        elif t in ("boolean", "float", "double"):
            self.emit(SKIP_FIXED, {"boolean": 1, "float": 4, "double": 8}[t])
        elif t != "null":
            raise Unsupported(f"type {t}")

    def default(self, r: Any, value: Any, path: tuple[str, ...]) -> None:
        """A reader field the writer lacks: its default's values go to the sinks."""
        if not self.plan.under(path):
            return
        r = self.deref(r, self.reader_names)
        t = _type(r)
        if t == "union":
            self.default(r[0], value, path)
        elif t in ("record", "error"):
            for f in r["fields"]:
                if f["name"] in value:
                    self.default(f["type"], value[f["name"]], path + (f["name"],))
                elif "default" in f:
                    self.default(f["type"], f["default"], path + (f["name"],))
                else:
                    raise Unsupported(f"default of {'.'.join(path)} lacks {f['name']}")
        elif t == "array":
            for item in value:
                self.default(r["items"], item, path)
        elif t == "enum":
            self.emit(CONST_INT, r["symbols"].index(value))
            self.sinks(path, "enum")
        elif t in ("boolean", "int", "long"):
            self.emit(CONST_INT, int(value))
            self.sinks(path, t)
        elif t in ("float", "double"):
            self.emit(CONST_FLOAT, float64_bits(float(value)))
            self.sinks(path, t)
        elif t in ("string", "bytes"):
            # As fastavro reads a bytes default: the string's UTF-8, like any string id.
            h = fnv1a64(value)
            self.emit(CONST_HASH, h - (1 << 64) if h >= 1 << 63 else h)
            self.sinks(path, t)
        elif t != "null":
            raise Unsupported(f"default of type {t} for a feature")


def compile_program(writer: dict, reader: dict, plan: FeaturePlan) -> Program:
    """The program that decodes bodies written with ``writer`` as ``reader`` into the plan's sinks."""
    try:
        return _Compiler(writer, reader, plan).compile()
    except (Unsupported, Unresolvable):
        raise
    except Exception as error:  # a schema fastavro refuses, or of a shape the compiler does not expect
        raise Unsupported(f"{type(error).__name__}: {error}") from error


# ---------------------------------------------------------------------------------------------
# The interpreter. Plain numba over numpy arrays; no objects, no exceptions.
# numba types each function from its arguments' dtypes and ignores these hints; they say which
# dtypes the callers must pass (another dtype makes numba compile a second specialisation).
U8 = npt.NDArray[np.uint8]
I8 = npt.NDArray[np.int8]
I32 = npt.NDArray[np.int32]
I64 = npt.NDArray[np.int64]
F32 = npt.NDArray[np.float32]


# The readers take the payload buffer and allocate nothing: without numba's reference counting
# (_nrt=False), calling one costs no atomic increment and decrement of the buffer's count, which
# took half the interpreter's time.
@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _varint(buf: U8, pos: int, end: int) -> tuple[np.int64 | int, int, int]:
    """(zigzag-decoded value, new position, status)."""
    if pos < end and buf[pos] < 0x80:  # one byte: most small ints, lengths and counts
        single = np.int64(buf[pos])
        return (single >> 1) ^ -(single & 1), pos + 1, OK
    result = np.uint64(0)
    shift = np.uint64(0)
    for _ in range(10):
        if pos >= end:
            return 0, pos, TRUNCATED
        byte = np.uint64(buf[pos])
        pos += 1
        result |= (byte & np.uint64(0x7F)) << shift
        if byte < np.uint64(0x80):
            value = np.int64(result >> np.uint64(1)) ^ -np.int64(result & np.uint64(1))
            return value, pos, OK
        shift += np.uint64(7)
    return 0, pos, BAD_VARINT


@njit(cache=True, nogil=True, boundscheck=False, _nrt=False)
def _length(buf: U8, pos: int, end: int) -> tuple[np.int64 | int, int, int]:
    """A byte length: (value, new position, status), a negative length being bad."""
    n, pos, status = _varint(buf, pos, end)
    if status == OK and n < 0:
        status = BAD_LENGTH
    return n, pos, status


@njit(cache=True, nogil=True, boundscheck=False)
def _splitmix64(x: np.uint64) -> np.uint64:
    z = x + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, nogil=True, boundscheck=False)
def _too_long(n: int, end: int, start: int) -> int:
    """The status for a length that overruns the payload: past even the whole payload, the
    length itself is absurd; otherwise the payload was cut short."""
    return BAD_LENGTH if n > end - start else TRUNCATED


def run_batch(
    buf: U8,
    starts: I64,
    ends: I64,
    entry: I64,
    code: I64,
    clip: bool,
    status: I8,
    lengths: I32,
    dense: F32,
    labels: F32,
    required: npt.NDArray[np.bool_],
    times: I64,
    samples: I64,
) -> tuple[I64, I32, I64, I64]:
    """``run_programs`` over a whole batch, growing the row arrays as it needs: (rows, table of each
    row, first row of each event, end of each event's rows)."""
    n = len(starts)
    rows = np.empty(max(1024, 2 * n * lengths.shape[0]), np.int64)
    row_table = np.empty(len(rows), np.int32)
    first, stop = np.zeros(n, np.int64), np.zeros(n, np.int64)
    event, count = 0, 0
    while True:
        event, count = run_programs(
            buf,
            starts,
            ends,
            entry,
            code,
            clip,
            status,
            lengths,
            dense,
            labels,
            required,
            times,
            samples,
            rows,
            row_table,
            first,
            stop,
            event,
            count,
        )
        if event == n:
            return rows[:count], row_table[:count], first, stop
        rows = np.concatenate((rows, np.empty_like(rows)))
        row_table = np.concatenate((row_table, np.empty_like(row_table)))


@njit(cache=True, nogil=True, boundscheck=False)
def run_programs(
    buf: U8,
    starts: I64,
    ends: I64,
    entry: I64,
    code: I64,
    clip: bool,
    status: I8,
    lengths: I32,
    dense: F32,
    labels: F32,
    required: npt.NDArray[np.bool_],
    times: I64,
    samples: I64,
    rows: I64,
    row_table: I32,
    first: I64,
    stop: I64,
    event: int,
    count: int,
) -> tuple[int, int]:
    """Decodes events ``event``.. of the batch, event e with the program at code[entry[e]:] (events
    with entry -1 are left alone), filling the per-event outputs and appending table rows event by
    event to ``rows``/``row_table`` from ``count`` on; event e's are rows[first[e]:stop[e]].

    ``samples`` [n, 4] gets each event's late-label fields (``SAMPLE_*`` columns): a null kind is a
    plain event. A late label's null labels are masked whether their tasks are required or not.

    Returns (the next event to decode, rows used): an event that would overrun ``rows`` is undone
    and returned, for the caller to grow the arrays and call again from it. The arrays are never
    reassigned in here, which keeps numba's reference counting out of the inner loop.
    """
    n = starts.shape[0]
    n_tables = lengths.shape[0]
    remaining = np.zeros(MAX_NESTING + 1, np.int64)  # items left in the current block, per nesting level
    scratch = np.zeros(8, np.uint8)  # floats are assembled here, as reads may be unaligned
    as_float32 = scratch[:4].view(np.float32)
    as_float64 = scratch.view(np.float64)
    as_int64 = scratch.view(np.int64)
    flt_max = np.float32(FLOAT32_MAX)
    for e in range(event, n):
        base = entry[e]
        if base < 0:
            continue
        first[e] = count
        pos, end, start = starts[e], ends[e], starts[e]
        pc = base
        depth = 0
        empty_items = 0
        err = OK
        labels_set = np.int64(0)  # bit t: task t's label was read
        non_finite = False
        unknown_kind = False
        ival = np.int64(0)
        fval = 0.0
        kind = KIND_INT
        for t in range(labels.shape[1]):
            labels[e, t] = 0.0
        times[e] = 0
        for c in range(4):
            samples[e, c] = 0
        for d in range(dense.shape[1]):
            dense[e, d] = 0.0
        while err == OK:
            op = code[pc]
            if op == END:
                if pos != end:
                    err = TRAILING_BYTES
                if err == OK and unknown_kind:
                    err = UNKNOWN_SAMPLE_KIND
                for t in range(labels.shape[1]):
                    if err == OK and not (labels_set >> t) & 1:
                        if required[t] and samples[e, SAMPLE_KIND] != LATE_LABEL:
                            err = MISSING_LABEL
                        else:
                            labels[e, t] = np.nan  # masked: this event trains the other tasks only
                for t in range(labels.shape[1]):
                    # a NaN read from the payload fails this too; a masked label is not checked
                    if err == OK and (labels_set >> t) & 1 and not (0.0 <= labels[e, t] <= 1.0):
                        err = BAD_LABEL
                sample_kind = samples[e, SAMPLE_KIND]
                if err == OK and sample_kind != PLAIN and samples[e, SAMPLE_READ] != 3:
                    err = MISSING_IMPRESSION
                if err == OK and sample_kind == LATE_LABEL:
                    err = LABEL_WITHOUT_POSITIVE
                    for t in range(labels.shape[1]):
                        if (labels_set >> t) & 1 and labels[e, t] == 1.0:
                            err = OK
                if err == OK and non_finite:
                    err = NON_FINITE_DENSE
                break
            # First in the chain: most ops of a click event's program are these.
            elif op == ID or op == LONG_ID:
                if op == LONG_ID:
                    ival, pos, err = _varint(buf, pos, end)
                    kind = KIND_INT
                    if err != OK:
                        continue
                table, size, mode = code[pc + 1], code[pc + 2], code[pc + 3]
                if mode == 2:
                    row = ival
                elif mode == 1:
                    row = np.int64(_splitmix64(np.uint64(ival)) % np.uint64(size))
                elif kind == KIND_HASH:
                    row = np.int64(np.uint64(ival) % np.uint64(size))
                elif 0 <= ival < size:
                    row = ival  # most ids already fit: no division, which costs more than the rest of the op
                else:
                    row = ival % size
                    if row < 0:
                        row += size
                if count == rows.shape[0]:
                    for t in range(n_tables):
                        lengths[t, e] = 0
                    return e, first[e]
                rows[count] = row
                row_table[count] = table
                count += 1
                lengths[table, e] += 1
                pc += 4
            elif op == LONG:
                ival, pos, err = _varint(buf, pos, end)
                kind = KIND_INT
                pc += 1
            elif op == SKIP_VARINT:
                _skipped, pos, err = _varint(buf, pos, end)
                pc += 1
            elif op == BOOL:
                if pos >= end:
                    err = TRUNCATED
                else:
                    ival = np.int64(1 if buf[pos] != 0 else 0)
                    kind = KIND_INT
                    pos += 1
                pc += 1
            elif op == FLOAT or op == DOUBLE:
                size = 4 if op == FLOAT else 8
                if end - pos < size:
                    err = TRUNCATED
                else:
                    for i in range(size):
                        scratch[i] = buf[pos + i]
                    fval = np.float64(as_float32[0]) if op == FLOAT else as_float64[0]
                    kind = KIND_FLOAT
                    pos += size
                pc += 1
            elif op == STRING or op == SKIP_BYTES:
                size, pos, err = _length(buf, pos, end)
                if err == OK and size > end - pos:
                    err = _too_long(size, end, start)
                if err == OK:
                    if op == STRING:
                        h = np.uint64(0xCBF29CE484222325)
                        for i in range(pos, pos + size):
                            h = (h ^ np.uint64(buf[i])) * np.uint64(0x100000001B3)
                        ival = np.int64(h)
                        kind = KIND_HASH
                    pos += size
                pc += 1
            elif op == SKIP_FIXED:
                size = code[pc + 1]
                if end - pos < size:
                    err = TRUNCATED
                pos += size
                pc += 2
            elif op == ENUM:
                index, pos, err = _varint(buf, pos, end)
                nsym = code[pc + 1]
                if err == OK:
                    if index < 0 or index >= nsym or code[pc + 2 + index] < 0:
                        err = BAD_ENUM_INDEX
                    else:
                        ival = code[pc + 2 + index]
                        kind = KIND_INT
                pc += 2 + nsym
            elif op == UNION:
                index, pos, err = _varint(buf, pos, end)
                if err == OK:
                    if index < 0 or index >= code[pc + 1] or code[pc + 2 + index] < 0:
                        err = BAD_UNION_INDEX
                    else:
                        pc = base + code[pc + 2 + index]
            elif op == JUMP:
                pc = base + code[pc + 1]
            elif op == BLOCKS or op == NEXT_ITEM:
                if op == NEXT_ITEM:
                    remaining[depth] -= 1
                    if remaining[depth] > 0:
                        pc = base + code[pc + 1]
                        continue
                    depth -= 1
                    header = base + code[pc + 1] - 3
                    after = pc + 2
                else:
                    header = pc
                    after = base + code[pc + 2]
                items, pos, err = _varint(buf, pos, end)
                if err == OK and items < 0:
                    # A negative count is followed by the block's size in bytes, which we need not use.
                    items = -items
                    _size, pos, err = _length(buf, pos, end)
                    if err == OK and items < 0:
                        err = BAD_LENGTH
                if err != OK:
                    break
                if items == 0:
                    pc = after
                    continue
                minimum = code[header + 1]
                if minimum > 0 and items > (end - pos) // minimum:
                    err = _too_long(items, end, start)
                    break
                if minimum == 0:
                    empty_items += items
                    if empty_items > MAX_EMPTY_ITEMS:
                        err = BAD_LENGTH
                        break
                depth += 1
                remaining[depth] = items
                pc = header + 3
            elif op == CONST_INT:
                ival = code[pc + 1]
                kind = KIND_INT
                pc += 2
            elif op == CONST_FLOAT:
                as_int64[0] = code[pc + 1]
                fval = as_float64[0]
                kind = KIND_FLOAT
                pc += 2
            elif op == CONST_HASH:
                ival = code[pc + 1]
                kind = KIND_HASH
                pc += 2
            elif op == DENSE or op == LABEL:
                value = fval if kind == KIND_FLOAT else np.float64(ival)
                if op == LABEL:
                    labels[e, code[pc + 1]] = np.float32(value)
                    labels_set |= np.int64(1) << code[pc + 1]
                    pc += 2
                    continue
                if code[pc + 2] == 1:
                    value = np.log1p(value) if value > -1.0 else np.nan
                single = np.float32(value)
                if not np.isfinite(single):
                    if clip:
                        single = np.float32(0.0) if np.isnan(value) else (flt_max if value > 0 else -flt_max)
                    else:
                        non_finite = True
                dense[e, code[pc + 1]] = single
                pc += 3
            elif op == TIME:
                times[e] = ival // code[pc + 1]
                pc += 2
            elif op == SAMPLE:
                slot = code[pc + 1]
                if slot == SAMPLE_KIND:
                    if ival == code[pc + 2]:
                        samples[e, slot] = IMPRESSION
                    elif ival == code[pc + 3]:
                        samples[e, slot] = LATE_LABEL
                    else:
                        unknown_kind = True  # told at the end, after the wire format's faults, as fastavro's path does
                else:
                    samples[e, slot] = ival if slot == SAMPLE_IMPRESSION_ID else ival // code[pc + 2]
                    samples[e, SAMPLE_READ] |= slot
                pc += 4
            else:
                err = UNDECODABLE  # a corrupt program; cannot happen with compile_program's output
        if err != OK:
            status[e] = err
            count = first[e]
            for t in range(n_tables):
                lengths[t, e] = 0
        stop[e] = count
    return n, count


@njit(cache=True, nogil=True, boundscheck=False)
def kept_rows(lengths: I32, status: I8) -> I64:
    """Per table, the rows of the kept events (status 0): its length in a KJT's values."""
    n_tables, n = lengths.shape
    counts = np.zeros(n_tables, np.int64)
    for t in range(n_tables):
        total = 0
        for e in range(n):
            if status[e] == OK:
                total += lengths[t, e]
        counts[t] = total
    return counts


@njit(cache=True, nogil=True, boundscheck=False)
def scatter_rows(rows: I64, row_table: I32, first: I64, stop: I64, status: I8, out: I64, cursor: I64) -> None:
    """Event-major rows of the kept events -> key-major in ``out``, table t's from ``cursor[t]`` on
    (which moves past them)."""
    # A copy made on this thread: the slices' cursors lie side by side in one array, and moving them
    # there on every row made the threads fight over its cache lines.
    at = cursor.copy()
    for e in range(first.shape[0]):
        if status[e] != OK:
            continue
        for i in range(first[e], stop[e]):
            t = row_table[i]
            out[at[t]] = rows[i]
            at[t] += 1
    cursor[:] = at


@njit(cache=True, nogil=True, boundscheck=False)
def partition_spans(partitions: I64, offsets: I64, kept: npt.NDArray[np.bool_]) -> tuple[I64, I64]:
    """Per partition number p: the kept events, and the offset after the last event (-1: none of
    p's). One pass; four numpy passes per partition cost a batch as much as a tenth of its decoding."""
    count = 0
    for e in range(partitions.shape[0]):
        count = max(count, partitions[e] + 1)
    kept_events, next_offset = np.zeros(count, np.int64), np.full(count, -1, np.int64)
    for e in range(partitions.shape[0]):
        p = partitions[e]
        kept_events[p] += kept[e]
        next_offset[p] = max(next_offset[p], offsets[e] + 1)
    return kept_events, next_offset


@njit(cache=True, nogil=True, boundscheck=False)
def parse_frames(buf: U8, starts: I64, ends: I64, status: I8, schema_ids: I64) -> None:
    """Confluent framing: magic byte 0 and a 4-byte big-endian schema id, then the body."""
    for e in range(starts.shape[0]):
        if status[e] != OK:
            continue
        pos = starts[e]
        if ends[e] - pos < 5 or buf[pos] != 0:
            status[e] = BAD_MAGIC_BYTE
            continue
        schema_ids[e] = (
            (np.int64(buf[pos + 1]) << 24)
            | (np.int64(buf[pos + 2]) << 16)
            | (np.int64(buf[pos + 3]) << 8)
            | np.int64(buf[pos + 4])
        )
        starts[e] = pos + 5


def float64_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def is_finite_float32(value: float) -> bool:
    """Whether a float64 stays finite as a float32 (values past float32's range round to inf)."""
    return math.isfinite(value) and abs(value) < (2 - 2**-24) * 2**127
