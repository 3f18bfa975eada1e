"""FLOPs of an HLO module, per device per step: matmuls (`dot`, `ragged-dot`) by operand type,
Pallas kernels' own cost estimates, and the kernel calls whose FLOPs a reporter adds.

Apart from `aot/hlo.py`, which parses the text and counts collectives: both read the same
`hlo.Module` (loop bodies multiplied by their trip counts, only what the ROOT uses), and what
these functions ask of it is the operands' shapes and the computations' executions.
"""

from __future__ import annotations

import functools
import math
import re
from collections import defaultdict

from jaxscale.aot import hlo
from jaxscale.aot.hlo import Module

_CONTRACT = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_RAGGED = re.compile(r"lhs_ragged_dims=\{(\d+)\}")
_KERNEL_FLOPS = re.compile(r'"cost_estimate":\s*\{[^}]*"flops":\s*(\d+)')


def dot_flops(module: Module, opcodes: tuple[str, ...] = ("dot", "ragged-dot"),
              kernels: bool = True) -> dict[str, float]:
    """Matmul FLOPs per device per step by operand type ('bf16', 'f32', 's8' where both
    operands are int8, ...): 2 x output elements x contracted size for every `dot` (read the HLO
    after SPMD partitioning, before dots become TPU convolutions), loop bodies multiplied by
    their trip counts. The type is the lhs's, or 'mixed' when the two operands differ.
    A `ragged-dot` (MoE grouped matmuls, `jax.lax.ragged_dot`) counts the same where its groups
    split the rows (each row meets one group's weights); where they split the contracted
    dimension (the weight gradient: one output per group, each contracting only its group's
    rows) the count is divided by the groups, the output's first dimension. `opcodes` picks
    which of the two are counted; `kernels`, whether cost-estimated Pallas kernels are added."""
    total: dict[str, float] = defaultdict(float)
    for comp, instrs in module.live.items():
        count = module.mult.get(comp, (0, False))[0]
        shapes = {i.name: i.shape for i in instrs}
        for ins in instrs:
            if ins.opcode not in opcodes or not count:
                continue
            lhs, rhs = (shapes.get(o, "") or _param_shape(module, comp, o)
                        for o in hlo.OP.findall(ins.rest.split(")")[0])[:2])
            contracted = [int(d) for d in filter(None, _CONTRACT.search(ins.rest).group(1)
                                                 .split(","))]
            k = math.prod(hlo.dims(lhs)[d] for d in contracted)
            out = hlo.dims(ins.shape)
            ragged = _RAGGED.search(ins.rest) if ins.opcode == "ragged-dot" else None
            groups = out[0] if ragged and int(ragged.group(1)) in contracted else 1
            types = {m.group(1) for m in (hlo.ARRAY.search(lhs), hlo.ARRAY.search(rhs)) if m}
            total[types.pop() if len(types) == 1 else "mixed"] += (
                2.0 * math.prod(out) * k * count / groups)
    pallas = kernel_cost_flops(module) if kernels else 0.0
    if pallas:
        total["pallas"] += pallas
    return dict(total)


def kernel_cost_flops(module: Module) -> float:
    """FLOPs per device per step of Pallas TPU kernels that carry a cost estimate in their
    backend config (megablox's grouped matmuls: 2 x rows x k x n of its static row count, an
    upper bound like a ragged-dot's, `grouped_flops`), loop bodies x trip counts; 0 for kernels
    without one (splash attention, counted analytically by `aot.flops.kernel_flops`)."""
    total = 0.0
    counts = _summed_counts(module)
    for comp, instrs in module.live.items():
        count = counts.get(comp, 0)
        for ins in instrs:
            m = _KERNEL_FLOPS.search(ins.rest) if ins.opcode == "custom-call" else None
            if m and count and 'custom_call_target="tpu_custom_call"' in ins.rest:
                total += float(m.group(1)) * count
    return total


def _summed_counts(module: Module) -> dict[str, int]:
    """Executions per step of each computation, summed over its call sites: a jitted function
    called from several places (megablox's `gmm`, once per grouped matmul of a layer) is one
    computation that `Module.mult` (the most executions of any one site) counts once."""
    callers: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for comp, instrs in module.live.items():
        for instr in instrs:
            trip = hlo.trip_count(module, instr) if instr.opcode == "while" else 1
            for single, many in hlo.CALLS.findall(instr.rest):
                for callee in [single] if single else hlo.OP.findall(many):
                    body = instr.opcode == "while" and f"body=%{callee}" in instr.rest
                    callers[callee].append((comp, trip if body else 1))

    @functools.cache
    def count(comp: str) -> int:
        if comp == module.entry:
            return 1
        return sum(count(caller) * factor for caller, factor in callers.get(comp, []))

    return {comp: count(comp) for comp in module.live}


def grouped_flops(module: Module) -> float:
    """The part of `flops` in grouped matmuls (`ragged-dot`s and cost-estimated Pallas kernels,
    the dropless MoE's), counted at their static row counts: every row of the (gathered or
    worst-case received) buffer, while only the routed rows are multiplied. Subtract it and add
    the routed count to compare with the model (bench/RESULTS.md, dropless MoE)."""
    ragged = dot_flops(module, ("ragged-dot",), kernels=False)  # operands' shapes kept
    return sum(ragged.values()) + kernel_cost_flops(module)


def flops(module: Module) -> float:
    """Matmul FLOPs per device per step, all operand types (`dot_flops`), with Pallas kernels'
    own cost estimates (`kernel_cost_flops`)."""
    return sum(dot_flops(module).values())


def int8_flops(module: Module) -> float:
    """The part of `flops` in int8 x int8 matmuls (quantized training, `precision=int8`)."""
    return dot_flops(module).get("s8", 0.0)


def kernel_calls(module: Module) -> int:
    """Executions per device per step of Pallas TPU kernels (`tpu_custom_call` custom calls,
    e.g. splash attention), loop bodies x trip counts. `flops` holds only the FLOPs of kernels
    that carry a cost estimate (megablox, `kernel_cost_flops`); for the others (splash) whoever
    reports FLOPs must add them (`aot.flops.kernel_flops`)."""
    pallas = 'custom_call_target="tpu_custom_call"'
    return sum(module.mult.get(comp, (0, False))[0]
               for comp, instrs in module.live.items() for ins in instrs
               if ins.opcode == "custom-call" and pallas in ins.rest)


def _param_shape(module: Module, comp: str, name: str) -> str:
    m = re.search(rf"{re.escape(name)}: ([^,)]*\])", module.params.get(comp, ""))
    return m.group(1) if m else ""
