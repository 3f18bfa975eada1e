"""`jaxscale lm-eval [lm_eval flags]`: EleutherAI's lm-evaluation-harness with the `jaxscale`
model registered, e.g.

    jaxscale lm-eval --model jaxscale --model_args workdir=runs/tiny_lm --tasks hellaswag

Every flag is the harness's own (`lm_eval --help`). `lm_eval --model jaxscale` alone finds the
model through jaxscale's `lm_eval.models` entry point on harness versions that read entry points;
this command works on every version (it registers the model, then runs the harness's CLI).
"""

from __future__ import annotations

import argparse
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
    from jaxscale.inference.lm_harness import JaxscaleLM, register

    register()
    flags = harness_flags(sys.argv[1:])
    model_args = _jaxscale_model_args(flags)
    if model_args is not None:  # checked before the harness spends seconds indexing its tasks
        JaxscaleLM.check_arg_string(model_args)
    index_local_tasks_only(flags)
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
    except ValueError as e:  # the harness's own check of --tasks, raised as a bare ValueError
        if "Tasks not found" not in str(e):
            raise
        raise JaxscaleError(paragraph(
            f"lm-eval: {e}. `jaxscale lm-eval ls tasks` lists the harness's tasks; a task of",
            "your own is a YAML (and its data) in a directory given to --include_path",
            "(docs/post-training.md, 'lm-eval').")) from None


def harness_flags(argv: list[str]) -> argparse.Namespace:
    """The harness flags this command reads before handing argv, unchanged, to the harness:
    `--model`, `--model_args`, `--tasks` and `--include_path` (the rest are left to it)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model", default="")
    parser.add_argument("--model_args", default="")
    parser.add_argument("--tasks", "-t", nargs="+", default=None)
    parser.add_argument("--include_path", default=None)
    return parser.parse_known_args(argv)[0]


def index_local_tasks_only(flags: argparse.Namespace) -> bool:
    """Have the harness index only `--include_path` when every `--tasks` name is a task there;
    returns whether it does.

    The harness indexes its ~15,000 built-in task YAMLs on every run (seconds: bench/RESULTS.md)
    even when each task asked for is a local one, and its command line has no flag for its
    TaskManager's `include_defaults=False`. So, for this process, `lm_eval.tasks.TaskManager`
    (which the harness's CLI looks up when it runs) becomes a subclass with that default. A name
    that is not a task of the local directory (a built-in task, a group, a tag, a YAML path) leaves
    the harness untouched; a harness that looks the class up elsewhere only loses the speed-up."""
    if not flags.tasks or not flags.include_path:
        return False
    names = {name for arg in flags.tasks for name in arg.split(",") if name}
    import lm_eval.tasks

    harness_manager = lm_eval.tasks.TaskManager
    local = harness_manager(include_path=flags.include_path, include_defaults=False)
    if not names <= set(local.all_subtasks):
        return False

    class LocalTasksOnly(harness_manager):
        def __init__(self, *args, include_defaults: bool = False, **kwargs) -> None:
            super().__init__(*args, include_defaults=include_defaults, **kwargs)

    lm_eval.tasks.TaskManager = LocalTasksOnly
    return True


def _jaxscale_model_args(flags: argparse.Namespace) -> str | None:
    """The `--model_args` string of a `--model jaxscale` command line (None for another model,
    or arguments given as JSON, which the harness itself parses)."""
    if flags.model != "jaxscale" or flags.model_args.lstrip().startswith("{"):
        return None
    return flags.model_args


if __name__ == "__main__":
    main()
