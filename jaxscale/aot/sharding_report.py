"""The sharding inspector: where every parameter lives, what each device holds, what the step needs.

Used by `jaxscale inspect`. Nothing is allocated: shapes come from `jax.eval_shape`, and
the train step is lowered and compiled against abstract arrays for its memory analysis. The step
is the one `launch.train` runs (`train.build.build_step`, jitted and lowered as the loop does),
pipeline runner, LoRA and loss scaling included.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any

import jax
import ml_collections as mlc
from jax.sharding import NamedSharding

from jaxscale import config as config_lib
from jaxscale.mesh import make_mesh, mesh_summary
from jaxscale.train.build import batch_spec, build_step
from jaxscale.weights.tree import flatten

REPLICATED_WARN_FRACTION = 0.02


def fingerprint(lowered: jax.stages.Lowered) -> str:
    """sha256 of a lowered program's text: equal fingerprints mean the same program."""
    return hashlib.sha256(lowered.as_text().encode()).hexdigest()


@dataclass(frozen=True)
class ParamRow:
    path: str
    shape: tuple[int, ...]
    logical: tuple
    spec: Any
    bytes_total: int
    bytes_per_device: int
    trainable: bool = True  # False: frozen (a LoRA base weight: no gradients, no optimizer state)

    @property
    def replicated(self) -> bool:
        return self.bytes_per_device == self.bytes_total


def per_device_bytes(x: jax.ShapeDtypeStruct) -> int:
    shard = x.sharding.shard_shape(x.shape) if isinstance(x.sharding, NamedSharding) else x.shape
    return math.prod(shard) * x.dtype.itemsize


@dataclass
class Report:
    mesh: Any
    rows: list[ParamRow]
    opt_bytes_per_device: int
    compiled_memory: Any
    step_fingerprint: str | None = None  # sha256 of the lowered train step (`fingerprint`)

    @property
    def params_bytes_per_device(self) -> int:
        return sum(r.bytes_per_device for r in self.rows)

    def replicated_warning(self) -> str | None:
        """Names replicated tensors when they exceed 2% of parameter bytes on an fsdp/tp mesh."""
        if self.mesh.shape["fsdp"] == 1 and self.mesh.shape["tensor"] == 1:
            return None
        total = sum(r.bytes_total for r in self.rows)
        repl = [r for r in self.rows if r.replicated]
        frac = sum(r.bytes_total for r in repl) / max(total, 1)
        if frac <= REPLICATED_WARN_FRACTION:
            return None
        names = ", ".join(r.path for r in sorted(repl, key=lambda r: -r.bytes_total)[:10])
        return (f"WARNING: {frac:.1%} of parameter bytes are replicated on every device although "
                f"the mesh has fsdp={self.mesh.shape['fsdp']} tensor={self.mesh.shape['tensor']}: "
                f"{names}. Add rules that map their logical axes onto 'fsdp' or 'tensor'.")


def build_report(config: mlc.ConfigDict, compile_step: bool = True) -> Report:
    """The report of `config`'s train step; `compile_step` adds its compiled memory analysis."""
    config_lib.validate(config)
    setup = build_step(config, make_mesh(config.mesh))
    abstract, shardings = setup.abstract_state()
    model_def = setup.ctx.model_def
    logical = model_def.logical_axes()
    trainable = set(flatten(abstract.params))
    rows = []
    for path, x in sorted({**flatten(abstract.params), **flatten(abstract.frozen)}.items()):
        rows.append(ParamRow(path, tuple(x.shape), logical[path], x.sharding.spec,
                             math.prod(x.shape) * x.dtype.itemsize, per_device_bytes(x),
                             path in trainable))
    opt_bytes = sum(per_device_bytes(x) for x in jax.tree.leaves(abstract.opt_state))
    report = Report(setup.ctx.mesh, rows, opt_bytes, None)
    if compile_step:
        lowered = setup.lower(batch_spec(config), (abstract, shardings))
        report.compiled_memory = lowered.compile().memory_analysis()
        report.step_fingerprint = fingerprint(lowered)
    return report


def _mb(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def format_report(report: Report) -> str:
    lines = [f"mesh: {mesh_summary(report.mesh)}", ""]
    header = (f"{'parameter':<32} {'shape':<20} {'logical axes':<44} {'spec':<40} "
              f"{'per device':>12}  trains")
    lines += [header, "-" * len(header)]
    for r in report.rows:
        lines.append(f"{r.path:<32} {str(r.shape):<20} {str(r.logical):<44} "
                     f"{str(tuple(r.spec)):<40} {_mb(r.bytes_per_device):>12}  "
                     f"{'yes' if r.trainable else 'frozen'}")
    trained = [r for r in report.rows if r.trainable]
    lines += ["", f"params per device:          {_mb(report.params_bytes_per_device)}"
              f" ({len(trained)} of {len(report.rows)} tensors trainable, "
              f"{_mb(sum(r.bytes_per_device for r in trained))})",
              f"optimizer state per device: {_mb(report.opt_bytes_per_device)}"]
    m = report.compiled_memory
    if m is not None:
        lines += [f"compiled train step (per device): arguments {_mb(m.argument_size_in_bytes)}, "
                  f"outputs {_mb(m.output_size_in_bytes)}, temporaries {_mb(m.temp_size_in_bytes)}, "
                  f"aliased {_mb(m.alias_size_in_bytes)}"]
    warning = report.replicated_warning()
    if warning:
        lines += ["", warning]
    return "\n".join(lines)
