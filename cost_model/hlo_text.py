"""Reading the text of an optimized HLO module (``compiled.as_text()``): its instructions,
how often each runs, array types and their bytes, attributes, and the kind of call a
matmul or convolution is (for `hlo_audit`).  Checked on jax 0.10.2 (CPU) and on GPU
programs (cuBLAS / cuDNN custom-calls)."""

from __future__ import annotations

import math
import re

HLO_DTYPES = {
    "pred": ("bool", 8), "s4": ("int4", 4), "u4": ("uint4", 4), "s8": ("int8", 8),
    "u8": ("uint8", 8), "s16": ("int16", 16), "u16": ("uint16", 16), "s32": ("int32", 32),
    "u32": ("uint32", 32), "s64": ("int64", 64), "u64": ("uint64", 64), "f16": ("float16", 16),
    "bf16": ("bfloat16", 16), "f32": ("float32", 32), "f64": ("float64", 64),
    "c64": ("complex64", 64), "c128": ("complex128", 128),
}  # fmt: skip
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([<=\d,]*)\]")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"\s*([\w\-]+)\(")


def closing(s: str, i: int) -> int:
    """Index just past the bracket that closes the one at ``s[i]``."""
    pairs = {"(": ")", "{": "}", "[": "]"}
    stack = []
    for j in range(i, len(s)):
        ch = s[j]
        if ch in pairs:
            stack.append(pairs[ch])
        elif stack and ch == stack[-1]:
            stack.pop()
            if not stack:
                return j + 1
    raise ValueError(f"unbalanced brackets in HLO: {s[i:i + 120]!r}")


def parse_instructions(text: str) -> list[tuple[str, str, str, str, str]]:
    """(name, result type, opcode, operand text, attribute text) of every instruction."""
    out = []
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        name, rest = m.group(1), m.group(2)
        if rest.startswith("("):
            end = closing(rest, 0)
        else:
            end = rest.find(" ")
            if end < 0:
                continue
        typ, rest = rest[:end], rest[end:]
        op = _OPCODE.match(rest)
        if not op:
            continue
        start = op.end() - 1
        close = closing(rest, start)
        out.append((name, typ, op.group(1), rest[start + 1: close - 1], rest[close:]))
    return out


_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*\(.*->.*\{\s*$")
_CALLEE = re.compile(r"\b(?:body|condition|calls|to_apply|true_computation|false_computation)"
                     r"=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def run_counts(text: str) -> dict[str, int]:
    """Instruction name → runs per run of the entry computation: a computation runs as
    often as the instructions calling it, a ``while`` body (and condition) that many times
    its known trip count."""
    owner: dict[str, str] = {}
    calls: dict[str, list[tuple[str, int]]] = {}
    entry = current = None
    for line in text.splitlines():
        head = _COMPUTATION.match(line)
        if head:
            current = head.group(2)
            if head.group(1):
                entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if current is None or not m:
            continue
        owner[m.group(1)] = current
        callees = _CALLEE.findall(line)
        branches = re.search(r"branch_computations=\{([^}]*)\}", line)
        if branches:
            callees += re.findall(r"%?([\w.\-]+)", branches.group(1))
        if not callees:
            continue
        trip = _TRIP_COUNT.search(line) if " while(" in line else None
        factor = int(trip.group(1)) if trip else 1
        calls.setdefault(current, []).extend((c, factor) for c in callees)
    if entry is None:
        return {}
    runs: dict[str, int] = {}

    def visit(comp: str, times: int, path: frozenset[str]) -> None:
        if comp in path:   # no recursion in HLO; guard against a malformed text
            return
        runs[comp] = runs.get(comp, 0) + times
        for callee, factor in calls.get(comp, ()):
            visit(callee, times * factor, path | {comp})

    visit(entry, 1, frozenset())
    return {name: runs.get(comp, 1) for name, comp in owner.items()}


def shapes(typ: str) -> list[tuple[str, int]]:
    """(HLO dtype, element count) of every array in a (tuple) type."""
    out = []
    for dt, dims in _SHAPE.findall(typ):
        if dt not in HLO_DTYPES and not dt.startswith("f8"):
            continue
        sizes = [int(d.replace("<=", "")) for d in dims.split(",") if d]
        out.append((dt, math.prod(sizes)))
    return out


def bits(dt: str) -> int:
    if dt in HLO_DTYPES:
        return HLO_DTYPES[dt][1]
    m = re.match(r"[a-z]+(\d+)", dt)
    return int(m.group(1)) if m else 32


def nbytes(typ: str) -> int:
    return sum(math.ceil(elems * bits(dt) / 8) for dt, elems in shapes(typ))


def operand_bytes(operands: str, types: dict[str, str]) -> int:
    if shapes(operands):  # operands printed with their types
        return nbytes(operands)
    return sum(nbytes(types.get(ref, "")) for ref in re.findall(r"%([\w.\-]+)", operands))


def attribute(attrs: str, key: str) -> str | None:
    """The text of ``key=...`` in an attribute list (bracketed values whole)."""
    m = re.search(rf"\b{key}=", attrs)
    if not m:
        return None
    i = m.end()
    if attrs.startswith("mesh[", i):  # mesh[...][, device_ids=(...)] {axes}
        j = closing(attrs, i + 4)
        k = attrs.find("{", j)
        return attrs[i:closing(attrs, k)]
    if attrs[i] in "{[(":
        j = closing(attrs, i)
        rest = re.match(r"<=\[[\d,]*\](?:T\([\d,]*\))?", attrs[j:])  # iota form tail
        return attrs[i:j + (rest.end() if rest else 0)]
    return re.match(r"[^,\s]*", attrs[i:]).group(0)


# HLO opcode -> kind of call (`compute.KERNEL_CURVES`); GPU backends lower both to library
# calls, named by their custom-call target's prefix.
KERNEL_OPCODES = {"dot": "matmul", "convolution": "conv"}
KERNEL_CALL_TARGETS = (("__cudnn$conv", "conv"), ("__cublas", "matmul"))


def kernel_kind(opcode: str, attrs: str) -> str | None:
    """The kind of call an HLO instruction is, None for anything but a matmul or conv."""
    if opcode != "custom-call":
        return KERNEL_OPCODES.get(opcode)
    target = attribute(attrs, "custom_call_target") or ""
    return next((k for prefix, k in KERNEL_CALL_TARGETS if target.strip('"').startswith(prefix)),
                None)
