"""`jaxscale lm-eval [lm_eval flags]`: EleutherAI's lm-evaluation-harness with the `jaxscale`
model registered, e.g.

    jaxscale lm-eval --model jaxscale --model_args workdir=runs/tiny_lm --tasks hellaswag

Every flag is the harness's own (`lm_eval --help`). `lm_eval --model jaxscale` alone finds the
model through jaxscale's `lm_eval.models` entry point on harness versions that read entry points;
this command works on every version (it registers the model, then runs the harness's CLI).
"""

from __future__ import annotations

import sys


def main() -> None:
    from jaxscale.errors import exit_on_user_error

    exit_on_user_error(_run)()


def _run() -> None:
    try:
        from lm_eval.__main__ import cli_evaluate
    except ImportError:
        sys.exit("jaxscale lm-eval: the lm-evaluation-harness is not installed; install it with "
                 "`pip install 'jaxscale[eval]'` (or `pip install lm_eval`) and run this again.")
    from jaxscale.errors import JaxscaleError, paragraph
    from jaxscale.inference.lm_harness import register

    register()
    sys.argv[0] = "jaxscale lm-eval"
    try:
        cli_evaluate()
    except OSError as e:  # the harness fetching a task's dataset (or files) and failing
        raise JaxscaleError(paragraph(
            f"lm-eval stopped on an I/O error: {e}. If it was fetching a task's dataset, this",
            "machine cannot reach the Hugging Face Hub (offline, or HF_DATASETS_OFFLINE /",
            "HF_HUB_OFFLINE set without the dataset in the cache). Run once where the Hub is",
            "reachable to fill the cache, or evaluate a local task: a YAML and a jsonl in a",
            "directory given to --include_path (docs/post-training.md, 'lm-eval').")) from None


if __name__ == "__main__":
    main()
