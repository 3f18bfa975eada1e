"""HLO accounting: the module's text parsed (computations, loop trip counts, what is live) and
its collectives (kind, bytes, group, executions); its FLOPs are counted in `aot/hlo_flops.py`.

Reads the text of an XLA HLO module (CPU: `compiled.as_text()`; TPU: libtpu's dump, see
`jaxscale.aot.compile`). Every count is per device and per step: an instruction inside while
loops counts once per iteration, the trip count taken from `known_trip_count` or, where the
compiler did not annotate it (libtpu), from the loop condition `i < N`. Collectives are the
all-reduce, all-gather, reduce-scatter, collective-permute and all-to-all ops, including their
async `-start` forms; libtpu's `all-reduce-scatter` fusions (an all-reduce followed by a
dynamic-slice, executed as a reduce-scatter) count as reduce-scatters, and the
collective-permutes of windowed-einsum loops (FSDP gathers overlapped with matmuls) count once
per loop iteration (the loop's own counter and step: `_trip_count`); a collective that
libtpu's async collective fusions repeat (one channel_id in several fusions) counts once.
Across slices libtpu compiles one slice's program and hands the collectives that leave it to
its Megascale runtime as host-transfer sends: those count as DCN collectives, and what only
feeds a send stays live. Bytes: the gathered result for all-gather, the input for
reduce-scatter, the payload otherwise; for a collective-permute the payload times the fraction
of devices sending. A `ragged-all-to-all` (the dropless MoE's dispatch, `models/moe/dispatch.py`)
counts as an all-to-all of the smaller of its operand and output buffers: one is the static
worst-case receive buffer, the other the rows actually sent (each device's assignments).
"""

from __future__ import annotations

import functools
import logging
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

from jaxscale.aot.groups import replica_groups

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all")
_DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
                "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
