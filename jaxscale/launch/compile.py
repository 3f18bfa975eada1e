r"""Compile a config's train step for a TPU topology on this machine (no TPU needed):

    jaxscale compile --topology=v5p:4x4x8 --config=configs/llama.py:7b \
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
import os

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import JaxscaleError, exit_on_user_error, paragraph

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

    if _OUT.value:  # before minutes of compiling, not after
        check_out(_OUT.value)
    if _HLO.value:
        try:
            os.makedirs(_HLO.value, exist_ok=True)
        except OSError as e:
            raise JaxscaleError(paragraph(
                f"--save_hlo={_HLO.value} cannot be created ({e.strerror or e}): a path below a",
                "regular file, a read-only filesystem, or no permission. Give a writable",
                "directory for the HLO dump.")) from None
    config = cli.resolved(_CONFIG.value)
    topology = parse_topology(_TOPOLOGY.value, _SLICES.value)
    _check_decode_flags(_DECODE_BATCH.value, _DECODE_CONTEXT.value, _DECODE_ONLY.value)
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
        try:
            with open(_OUT.value, "w") as f:
                json.dump(out, f, indent=1)
        except OSError as e:
            raise JaxscaleError(_cannot_write(_OUT.value, e)) from None


def _check_decode_flags(batch: int, context: int, only: bool) -> None:
    """--decode_* before any compile: negative sizes, or a context or --decode_only without the
    batch that turns the decoding step on, would otherwise be ignored silently."""
    if batch < 0 or context < 0 or ((context or only) and batch < 1):
        raise JaxscaleError(paragraph(
            f"--decode_batch={batch}, --decode_context={context}, --decode_only={only}: the",
            "decoding step is compiled when --decode_batch=B >= 1 rows (with --decode_context=T",
            ">= 1 cache positions, default data.seq_len; --decode_only skips the train step).",
            "Give --decode_batch, or drop the other two."))


def _cannot_write(path: str, e: OSError) -> str:
    return paragraph(
        f"--out={path} cannot be written ({e.strerror or e}: {e.filename or path}): a path below",
        "a regular file, a missing or read-only directory, or no permission. Give a writable",
        "file path for the JSON report.")


def check_out(path: str) -> None:
    """`--out` names a file this process can create, checked before the compile."""
    parent = os.path.dirname(os.path.abspath(path)) or "."
    if os.path.isdir(path):
        raise JaxscaleError(f"--out={path} is a directory; give a file path for the JSON report.")
    if not os.path.isdir(parent):
        what = "a regular file" if os.path.exists(parent) else "missing"
        raise JaxscaleError(_cannot_write(path, OSError(0, f"{parent} is {what}", parent)))
    if not os.access(parent, os.W_OK):
        raise JaxscaleError(_cannot_write(path, OSError(0, "not writable", parent)))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
