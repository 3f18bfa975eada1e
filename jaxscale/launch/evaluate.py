"""Evaluate a workdir's newest weights on its held-out split, or on any text files.

    jaxscale evaluate --workdir=DIR [--cpu_devices=8] [--max_batches=N]
    jaxscale evaluate --workdir=DIR --eval_sources='text=/data/val/*.txt;jsonl=x.jsonl'

Prints loss, perplexity (language models) and accuracy as one JSON line.
"""

import json

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error
from jaxscale.runtime import distributed
from jaxscale.runtime.peer_failure import together

_WORKDIR = flags.DEFINE_string("workdir", None, "A launch.train workdir.", required=True)
_MAX_BATCHES = flags.DEFINE_integer("max_batches", 0, "Evaluate at most N batches (0: all).")
_SOURCES = flags.DEFINE_string(
    "eval_sources", "", "Evaluate on these files instead of the run's held-out split: "
    "FORMAT=GLOB[;FORMAT=GLOB...] as config.data.eval_sources (text, jsonl, parquet, "
    "array_record, tokens), tokenized with the run's tokenizer.")
_SKIP_BAD = flags.DEFINE_bool(
    "skip_bad_records", False, "Skip and count bad jsonl / parquet records of the evaluated "
    "data instead of failing (as config.data.skip_bad_records does for train).")
flags.register_validator("max_batches", lambda n: n >= 0,
                         "--max_batches must be 0 (every batch) or a positive count.")
distributed.define_flags()


@exit_on_user_error
def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    distributed.setup()
    from jaxscale.inference.evaluate import evaluate_workdir  # after the devices are configured
    with together():  # one process failing stops them all
        print(json.dumps(evaluate_workdir(_WORKDIR.value, _MAX_BATCHES.value, _SOURCES.value,
                                          _SKIP_BAD.value)))


if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
