"""Compile a config's train step for a TPU topology on this machine (no TPU needed):

    python -m launch.compile --topology=v5p:4x4x8 --config=configs/llama.py:7b \
        [--config.mesh.fsdp=64 ...] [--num_slices=2] [--save_hlo=DIR] [--out=report.json]

Prints memory per chip against HBM, FLOPs, collectives and a roofline step-time estimate.
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


@exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from jaxscale.aot.topology import compile_only_env
    compile_only_env()  # before jax opens a backend
    from jaxscale.aot.compile import compile_step
    from jaxscale.aot.report import format_report, step_estimate
    from jaxscale.aot.topology import parse_topology

    report = compile_step(cli.resolved(_CONFIG.value),
                          parse_topology(_TOPOLOGY.value, _SLICES.value), _HLO.value)
    print(format_report(report))
    if _OUT.value:
        with open(_OUT.value, "w") as f:
            json.dump({**report.to_json(), "estimate": vars(step_estimate(report))}, f, indent=1)


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
