"""Compile the exact train step of a config for a TPU topology, ahead of time, with no TPU.

`compile_step(config, topology)` builds the step `launch.train` would run (`train.build`), on a
mesh of the topology's compile-only devices, lowers it against abstract arrays (nothing is
allocated or executed), compiles it with libtpu, and returns the compiler's own accounting:
memory per chip, FLOPs (loop bodies multiplied by their trip counts; Pallas kernels such as
splash attention, which hold no countable dot, added analytically and labelled) and collectives,
read from the HLO that libtpu dumps (`compiled.as_text()` fails on these executables).
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import ml_collections as mlc

from jaxscale import config as config_lib
from jaxscale.aot import flops as flops_lib
from jaxscale.aot import hlo, hlo_flops, traffic
from jaxscale.aot.choices import fit_advice, require_language_model, rows_per_chip
from jaxscale.aot.topology import Topology, TopologyError, topology_devices, usable_hbm_bytes
from jaxscale.errors import JaxscaleError, MeshError, paragraph
from jaxscale.hardware import fits as hardware_fits

_HBM_OOM = re.compile(r"HLO temporaries \(([\d.]+)([KMGT])\) exceeds? available HBM "
                      r"\(([\d.]+)([KMGT])\)")
_UNIT = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}  # libtpu's size suffixes (binary)


class HbmOom(JaxscaleError):
    """libtpu refused to compile: the step's temporaries alone exceed the chip's HBM."""

    def __init__(self, message: str, temp_bytes: float, available_bytes: float):
        super().__init__(message)
        self.temp_bytes, self.available_bytes = temp_bytes, available_bytes


def _hbm_oom(error: Exception, topology: Topology, config: mlc.ConfigDict,
             rows_per_chip: float) -> HbmOom | None:
    """libtpu's CompileTimeHbmOom as a one-paragraph error (sizes printed "95.00G", or "1.20T"
    for a step needing terabytes)."""
    found = _HBM_OOM.search(str(error))
    if not found:
        return None
    t, t_unit, a, a_unit = found.groups()
    temp, available = float(t) * _UNIT[t_unit], float(a) * _UNIT[a_unit]
    return HbmOom(paragraph(
        f"Does not fit {topology.label()}: libtpu refused to compile the step, whose",
        f"temporaries alone need {temp / 2**30:.2f} GiB per chip against the",
        f"{available / 2**30:.2f} GiB it can use ({(temp - available) / 2**30:.2f} GiB over;",
        "arguments such as weights and optimizer state come on top). To fit:",
        f"{fit_advice(config, rows_per_chip)}; `launch.plan` searches these for you."),
        temp, available)


class CompilerError(JaxscaleError):
    """libtpu failed on the step itself (an internal error, not a config check or out of HBM).

    `compiler_line` is the compiler's own message (its RET_CHECK / check line where it has one,
    else its first line); `signature` is that line without paths and numbers, the same for
    every candidate that trips the same compiler check (the planner groups failures by it)."""

    def __init__(self, message: str, compiler_line: str, signature: str):
        super().__init__(message)
        self.compiler_line, self.signature = compiler_line, signature


def compiler_line(error: BaseException) -> str:
    """The line of a compiler error that names the failing check (RET_CHECK, Check failed),
    else its first non-empty line, at most 300 characters."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    named = [line for line in lines if _CHECK.search(line)]
    line = (named or lines or [type(error).__name__])[0]
    return line if len(line) <= 300 else line[:297] + "..."


_CHECK = re.compile(r"RET_CHECK|Check failed|CHECK failure")


def error_signature(line: str) -> str:
    """`line` with source paths cut to their file name and every number replaced by N: the
    class of a compiler failure, shared by the candidates that fail the same check."""
    line = re.sub(r"[\w./-]*/([\w.-]+\.(?:cc|h|cpp|py))", r"\1", line)
    return re.sub(r"\b\d+\b", "N", line).strip()


def settings_label(config: mlc.ConfigDict) -> str:
    """The settings a compile depends on most, for a message: mesh axes above 1, rules preset,
    remat, attention, loss chunks, precision, accumulation, batch and pipeline."""
    mesh = " ".join(f"{k}={v}" for k, v in config.mesh.items()
                    if isinstance(v, int) and not isinstance(v, bool) and v > 1)
    m, pipe = config.model, config.get("pipeline", {})
    parts = [f"mesh {mesh or 'of one device'}", f"rules_preset={config.rules_preset or 'custom'}",
             f"remat={m.get('remat', 'none')}", f"attention={m.get('attention', 'einsum')}",
             f"loss_chunks={m.get('loss_chunks', 0)}", f"precision={config.precision}",
             f"grad_accum={config.train.grad_accum}",
             f"batch {config.data.batch_size} x {config.data.seq_len}"]
    if config.mesh.get("pipeline", 1) > 1:
        parts.append(f"pipeline {pipe.get('schedule')} x {pipe.get('microbatches')}")
    return ", ".join(parts)


