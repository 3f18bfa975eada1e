"""One decoding step compiled for a TPU topology, ahead of time, against its bandwidth bound.

Decoding is bound by memory, not by FLOPs: each new token reads every weight and the whole KV
cache once, for a handful of FLOPs per byte. So the floor of a decode step is the bytes of
weights plus cache that each chip holds, over its HBM bandwidth (`hardware.Chip.hbm_bytes_s`),
and what a mesh adds on top of it is what this reports: `compile_decode` compiles the step the
rollout sampler runs for each new token (`inference/sampling.py`: the model over one token per row with
its cache, on the training mesh and rules, the cache sharded as training shards activations),
and estimates its time from the compiler's own accounting as a roofline: the program's
arguments (weights and cache) read once at the HBM bandwidth or its FLOPs at the peak rate,
whichever is slower, plus its collectives at the link bandwidths (`aot/roofline.py`), which sit
on the critical path of a step this small (an FSDP-sharded weight is gathered for every token;
a tensor-parallel layer all-reduces its output). An ESTIMATE, never a measurement.
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import asdict, dataclass, field
from typing import Any

import jax
import ml_collections as mlc
import numpy as np

from jaxscale import config as config_lib
from jaxscale.aot import hlo, hlo_flops
from jaxscale.aot.choices import require_language_model
from jaxscale.aot.compile import as_compiler_error, dumped_hlo, partitioned_hlo, topology_mesh
from jaxscale.aot.roofline import estimate
from jaxscale.aot.topology import Topology, topology_devices
from jaxscale.errors import ConfigError, paragraph

# libtpu's CompileTimeHbmOom, sizes with their unit letter (G, T, ...)
_CACHE_OOM = re.compile(r"HLO temporaries \(([\d.]+[KMGTP]?)\) exceeds? available HBM "
                        r"\(([\d.]+[KMGTP]?)\)")


@dataclass(frozen=True)
class DecodeReport:
    """A decode step of `batch` rows with a cache of `context` positions, per chip."""

    topology: str
    batch: int
    context: int
    mesh: dict[str, int]
    weight_bytes: float      # the weights each chip holds
    cache_bytes: float       # the KV cache each chip holds
    argument_bytes: int      # what the compiled step reads (weights, cache, the tokens)
    temp_bytes: int
    flops: float             # per chip per step
    hbm_bytes_s: float
    peak_flops: float
    collectives: list[dict] = field(default_factory=list)
    collective_s: float = 0.0

    @property
    def bound_s(self) -> float:
        """The floor: weights and cache read once at the HBM bandwidth."""
        return (self.weight_bytes + self.cache_bytes) / self.hbm_bytes_s

    @property
    def estimate_s(self) -> float:
        memory_s = self.argument_bytes / self.hbm_bytes_s
        return max(memory_s, self.flops / self.peak_flops) + self.collective_s

    @property
    def tokens_per_s(self) -> float:
        """New tokens per second of the whole slice at the estimate."""
        return self.batch / self.estimate_s

    def to_json(self) -> dict:
        return {**asdict(self), "bound_s": self.bound_s, "estimate_s": self.estimate_s,
                "ratio": self.estimate_s / self.bound_s}


def _chip_bytes(abstract: Any) -> float:
    """Bytes per chip of a tree of sharded ShapeDtypeStructs (each chip's shard of each)."""
    return float(sum(np.prod(x.sharding.shard_shape(x.shape)) * np.dtype(x.dtype).itemsize
                     for x in jax.tree.leaves(abstract)))


def _abstract_params(model_def: Any, rules: Any, mesh: Any) -> dict:
    from jaxscale.weights.place import named_shardings, param_specs
    from jaxscale.weights.tree import unflatten

    shardings = named_shardings(mesh, param_specs(model_def, rules, mesh))
    return unflatten({k: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=shardings[k])
                      for k, s in model_def.shapes().items()})


