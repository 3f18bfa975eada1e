"""The dropless MoE's compiled FLOPs at the routed count: `launch.compile` counts grouped matmuls
(ragged-dot, megablox) at their static row counts, every row of the gathered or worst-case
received buffer, while only the routed rows are multiplied. This reads a saved compile (its
`--out` JSON and `--save_hlo` dump), takes the grouped part out (`aot/hlo_flops.grouped_flops`) and puts
the routed count back: 2 x rows x embed x width a matmul, rows = the chip's n tokens x k
(balanced: the mean over chips, exact in total), 3 matmuls forward, 6 backward, 3 more under
remat. For `configs/mixtral.py:8x7b,v5p-128` with `model.moe.capacity_factor=0`:

    python -m jaxscale.launch.compile --topology=v5p:4x4x4 \
        --config=jaxscale/configs/mixtral.py:8x7b,v5p-128 --config.model.moe.capacity_factor=0 \
        --out=REPORT.json --save_hlo=HLO_DIR
    python bench/moe_dropless_flops.py REPORT.json HLO_DIR [DISPATCH]
"""

from __future__ import annotations

import glob
import json
import os
import sys


def _largest(pattern: str) -> str:
    return max(glob.glob(pattern), key=os.path.getsize)


def routed_flops(config, chips: int) -> float:
    """Grouped-matmul FLOPs per chip per step at the routed rows."""
    m, moe = config.model, config.model.moe
    tokens = config.data.batch_size * config.data.seq_len / chips
    width = (moe.mlp or m.mlp) / config.mesh.tensor
    passes = 3 + (m.get("remat", "none") != "none")
    return m.num_layers * passes * 3 * 2 * tokens * moe.experts_per_token * m.embed * width


def main(argv: list[str]) -> None:
    from jax.sharding import AbstractMesh

    from jaxscale.aot import hlo, hlo_flops, traffic
    from jaxscale.aot.roofline import estimate
    from jaxscale.configs import mixtral
    from jaxscale.hardware import TPUS
    from jaxscale.mesh import MESH_AXES

    report, dump = json.load(open(argv[1])), argv[2]
    config = mixtral.get_config("8x7b,v5p-128")
    config.model.moe.update(capacity_factor=0.0, dispatch=argv[3] if len(argv) > 3 else "auto")
    mesh = AbstractMesh(tuple(config.mesh[a] for a in MESH_AXES), MESH_AXES)
    part = hlo.parse(open(_largest(f"{dump}/*after_tpu-spmd-partitioning*.txt")).read())
    opt = hlo.parse(open(_largest(f"{dump}/*after_optimizations.txt")).read())
    static = hlo_flops.flops(part) + report["kernel_flops"]
    grouped = hlo_flops.grouped_flops(part)
    routed = routed_flops(config, report["num_chips"])
    flops = static - grouped + routed
    collectives = [c.__dict__ for c in hlo.collectives(opt)]
    a2a = sum(c["bytes"] * c["executions"] for c in collectives if c["kind"] == "all-to-all")
    expected = traffic.moe_all_to_all_bytes(config, mesh)
    chip = TPUS[report["topology"].split(":")[0]]
    est = estimate(chip, flops, collectives, report["model_flops"])
    print(f"FLOPs static {static:.4e} (grouped {grouped:.4e}), routed grouped {routed:.4e}: "
          f"{flops:.4e}, expected {report['expected_flops']:.4e}, "
          f"ratio {flops / report['expected_flops']:.3f}")
    print(f"all-to-all {a2a / 2**30:.2f} GiB, expected {expected / 2**30:.2f} GiB")
    print(f"estimate compute {est.compute_s * 1e3:,.0f} ms, ICI {est.ici_s * 1e3:,.0f} ms, "
          f"step {est.full_overlap_s * 1e3:,.0f}..{est.no_overlap_s * 1e3:,.0f} ms, MFU "
          f"{est.mfu_full_overlap:.0%}..{est.mfu_no_overlap:.0%}")


if __name__ == "__main__":
    main(sys.argv)
