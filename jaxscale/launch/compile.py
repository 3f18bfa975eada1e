"""Compile a config's train step for a TPU topology on this machine (no TPU needed):

    python -m launch.compile --topology=v5p:4x4x8 --config=configs/llama.py:7b \
        [--config.mesh.fsdp=64 ...] [--num_slices=2] [--save_hlo=DIR] [--out=report.json]

Prints memory per chip against HBM, FLOPs, collectives and a roofline step-time estimate.
`--decode_batch=B` also compiles one decoding step (B rows, a cache of `--decode_context`
positions, on the same mesh and rules) and prints its estimate against the HBM-bandwidth bound
of reading the weights and the cache (`jaxscale/aot/decode.py`); `--decode_only` skips the train
step.
Needs `pip install 'jaxscale[tpu]'` (libtpu). `--config.init_from=WEIGHTS` supplies the model as
it does to `train` (only the shapes it records are read).
"""

import json

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error

_CONFIG = cli.define_config_file("config", "configs/llama.py:tiny", "Experiment config.")
_TOPOLOGY = flags.DEFINE_string("topology", None, "TPU topology, e.g. v5p:4x4x8.", required=True)
_SLICES = flags.DEFINE_integer("num_slices", 1, "Slices joined over DCN (set mesh.dcn_*).")
_HLO = flags.DEFINE_string("save_hlo", None, "Directory for libtpu's optimized HLO dump.")
_OUT = flags.DEFINE_string("out", None, "Write the report as JSON here.")
_DECODE_BATCH = flags.DEFINE_integer("decode_batch", 0, "Also compile a decoding step of this "
                                     "many rows and report it against its bandwidth bound.")
_DECODE_CONTEXT = flags.DEFINE_integer("decode_context", 0, "Cache positions of that step "
                                       "(default: data.seq_len).")
_DECODE_ONLY = flags.DEFINE_bool("decode_only", False, "Compile only the decoding step.")


@exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from jaxscale.aot.topology import compile_only_env
    compile_only_env()  # before jax opens a backend
    from jaxscale.aot.compile import compile_step
    from jaxscale.aot.report import format_report, step_estimate
    from jaxscale.aot.topology import parse_topology

    config = cli.resolved(_CONFIG.value)
    topology = parse_topology(_TOPOLOGY.value, _SLICES.value)
    if _DECODE_ONLY.value and _DECODE_BATCH.value < 1:
        raise app.UsageError("--decode_only needs --decode_batch=B (rows of the decoding step).")
    out: dict = {}
    if not _DECODE_ONLY.value:
        report = compile_step(config, topology, _HLO.value)
        print(format_report(report))
        out = {**report.to_json(), "estimate": vars(step_estimate(report))}
    if _DECODE_BATCH.value > 0:
        from jaxscale.aot.decode import compile_decode, format_decode
        decode = compile_decode(config, topology, _DECODE_BATCH.value,
                                _DECODE_CONTEXT.value or config.data.seq_len)
        print(format_decode(decode))
        out["decode"] = decode.to_json()
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
