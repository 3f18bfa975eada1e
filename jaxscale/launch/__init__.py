"""The entry points, one module per command: `jaxscale NAME ...` or `python -m launch.NAME ...`.

Each module parses flags and calls the library (logic lives in `jaxscale/`, never here).
`COMMANDS` is the table behind the `jaxscale` console script (`jaxscale/__main__.py`):
command name -> (module in this package, one-line description).
"""

COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train from a config file (--config, --workdir)"),
    "evaluate": ("evaluate", "held-out loss / perplexity / accuracy of a workdir's weights"),
    "generate": ("generate", "sample text from a workdir or a Hugging Face model"),
    "lm-eval": ("harness", "lm-evaluation-harness tasks on a workdir's model (lm_eval's flags)"),
    "convert": ("convert", "Hugging Face <-> jaxscale weights"),
    "inspect": ("inspect", "where every parameter lives on the mesh, and the step's memory"),
    "plot": ("plot", "loss curves of one or more runs"),
    "prepare-data": ("prepare_data", "tokenize text files into ArrayRecord shards (+ tokenizer)"),
    "lofi-local": ("lofi_local", "a whole Lo-Fi job (workers + averager) on this machine"),
    "lofi-average": ("lofi_average", "the Lo-Fi averager (rounds, --watch, --final export)"),
    "compile": ("compile", "compile the train step for a TPU topology: memory, FLOPs, collectives"),
    "plan": ("plan", "rank candidate meshes / presets / remat for a TPU topology by compiling them"),
    "goodput": ("goodput", "productive step time over wall time across a run's restarts"),
    "profile-summary": ("profile_summary", "top ops and collective share of a run's profiler trace"),
    "local-multihost": ("local_multihost", "N local processes joined by jax.distributed"),
    "tpu-pod": ("tpu_pod", "run a command on every worker of a TPU VM slice"),
}