def compile_decode(config: mlc.ConfigDict, topology: Topology, batch: int,
                   context: int) -> DecodeReport:
    """Compiles the decode step of `config`'s model for `topology` (see the module)."""
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxscale.models import ModelDef
    from jaxscale.precision import get_policy
    from jaxscale.rules import AxisRules, use_rules

    config_lib.validate(config)
    require_language_model(config)
    max_len = int(config.model.get("max_len", 0) or 0)
    if batch < 1 or context < 1 or (max_len and context > max_len):
        raise ConfigError(paragraph(
            f"--decode_batch={batch} and --decode_context={context}: give at least one row",
            f"and one cache position, at most model.max_len={max_len or 'unbounded'}."))
    mesh = topology_mesh(config, topology, topology_devices(topology))
    rules = AxisRules.from_config(config)
    model_def = ModelDef.build(config.model, get_policy(config.precision))
    params = _abstract_params(model_def, rules, mesh)

    def empty_cache(p: dict) -> Any:
        with use_rules(rules, mesh):
            return model_def.module(p).init_cache(batch, context)

    try:  # libtpu refuses a cache that does not fit HBM here already
        cache_out = jax.jit(empty_cache).lower(params).compile().output_shardings
    except Exception as e:
        if found := _CACHE_OOM.search(str(e)):
            raise ConfigError(paragraph(
                f"The decoding cache of --decode_batch={batch} rows x --decode_context={context}",
                f"positions does not fit {topology.label()}: libtpu needs {found.group(1)}B per",
                f"chip for it against {found.group(2)}B. Lower --decode_batch or",
                "--decode_context, or shard the cache over more chips (mesh.data / tensor).",
            )) from None
        raise as_compiler_error(e, topology, config) from None
    cache = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                         jax.eval_shape(empty_cache, params), cache_out)

    def step(p: dict, cache: Any, token_B1: jax.Array, index: jax.Array) -> tuple[Any, Any]:
        with use_rules(rules, mesh):
            logits, cache = model_def.module(p)(token_B1, cache=cache, cache_index=index)
        return logits[:, -1].argmax(-1), cache

    replicated = NamedSharding(mesh, PartitionSpec())
    token = jax.ShapeDtypeStruct((batch, 1), np.int32, sharding=replicated)
    index = jax.ShapeDtypeStruct((), np.int32, sharding=replicated)
    lowered = jax.jit(step, donate_argnums=1).lower(params, cache, token, index)
    with tempfile.TemporaryDirectory() as dump:
        options = {"xla_dump_to": dump, "xla_dump_hlo_as_text": True,
                   "xla_dump_hlo_pass_re": "spmd-partitioning"}
        try:
            compiled = lowered.compile(compiler_options=options)
        except Exception as e:  # libtpu's refusals, as one paragraph
            raise as_compiler_error(e, topology, config) from None
        with open(dumped_hlo(dump, "after_optimizations.txt")) as f:
            optimized = hlo.parse(f.read())
        with open(partitioned_hlo(dump)) as f:
            partitioned = hlo.parse(f.read())
    chip, mem = topology.chip, compiled.memory_analysis()
    collectives = [asdict(c) for c in hlo.collectives(optimized, None)]
    flops = hlo_flops.flops(partitioned)
    timing = estimate(chip, flops, collectives, None)
    return DecodeReport(
        topology=topology.label(), batch=batch, context=context, mesh=dict(mesh.shape),
        weight_bytes=_chip_bytes(params), cache_bytes=_chip_bytes(cache),
        argument_bytes=mem.argument_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
        flops=flops, hbm_bytes_s=chip.hbm_bytes_s, peak_flops=chip.peak_bf16_flops,
        collectives=collectives, collective_s=timing.ici_s + timing.dcn_s)


def format_decode(r: DecodeReport) -> str:
    """The report's decode lines."""
    gib = lambda n: f"{n / 2**30:,.2f} GiB"
    return "\n".join([
        f"Decode step (ESTIMATE), batch {r.batch}, cache of {r.context} positions, per chip:",
        f"  weights {gib(r.weight_bytes)} + KV cache {gib(r.cache_bytes)} at "
        f"{r.hbm_bytes_s / 1e9:,.0f} GB/s: bound {r.bound_s * 1e3:,.3f} ms",
        f"  compiled: reads {gib(r.argument_bytes)}, {r.flops / 1e9:,.2f} GFLOP, collectives "
        f"{r.collective_s * 1e3:,.3f} ms",
        f"  estimate {r.estimate_s * 1e3:,.3f} ms a token ({r.estimate_s / r.bound_s:.2f}x the "
        f"bound), {r.tokens_per_s:,.0f} tokens/s for the slice",
    ])
