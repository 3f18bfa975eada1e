"""Collectives in a compiled SPMD program, from its HLO text: kind, bytes, how often they run.

`collectives(compiled.as_text())` lists every all-reduce, all-gather, reduce-scatter,
collective-permute and all-to-all of the per-device program with its bytes per device (the
gathered result for all-gather, the input for reduce-scatter, the payload otherwise; for a
collective-permute the payload times the fraction of devices that send) and how many
times it executes per step: the product of the known trip counts of the while loops around it.
Used by the parallelism bench and by tests that check where a reduction happens.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\) -> .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
_OP = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"(?:body|calls|to_apply|condition|true_computation|false_computation)"
                    r"=%([\w.\-]+)|branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")


@dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int          # per device, per execution
    executions: int     # per step (product of the enclosing loops' trip counts)
    in_loop: bool       # inside at least one while loop
    name: str

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.executions


def shape_bytes(shape_text: str) -> int:
    total = 0
    for dtype, dims in _ARRAY.findall(shape_text):
        n = 1
        for d in filter(None, dims.split(",")):
            n *= int(d)
        total += n * _DTYPE_BYTES[dtype]
    return total


def _parse(hlo: str):
    """{computation: [(name, shape, opcode, rest)]}, the entry name, and call edges."""
    comps: dict[str, list] = {}
    entry, current = None, None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m:
            current = m.group(1)
            comps[current] = []
            if line.startswith("ENTRY"):
                entry = current
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            comps[current].append(m.groups())
    return comps, entry


def collectives(hlo: str) -> list[Collective]:
    comps, entry = _parse(hlo)
    partitions = int((_PARTITIONS.search(hlo) or [0, 1])[1])
    mult: dict[str, tuple[int, bool]] = defaultdict(lambda: (0, False))
    mult[entry] = (1, False)
    order = [entry]
    for comp in order:  # breadth-first over the call graph (HLO call graphs are acyclic)
        count, looped = mult[comp]
        for _, _, opcode, rest in comps.get(comp, []):
            trip = _TRIP.search(rest)
            for single, many in _CALLS.findall(rest):
                for callee in [single] if single else _OP.findall(many):
                    is_body = opcode == "while" and f"body=%{callee}" in rest
                    factor = int(trip.group(1)) if (is_body and trip) else 1
                    old = mult[callee]
                    mult[callee] = (max(old[0], count * factor), old[1] or looped or is_body)
                    if callee not in order:
                        order.append(callee)
    found = []
    for comp, instrs in comps.items():
        shapes = {name: shape for name, shape, _, _ in instrs}
        for name, shape, opcode, rest in instrs:
            kind = opcode[:-6] if opcode.endswith("-start") else opcode
            if kind not in KINDS:
                continue
            size = shape_bytes(shape)
            if kind == "reduce-scatter":
                operands = _OP.findall(rest.split(")")[0])
                size = sum(shape_bytes(shapes.get(o, "")) for o in operands) or size
            pairs = _PAIRS.search(rest)
            if kind == "collective-permute" and pairs:  # average over devices: some only wait
                size = size * pairs.group(1).count("{") // partitions
            count, looped = mult[comp]
            found.append(Collective(kind, size, count, looped, name))
    return found


def summarize(found: list[Collective]) -> dict[str, tuple[int, int]]:
    """{kind: (executions per step, bytes per device per step)} for every kind."""
    out = {k: (0, 0) for k in KINDS}
    for c in found:
        n, b = out[c.kind]
        out[c.kind] = (n + c.executions, b + c.total_bytes)
    return out
