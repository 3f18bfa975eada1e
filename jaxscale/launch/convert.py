"""Convert Hugging Face checkpoints to and from jaxscale.

    jaxscale convert --from_hf=HF_DIR --out=WORKDIR [--dtype=bf16]
    jaxscale convert --from_workdir=WORKDIR --to_hf=OUT [--dtype=bf16]
                             [--max_shard_size=5GB]
    (either direction, DeepSeek-V3: [--mtp], its multi-token-prediction layer too)
    jaxscale convert --from_workdir=LORA_RUN --to_peft=OUT [--base_model=HF_DIR]
                             [--overwrite] [--dtype=bf16]

A non-empty output directory is refused unless `--overwrite` is given. The first writes
`WORKDIR/params/` (read by `--config.init_from=WORKDIR`) and
`WORKDIR/model_config.json`, one parameter at a time, and prints the one-line command that
fine-tunes it (the model and tokenizer come with the weights; `--config.init_from=HF_DIR` also
reads the Hugging Face directory directly, without this step). The second exports a training
workdir's newest checkpoint (LoRA adapters folded in) or a conversion output, with the
tokenizer files the weights came with; `--max_shard_size` splits it into
`model-0000i-of-0000n.safetensors` files plus `model.safetensors.index.json`. The third writes
a LoRA run's adapters, unmerged, as a PEFT adapter for the Hugging Face base model
(`jaxscale/interop/peft.py`), with the tokenizer files; a non-empty output directory is refused
unless `--overwrite`.
"""

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import JaxscaleError, exit_on_user_error, paragraph
from jaxscale.runtime import jax_platform

_FROM_HF = flags.DEFINE_string("from_hf", None, "Hugging Face model directory to import.")
_OUT = flags.DEFINE_string("out", None, "Directory for the converted jaxscale weights.")
_FROM_WORKDIR = flags.DEFINE_string("from_workdir", None, "jaxscale workdir to export.")
_TO_HF = flags.DEFINE_string("to_hf", None, "Output directory for the Hugging Face layout.")
_DTYPE = flags.DEFINE_string("dtype", None, "Stored dtype (bf16, fp16, fp32); default: "
                             "float32 on import, as trained on export.")
_TO_PEFT = flags.DEFINE_string("to_peft", None, "Output directory for the LoRA adapters as a "
                               "PEFT adapter (adapter_config.json + adapter_model.safetensors).")
_BASE_MODEL = flags.DEFINE_string("base_model", None, "--to_peft: the adapter's "
                                  "base_model_name_or_path (default: the run's Hugging Face "
                                  "init_from, or what its conversion was made from).")
_MAX_SHARD = flags.DEFINE_string("max_shard_size", None, "Export: split files past this size "
                                 "(e.g. 5GB); default: one model.safetensors.")
_MTP = flags.DEFINE_bool("mtp", False, "DeepSeek-V3: also import (--from_hf) or export (--to_hf) "
                         "the multi-token-prediction layer (HF layer num_hidden_layers); "
                         "default: left unread / not written.")
_OVERWRITE = flags.DEFINE_bool("overwrite", False, "Write into a non-empty --out, --to_hf or "
                               "--to_peft directory, replacing its files (refused without it).")


@exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    from absl import logging
    logging.set_verbosity(logging.WARNING)  # orbax's INFO lines would bury the result
    jax_platform.host_only()  # conversion needs no accelerator: no libtpu start-up lines
    from jaxscale.interop import convert
    _check_one_conversion()
    if _FROM_HF.value and _OUT.value:
        model_cfg = convert.hf_to_workdir(_FROM_HF.value, _OUT.value, _DTYPE.value,
                                          _OVERWRITE.value, mtp=_MTP.value)
        print(f"jaxscale: wrote {_OUT.value}/params and {_OUT.value}/{convert.MODEL_CONFIG}.")
        print(f"Fine-tune with: {convert.finetune_command(_OUT.value, model_cfg)}")
    elif _FROM_WORKDIR.value and _TO_HF.value:
        out = convert.workdir_to_hf(_FROM_WORKDIR.value, _TO_HF.value, _DTYPE.value,
                                    _MAX_SHARD.value, _OVERWRITE.value, mtp=_MTP.value)
        print(f"jaxscale: wrote {out} (config.json and safetensors).")
    elif _FROM_WORKDIR.value and _TO_PEFT.value:
        out, base = convert.workdir_to_peft(_FROM_WORKDIR.value, _TO_PEFT.value, _DTYPE.value,
                                            _BASE_MODEL.value, _OVERWRITE.value)
        print(f"jaxscale: wrote {out} (adapter_config.json and adapter_model.safetensors).")
        if base is None:
            print("jaxscale: the run's base is no Hugging Face model, so the adapter names none:"
                  " export the base with --to_hf and pass it as --base_model=DIR (or give"
                  " PeftModel.from_pretrained that base yourself).")


def _check_one_conversion() -> None:
    """One source and one target, and no flag that the conversion asked for would ignore."""
    given = [f"--{f.name}" for f in (_FROM_HF, _OUT, _FROM_WORKDIR, _TO_HF, _TO_PEFT,
                                     _BASE_MODEL) if f.value]
    known = (["--from_hf", "--out"], ["--from_workdir", "--to_hf"],
             ["--from_workdir", "--to_peft"], ["--from_workdir", "--to_peft", "--base_model"])
    if given not in known:
        raise JaxscaleError(paragraph(
            f"jaxscale convert was given {' '.join(given) or 'no source or target'}: give",
            "--from_hf=DIR --out=DIR (import), --from_workdir=DIR --to_hf=DIR (export), or",
            "--from_workdir=DIR --to_peft=DIR [--base_model=NAME] (LoRA adapters), one at a",
            "time."))
    if _MAX_SHARD.value is not None:
        if not _TO_HF.value:
            raise JaxscaleError(paragraph(
                f"--max_shard_size={_MAX_SHARD.value} splits the safetensors files of an export",
                "(--to_hf); this conversion writes none it could split. Drop the flag."))
        from jaxscale.interop.safetensors_io import parse_size
        parse_size(_MAX_SHARD.value)  # a bad size fails before anything is written
    if _MTP.value and _TO_PEFT.value:
        raise JaxscaleError(paragraph(
            "--mtp imports (--from_hf) or exports (--to_hf) DeepSeek-V3's multi-token-prediction",
            "layer; a PEFT adapter holds only the LoRA adapters. Drop --mtp."))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
