"""Convert Hugging Face checkpoints to and from jaxscale.

    python -m launch.convert --from_hf=HF_DIR --out=WORKDIR       # HF -> params export
    python -m launch.convert --from_workdir=WORKDIR --to_hf=OUT   # workdir -> HF layout

The first writes `WORKDIR/params/` (read by `--config.init_from=WORKDIR`) and
`WORKDIR/model_config.json`, and prints the `--config.model.*` flags that fine-tune it.
"""

from absl import app, flags

from jaxscale.errors import exit_on_user_error

_FROM_HF = flags.DEFINE_string("from_hf", None, "Hugging Face model directory to import.")
_OUT = flags.DEFINE_string("out", None, "Directory for the converted jaxscale weights.")
_FROM_WORKDIR = flags.DEFINE_string("from_workdir", None, "jaxscale workdir to export.")
_TO_HF = flags.DEFINE_string("to_hf", None, "Output directory for the Hugging Face layout.")
_DTYPE = flags.DEFINE_string("dtype", None, "Export dtype (e.g. bfloat16); default: as stored.")


@exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from jaxscale.interop import convert
    if _FROM_HF.value and _OUT.value:
        model_cfg = convert.hf_to_workdir(_FROM_HF.value, _OUT.value)
        print(f"jaxscale: wrote {_OUT.value}/params and {_OUT.value}/{convert.MODEL_CONFIG}.")
        print("Fine-tune with: python -m launch.train --config=CONFIG --workdir=RUN "
              f"--config.init_from={_OUT.value} " + " ".join(convert.override_flags(model_cfg)))
    elif _FROM_WORKDIR.value and _TO_HF.value:
        out = convert.workdir_to_hf(_FROM_WORKDIR.value, _TO_HF.value, _DTYPE.value)
        print(f"jaxscale: wrote {out}/config.json and {out}/model.safetensors.")
    else:
        raise app.UsageError("Give --from_hf and --out, or --from_workdir and --to_hf.")


if __name__ == "__main__":
    app.run(main)