ARRAY = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMP = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \((.*)\) -> .*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.*?) ([a-z][\w\-]*)\((.*)$")
# An operand: `%name`, or `%name#k`, element k of a tuple (jax >= 0.11's XLA), which `parse`
# turns into the `get-tuple-element` instruction older versions wrote (see `_tuple_elements`).
OP = re.compile(r"%([\w.\-]+(?:#\d+)?)")
_ELEMENT = re.compile(r"%([\w.\-]+)#(\d+)")
_COMMENT = re.compile(r"/\*.*?\*/")
CALLS = re.compile(r"(?:body|calls|to_apply|condition|true_computation|false_computation)"
                    r"=%([\w.\-]+)|branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_PARTITIONS = re.compile(r"num_partitions=(\d+)")
_CONST = re.compile(r"constant\((-?\d+)\)")
_CHANNEL = re.compile(r"channel_id=(\d+)")
_FUSED_COLLECTIVE = "all-reduce-scatter"  # libtpu's reduce-scatter, as a fusion
_RAGGED_A2A = "ragged-all-to-all"
# Multi-slice: libtpu compiles one slice's program and hands the collectives that cross slices
# to the Megascale runtime as host-transfer `send`s, their kind and groups in attributes.
_MEGASCALE_KIND = re.compile(r'_xla_megascale_transfer_type="([A-Z_]+)"')
_MEGASCALE_KINDS = {"ALL_REDUCE": "all-reduce", "ALL_GATHER": "all-gather",
                    "REDUCE_SCATTER": "reduce-scatter", "ALL_TO_ALL": "all-to-all",
                    "ONE_TO_ONE": "collective-permute"}
_MEGASCALE_SLICES = re.compile(r'_xla_megascale_target="\{([\d,:]+)\}x')  # "{1,2}x{0:3}"
_MEGASCALE_GROUP = re.compile(r"_xla_megascale_target=\{\{([\d,]+)\}")      # {{100000,200000},..
_SIDE_EFFECTS = ("send", "send-done", "outfeed")  # live without feeding the ROOT


@dataclass(frozen=True)
class Instr:
    name: str
    shape: str
    opcode: str
    rest: str
    is_root: bool = False


@dataclass
class Module:
    comps: dict[str, list[Instr]]
    params: dict[str, str]          # computation -> its parameter list text
    entry: str
    partitions: int
    mult: dict[str, tuple[int, bool]] = field(default_factory=dict)  # (executions, in a loop)
    live: dict[str, list[Instr]] = field(default_factory=dict)       # instructions ROOT uses


@dataclass(frozen=True)
class Collective:
    kind: str
    bytes: int          # per device, per execution
    executions: int     # per step (product of the enclosing loops' trip counts)
    in_loop: bool       # inside at least one while loop
    name: str
    group: int = 0      # devices per replica group (0: unknown)
    dcn: bool = False   # a group spans several slices
    channel: int = 0    # channel_id (0: none)

    @property
    def total_bytes(self) -> int:
        return self.bytes * self.executions


def shape_bytes(shape_text: str) -> int:
    return sum(math.prod(int(d) for d in filter(None, dims.split(","))) * _DTYPE_BYTES[dt]
               for dt, dims in ARRAY.findall(shape_text))


def dims(shape_text: str) -> list[int]:
    m = ARRAY.search(shape_text)
    return [int(d) for d in filter(None, m.group(2).split(","))] if m else []


def parse(hlo: str) -> Module:
    comps: dict[str, list[Instr]] = {}
    params: dict[str, str] = {}
    entry, current = "", None
    for line in hlo.splitlines():
        m = _COMP.match(line)
        if m:
            current = m.group(1)
            comps[current], params[current] = [], m.group(2)
            if line.startswith("ENTRY"):
                entry = current
            continue
        m = _INSTR.match(line)
        if m and current is not None:
            comps[current].append(Instr(*m.groups(), is_root=line.lstrip().startswith("ROOT")))
    comps = {name: _tuple_elements(instrs) for name, instrs in comps.items()}
    partitions = int((_PARTITIONS.search(hlo) or [0, 1])[1])
    module = Module(comps, params, entry, partitions)
    module.live = {name: _live(instrs) for name, instrs in comps.items()}
    module.mult = _multiplicities(module)
    return module


def _tuple_elements(instrs: list[Instr]) -> list[Instr]:
    """The computation with each tuple element its operands name as `%t#k` (jax >= 0.11's XLA
    writes no `get-tuple-element` instruction) made into the instruction older versions wrote,
    `t#k = SHAPE get-tuple-element(%t), index=k`, so that loop counters, operand shapes and
    liveness read alike in both syntaxes. Without it a windowed-einsum loop's counter (`%p#4 <
    N`, advanced by 2) was not found: its trip count came out N instead of N/2, counting the FSDP
    gather loops twice."""
    shapes = {i.name: i.shape for i in instrs}
    added: dict[str, Instr] = {}
    for ins in instrs:
        for name, k in _ELEMENT.findall(ins.rest):
            key = f"{name}#{k}"
            if key not in added:
                elements = split_tuple(shapes.get(name, ""))
                shape = elements[int(k)] if int(k) < len(elements) else ""
                added[key] = Instr(key, shape, "get-tuple-element", f"%{name}), index={k}")
    return list(added.values()) + instrs


def split_tuple(shape_text: str) -> list[str]:
    """The element shapes of a tuple shape `(f32[8]{0}, (s32[], u32[]), /*index=2*/bf16[4])`,
    split at its top level (layouts and nested tuples kept whole); [] for a non-tuple."""
    text = _COMMENT.sub("", shape_text).strip()
    if not text.startswith("(") or not text.endswith(")"):
        return []
    elements, depth, start = [], 0, 1
    for pos, ch in enumerate(text[1:-1], 1):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            elements.append(text[start:pos].strip())
            start = pos + 1
    elements.append(text[start:-1].strip())
    return [e for e in elements if e]


def _live(instrs: list[Instr]) -> list[Instr]:
    """The instructions the ROOT or a side effect (a send across slices) depends on: the HLO
    right after SPMD partitioning still holds the dots that windowed-einsum loops replaced
    (dead until DCE), which must not count."""
    if not instrs:
        return instrs
    by_name = {i.name: i for i in instrs}
    root = next((i for i in instrs if i.is_root), instrs[-1])
    stack = [root] + [i for i in instrs if i.opcode in _SIDE_EFFECTS]
    seen = {i.name for i in stack}
    while stack:
        for op in OP.findall(stack.pop().rest.split("), ")[0]):
            if op in by_name and op not in seen:
                seen.add(op)
                stack.append(by_name[op])
    return [i for i in instrs if i.name in seen]


def trip_count(module: Module, instr: Instr) -> int:
    """Iterations of a while loop: annotated, or read from the loop itself (libtpu does not
    annotate): the condition compares one element k of the loop tuple with a constant N
    (`i < N`), and the body updates element k as `i + a + b ...` (windowed-einsum loops keep
    their counter last and advance it by 2 per iteration, two steps unrolled into one body).
    Counting from 0, the loop runs ceil(N / step) times."""
    known = _TRIP.search(instr.rest)
    if known:
        return int(known.group(1))
    cond = re.search(r"condition=%([\w.\-]+)", instr.rest)
    found = _compare_limit(module.comps.get(cond.group(1), []) if cond else [])
    if found is None:
        return 1
    limit, index = found
    body = re.search(r"body=%([\w.\-]+)", instr.rest)
    step = _step(module.comps.get(body.group(1), []) if body else [], index)
    return max(1, -(-limit // step))


def _constants(instrs: list[Instr]) -> dict[str, int]:
    return {i.name: int(c.group(1)) for i in instrs if i.opcode == "constant"
            for c in [_CONST.search(f"constant({i.rest}")] if c}


def _operands(instr: Instr) -> list[str]:
    return OP.findall(instr.rest.split(")")[0])


def _tuple_index(instr: Instr | None) -> int | None:
    """k of `get-tuple-element(%param), index=k`, else None."""
    if instr is None or instr.opcode != "get-tuple-element":
        return None
    m = re.search(r"index=(\d+)", instr.rest)
    return int(m.group(1)) if m else None


def _compare_limit(cond: list[Instr]) -> tuple[int, int] | None:
    """(N, k) of a loop condition `get-tuple-element(p, index=k) < N`."""
    consts, by_name = _constants(cond), {i.name: i for i in cond}
    for i in cond:
        if i.opcode == "compare" and "direction=LT" in i.rest:
            ops = _operands(i)
            limit = next((consts[o] for o in ops if o in consts), None)
            counter = next((by_name.get(o) for o in ops if o not in consts), None)
            if limit is not None:
                index = _tuple_index(counter)
                return limit, 0 if index is None else index
    return None


def _step(body: list[Instr], index: int = 0) -> int:
    """The increment of loop-tuple element `index` per iteration: the ROOT tuple's operand
    `index`, followed through `add(x, constant)` chains (and copies) back to
    `get-tuple-element(param, index)`, summing the constants (1 where the update has another
    form)."""
    by_name = {i.name: i for i in body}
    consts = _constants(body)
    root = next((i for i in body if i.is_root), body[-1] if body else None)
    if root is None or root.opcode != "tuple":
        return 1
    ops = _operands(root)
    node, step = (by_name.get(ops[index]) if index < len(ops) else None), 0
    while node is not None and node.opcode in ("add", "copy", "bitcast"):
        ops = _operands(node)
        if node.opcode != "add":  # the optimized HLO copies the counter before adding
            node = by_name.get(ops[0]) if ops else None
            continue
        const = [consts[o] for o in ops if o in consts]
        rest = [o for o in ops if o not in consts]
        if len(const) != 1 or len(rest) != 1:
            return 1
        step += const[0]
        node = by_name.get(rest[0])
    if _tuple_index(node) != index or step <= 0:
        return 1
    return step


def _multiplicities(module: Module) -> dict[str, tuple[int, bool]]:
    mult: dict[str, tuple[int, bool]] = defaultdict(lambda: (0, False))
    mult[module.entry] = (1, False)
    order = [module.entry]
    for comp in order:  # breadth-first over the call graph (HLO call graphs are acyclic)
        count, looped = mult[comp]
        for instr in module.live.get(comp, []):
            trip = trip_count(module, instr) if instr.opcode == "while" else 1
            for single, many in CALLS.findall(instr.rest):
                for callee in [single] if single else OP.findall(many):
                    is_body = instr.opcode == "while" and f"body=%{callee}" in instr.rest
                    factor = trip if is_body else 1
                    old = mult[callee]
                    mult[callee] = (max(old[0], count * factor), old[1] or looped or is_body)
                    if callee not in order:
                        order.append(callee)
    return dict(mult)


def collectives(module: Module | str, slice_of: list[int] | None = None) -> list[Collective]:
    """Every collective of the module (or HLO text), DCN ones included: on libtpu, the
    Megascale sends of a multi-slice program (`_megascale`); elsewhere, groups that span
    several slices by `slice_of[p]`, the slice of each partition."""
    if isinstance(module, str):
        module = parse(module)
    shapes = {i.name: i.shape for instrs in module.comps.values() for i in instrs}
    found = []
    for comp, instrs in module.comps.items():
        count, looped = module.mult.get(comp, (0, False))
        for ins in instrs:
            kind = ins.opcode[:-6] if ins.opcode.endswith("-start") else ins.opcode
            if kind == "send" and _MEGASCALE_KIND.search(ins.rest):
                found.append((comp, _megascale(ins, count, looped,
                                               len(set(slice_of)) if slice_of else 2)))
            ragged = kind == _RAGGED_A2A
            if ragged:
                kind = "all-to-all"
            if kind not in KINDS:
                continue
            size = shape_bytes(ins.shape)
            if ragged:  # operand 0 is the data sent, the result the receive buffer
                sent = OP.findall(ins.rest.split(")")[0])[:1]
                size = min([size] + [shape_bytes(shapes[o]) for o in sent if o in shapes])
            if comp.startswith(_FUSED_COLLECTIVE):  # the all-reduce of a reduce-scatter fusion
                kind = "reduce-scatter"
            if kind == "reduce-scatter" or (kind == "all-gather" and ins.opcode.endswith(
                    "-start")):
                operands = OP.findall(ins.rest.split(")")[0])
                in_size = sum(shape_bytes(shapes.get(o, "")) for o in operands)
                size = in_size if kind == "reduce-scatter" and in_size else size
                if kind == "all-gather":  # the async form's shape is (operand, result)
                    size = shape_bytes(ins.shape) - in_size or size
            pairs = _PAIRS.search(ins.rest)
            if kind == "collective-permute" and pairs:  # averaged over devices: some only wait
                size = size * pairs.group(1).count("{") // max(module.partitions, 1)
                if ins.opcode.endswith("-start"):
                    size //= 2  # the async form's shape holds the payload twice (in, out)
            groups = replica_groups(ins.rest, module.partitions)
            group = len(groups[0]) if groups else module.partitions
            if kind == "collective-permute":
                group = 2
            dcn = bool(slice_of) and any(
                len({slice_of[p] for p in g if p < len(slice_of)}) > 1
                for g in (groups or [list(range(module.partitions))]))
            channel = _CHANNEL.search(ins.rest)
            found.append((comp, Collective(kind, size, count, looped, ins.name, group, dcn,
                                           int(channel.group(1)) if channel else 0)))
    return _one_per_channel(found, _fusion_bodies(module))


def _fusion_bodies(module: Module) -> set[str]:
    """The computations a `fusion` instruction calls (where libtpu repeats a collective)."""
    return {callee for instrs in module.comps.values() for ins in instrs
            if ins.opcode == "fusion" for callee, _ in CALLS.findall(ins.rest) if callee}


def _megascale(ins: Instr, count: int, looped: bool, num_slices: int) -> Collective:
    """A collective across slices, as libtpu hands it to the Megascale runtime: the send's
    payload (times the slices for an all-gather, whose bytes are the gathered result), in a
    group of as many slices as its target names: `{1,2}x{0:3}` (slices x chips, `a:b` an
    inclusive range), `{{100000,200000},...}` (device ids slice * 100000 + chip) or
    `{{100000->200000},...}` (one-to-one pairs). A form this does not know counts as all
    `num_slices` slices, with a warning."""
    transfer = _MEGASCALE_KIND.search(ins.rest).group(1)
    kind = _MEGASCALE_KINDS.get(transfer)
    if kind is None:
        _warn_once(f"unknown Megascale transfer type {transfer}: counted as an all-to-all")
        kind = "all-to-all"
    payload = ARRAY.search(ins.shape)
    size = shape_bytes(payload.group(0)) if payload else 0
    compact, listed = _MEGASCALE_SLICES.search(ins.rest), _MEGASCALE_GROUP.search(ins.rest)
    if compact:
        slices = sum(int(b) - int(a) + 1 if b else 1
                     for a, _, b in (part.partition(":") for part in compact.group(1).split(",")))
    elif listed:
        slices = len({int(x) // 100000 for x in listed.group(1).split(",")})
    elif kind == "collective-permute":
        slices = 2
    else:
        _warn_once(f"unknown Megascale target in {ins.name}: counted over all slices")
        slices = num_slices
    if kind == "all-gather":
        size *= slices
    channel = _CHANNEL.search(ins.rest)
    return Collective(kind, size, count, looped, ins.name, slices, True,
                      int(channel.group(1)) if channel else 0)


@functools.cache
def _warn_once(message: str) -> None:
    logging.warning("HLO accounting: %s (a libtpu version jaxscale was not tested with?)",
                    message)


def _one_per_channel(found: list[tuple[str, Collective]],
                     fusions: set[str] | None = None) -> list[Collective]:
    """libtpu's async collective fusions repeat one collective (one channel_id) in the fusion
    that starts it and in each fusion that continues it while computing (7B on v5e-64: every
    layer weight's gather 3 times): per channel, count the ops of one fusion computation only,
    the one with the most bytes per step (ops sharing a channel in one computation, such as a
    collective-permute split in two halves, all count). Ops outside fusions (`fusions`, None:
    every computation counts as one) are never repeats: a `shard_map` ppermute keeps
    channel_id 1 in the forward, rematerialised and backward loops of a ring, three transfers."""
    groups: dict[tuple, dict[str, list[Collective]]] = defaultdict(lambda: defaultdict(list))
    out = []
    for comp, c in found:
        if c.channel:
            alone = fusions is not None and comp not in fusions
            groups[(c.kind, c.channel) + ((comp,) if alone else ())][comp].append(c)
        else:
            out.append(c)
    for by_comp in groups.values():
        out += max(by_comp.values(), key=lambda cs: sum(c.total_bytes for c in cs))
    return out


def summarize(found: list[Collective]) -> dict[str, tuple[int, int]]:
    """{kind: (executions per step, bytes per device per step)} for every kind."""
    out = {k: (0, 0) for k in KINDS}
    for c in found:
        n, b = out[c.kind]
        out[c.kind] = (n + c.executions, b + c.total_bytes)
    return out