def as_compiler_error(error: Exception, topology: Topology, config: mlc.ConfigDict
                    ) -> CompilerError:
    """libtpu's failure as one paragraph: the settings and the compiler's own line."""
    line = compiler_line(error)
    return CompilerError(paragraph(
        f"libtpu failed to compile the train step for {topology.label()} with",
        f"{settings_label(config)}: {line}. This is the compiler's own failure, not a",
        "config check: other settings (e.g. another train.grad_accum, model.remat or mesh",
        "split) may compile, and `jaxscale plan` searches them, skipping the untried",
        "candidates that share the failing settings once two fail the same way. To report",
        "it, rerun with --save_hlo=DIR and attach the HLO."), line, error_signature(line))


@dataclass
class StepReport:
    """What the TPU compiler says about one train step, per chip."""

    topology: str
    num_chips: int
    mesh: dict[str, int]
    hbm_bytes: float             # documented capacity (`hardware.CHIPS`): the planner's margin
    argument_bytes: int
    output_bytes: int
    alias_bytes: int
    temp_bytes: int
    generated_code_bytes: int
    flops: float                 # per chip per step, loop bodies x trip counts
    flops_cost_analysis: float   # the compiler's cost analysis (loop bodies counted once)
    model_flops: float | None    # analytic, per chip per step (PaLM convention)
    expected_flops: float | None = None  # model FLOPs + remat recompute + padding (aot.flops)
    padding_flops: float = 0.0   # of which on MoE capacity buffers' empty slots (aot.flops)
    kernel_calls: int = 0        # Pallas kernel (custom call) executions per chip per step
    kernel_flops: float = 0.0    # their FLOPs, analytic, included in `flops` (aot.flops)
    int8_flops: float = 0.0      # the part of `flops` in int8 x int8 matmuls (precision=int8)
    grouped_flops: float = 0.0   # the part of `flops` in grouped matmuls, static rows (hlo_flops)
    routed_flops: float = 0.0    # what they compute at the routed rows, analytic (aot.flops)
    collectives: list[dict] = field(default_factory=list)
    # Analytic bytes per chip per step by kind, to read the table against (aot.traffic).
    expected_collectives: dict[str, float] = field(default_factory=dict)
    compile_s: float = 0.0
    tokens_per_step: int = 0
    hlo_path: str | None = None
    hbm_limit_bytes: float = 0.0  # what libtpu lets a program use (0: the capacity)
    host_temp_bytes: int = 0      # pinned host memory: activations a remat policy offloads
    host_argument_bytes: int = 0  # pinned host memory: arguments placed on the host
    host_output_bytes: int = 0    # pinned host memory: outputs (the offloaded optimizer state)

    @property
    def host_transfer_bytes(self) -> tuple[int, int]:
        """(to the device, to the host) per chip per step over PCIe: host arguments read in,
        host outputs written back, offloaded activations written in the forward pass and read
        back in the backward pass."""
        return (self.host_argument_bytes + self.host_temp_bytes,
                self.host_output_bytes + self.host_temp_bytes)
    attention_traffic: dict | None = None  # expected across sequence shards (aot.traffic)

    @property
    def step_flops(self) -> float:
        """The FLOPs the step computes: `flops` with a dropless MoE's grouped matmuls at the
        routed rows instead of their static row count (an upper bound, 2-8x the routed rows)."""
        return self.flops - self.grouped_flops + self.routed_flops if self.grouped_flops \
            else self.flops

    @property
    def total_bytes(self) -> int:
        """Peak per chip: arguments + outputs not aliased to arguments + temporaries."""
        return self.argument_bytes + self.output_bytes - self.alias_bytes + self.temp_bytes

    @property
    def fits(self) -> bool:
        """Whether the compiler accepts the step at all: within its own HBM limit where the
        table has it, else the capacity (`hardware.fits` with no margin; the planner and the
        presets ask for `hardware.HBM_MARGIN` of it free)."""
        return hardware_fits(self.total_bytes, self.hbm_limit_bytes or self.hbm_bytes, 0.0)

    def to_json(self) -> dict:
        return {**asdict(self), "total_bytes": self.total_bytes, "fits": self.fits,
                "step_flops": self.step_flops}


def topology_mesh(config: mlc.ConfigDict, topology: Topology, devices: list) -> Any:
    from jaxscale.mesh import make_mesh, resolve_mesh_shape

    try:
        ici, dcn = resolve_mesh_shape(config.mesh, len(devices))
        slices = 1
        for v in dcn.values():
            slices *= v
        if slices != topology.num_slices:
            raise MeshError(paragraph(
                f"The dcn_* factors {dcn} ask for {slices} slice(s), but the topology has",
                f"{topology.num_slices} (--num_slices). Set e.g. --config.mesh.dcn_data=",
                f"{topology.num_slices} so that their product equals --num_slices.",
            ))
        return make_mesh(config.mesh, devices)
    except MeshError as e:
        raise MeshError(paragraph(
            f"The mesh does not fit {topology.label()} ({len(devices)} chips): {e}",
            "The product of the mesh axes (and dcn_* factors) must equal the chip count.",
        )) from None


