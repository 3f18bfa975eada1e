"""Convert Hugging Face checkpoints to and from jaxscale.

    python -m launch.convert --from_hf=HF_DIR --out=WORKDIR [--dtype=bf16]
    python -m launch.convert --from_workdir=WORKDIR --to_hf=OUT [--dtype=bf16]
                             [--max_shard_size=5GB]

A non-empty output directory is refused unless `--overwrite` is given. The first writes
`WORKDIR/params/` (read by `--config.init_from=WORKDIR`) and
`WORKDIR/model_config.json`, one parameter at a time, and prints the one-line command that
fine-tunes it (the model and tokenizer come with the weights; `--config.init_from=HF_DIR` also
reads the Hugging Face directory directly, without this step). The second exports a training
workdir's newest checkpoint (LoRA adapters folded in) or a conversion output, with the
tokenizer files the weights came with; `--max_shard_size` splits it into
`model-0000i-of-0000n.safetensors` files plus `model.safetensors.index.json`.
"""

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error

_FROM_HF = flags.DEFINE_string("from_hf", None, "Hugging Face model directory to import.")
_OUT = flags.DEFINE_string("out", None, "Directory for the converted jaxscale weights.")
_FROM_WORKDIR = flags.DEFINE_string("from_workdir", None, "jaxscale workdir to export.")
_TO_HF = flags.DEFINE_string("to_hf", None, "Output directory for the Hugging Face layout.")
_DTYPE = flags.DEFINE_string("dtype", None, "Stored dtype (bf16, fp16, fp32); default: "
                             "float32 on import, as trained on export.")
_MAX_SHARD = flags.DEFINE_string("max_shard_size", None, "Export: split files past this size "
                                 "(e.g. 5GB); default: one model.safetensors.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Replace the files of a non-empty --out / "
                               "--to_hf directory (refused without it).")


@exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # orbax's INFO lines would bury the result
    cli.host_only()  # conversion needs no accelerator: no libtpu start-up lines
    from jaxscale.interop import convert
    if _FROM_HF.value and _OUT.value:
        model_cfg = convert.hf_to_workdir(_FROM_HF.value, _OUT.value, _DTYPE.value,
                                          _OVERWRITE.value)
        print(f"jaxscale: wrote {_OUT.value}/params and {_OUT.value}/{convert.MODEL_CONFIG}.")
        print(f"Fine-tune with: {convert.finetune_command(_OUT.value, model_cfg)}")
    elif _FROM_WORKDIR.value and _TO_HF.value:
        out = convert.workdir_to_hf(_FROM_WORKDIR.value, _TO_HF.value, _DTYPE.value,
                                    _MAX_SHARD.value, _OVERWRITE.value)
        print(f"jaxscale: wrote {out} (config.json and safetensors).")
    else:
        raise app.UsageError("Give --from_hf and --out, or --from_workdir and --to_hf.")


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