def compile_step(config: mlc.ConfigDict, topology: Topology,
                 hlo_dir: str | None = None) -> StepReport:
    """Compiles config's train step for `topology`; raises JaxscaleErrors for bad input."""
    from jaxscale.train.build import batch_spec, build_step

    config_lib.validate(config)
    require_language_model(config)
    devices = topology_devices(topology)
    mesh = topology_mesh(config, topology, devices)
    start = time.perf_counter()
    lowered = build_step(config, mesh).lower(batch_spec(config))
    with tempfile.TemporaryDirectory() as tmp:
        dump = hlo_dir or tmp
        options = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True,
                   "xla_dump_hlo_pass_re": "spmd-partitioning"}
        try:
            compiled = lowered.compile(compiler_options=options)
        except Exception as e:  # libtpu's refusals and failures, as one paragraph each
            rows = rows_per_chip(config, mesh.shape["data"], mesh.shape["fsdp"])
            raise (_hbm_oom(e, topology, config, rows)
                   or as_compiler_error(e, topology, config)) from None
        text_path = dumped_hlo(dump, "after_optimizations.txt")
        with open(text_path) as f:
            optimized = hlo.parse(f.read())
        with open(partitioned_hlo(dump)) as f:
            partitioned = hlo.parse(f.read())
    elapsed = time.perf_counter() - start
    calls = hlo_flops.kernel_calls(partitioned)
    in_kernels = flops_lib.kernel_flops(config, topology.num_chips) if calls else 0.0
    grouped = hlo_flops.grouped_flops(partitioned)
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    slices = ([d.slice_index for d in mesh.devices.flat] if topology.num_slices > 1 else None)
    return StepReport(
        topology=topology.label(), num_chips=topology.num_chips, mesh=dict(mesh.shape),
        hbm_bytes=topology.chip.hbm_bytes,
        hbm_limit_bytes=usable_hbm_bytes(devices, topology.chip) or 0.0,
        argument_bytes=mem.argument_size_in_bytes, output_bytes=mem.output_size_in_bytes,
        alias_bytes=mem.alias_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
        generated_code_bytes=mem.generated_code_size_in_bytes,
        host_temp_bytes=mem.host_temp_size_in_bytes,
        host_argument_bytes=mem.host_argument_size_in_bytes,
        host_output_bytes=mem.host_output_size_in_bytes,
        flops=hlo_flops.flops(partitioned) + in_kernels,
        flops_cost_analysis=float(cost.get("flops", 0.0)),
        model_flops=flops_lib.model_flops(config, topology.num_chips),
        expected_flops=flops_lib.expected_flops(config, topology.num_chips),
        padding_flops=flops_lib.padding_flops(config, topology.num_chips),
        expected_collectives=_expected_collectives(config, mesh),
        kernel_calls=calls, kernel_flops=in_kernels, int8_flops=hlo_flops.int8_flops(partitioned),
        grouped_flops=grouped,
        routed_flops=flops_lib.routed_flops(config, topology.num_chips) if grouped else 0.0,
        collectives=[asdict(c) for c in hlo.collectives(optimized, slices)],
        compile_s=elapsed, tokens_per_step=config.data.batch_size * config.data.seq_len,
        hlo_path=text_path if hlo_dir else None,
        attention_traffic=traffic.attention_traffic(config))


def _expected_collectives(config: mlc.ConfigDict, mesh: Any) -> dict[str, float]:
    """The analytic bytes per chip per step the report shows beside the table (`aot.traffic`);
    only the kinds with an expectation."""
    a2a = traffic.moe_all_to_all_bytes(config, mesh)
    return {"all-to-all": a2a} if a2a else {}


def partitioned_hlo(dump_dir: str) -> str:
    """The step's module after SPMD partitioning (one chip's share, before fusion: what its
    FLOPs are counted on). On a single chip the partitioner has nothing to do and libtpu dumps
    no such module: the module as it entered the compiler is that chip's whole share."""
    if glob.glob(os.path.join(dump_dir, "*after_tpu-spmd-partitioning*.txt")):
        return dumped_hlo(dump_dir, "after_tpu-spmd-partitioning*.txt")
    return dumped_hlo(dump_dir, "before_optimizations.txt")


def dumped_hlo(dump_dir: str, suffix: str) -> str:
    found = sorted(glob.glob(os.path.join(dump_dir, "*" + suffix)),
                   key=os.path.getsize)
    if not found:
        raise TopologyError(paragraph(
            f"libtpu wrote no optimized HLO into {dump_dir}; this libtpu version may not",
            "support --xla_dump_to. Reinstall with `pip install 'jaxscale[tpu]'`.",
        ))
    return found[-1]  # the train step is the largest module
