"""Error types whose messages are one paragraph: what was found, what was expected, the fix."""

from __future__ import annotations


class JaxscaleError(ValueError):
    """Base class for user-facing configuration and input errors."""


class MeshError(JaxscaleError):
    """The mesh configuration does not fit the available devices."""


class RulesError(JaxscaleError):
    """A logical-axis rule cannot be applied to an array."""


class ConfigError(JaxscaleError):
    """The experiment config is malformed or inconsistent."""


class ConversionError(JaxscaleError):
    """A Hugging Face checkpoint cannot be converted faithfully."""


class EveryProcessError(JaxscaleError):
    """Raised on every process of a multi-process run at once, by agreement (an all-gather
    decided it): each process reports it itself, so `runtime.peer_failure` does not publish it
    to the others."""


def paragraph(*sentences: str) -> str:
    """Joins sentences into one readable paragraph (errors are read in terminals and logs)."""
    return " ".join(s.strip() for s in sentences if s and s.strip())


def short_error(error: BaseException) -> str:
    """The first line of an error, at most 200 characters, for a paragraph that names it
    (tensorstore's and botocore's run to pages). orbax wraps a failed array read as "... See
    full TensorStore details: <bound method ...>" (it formats a method, not its result): the
    read's own error, which it wraps, is shown instead."""
    text = str(error).strip()
    if " See full TensorStore details" in text and error.__context__ is not None:
        text = f"{text.split(' See full TensorStore details')[0]} {short_error(error.__context__)}"
    text = text.splitlines()[0] if text else type(error).__name__
    return text if len(text) <= 200 else text[:197] + "..."


def report(error: BaseException) -> int:
    """Prints `error` as an entry point's end and returns its exit status: a `JaxscaleError`'s
    paragraph (2), anything else's traceback (1)."""
    import sys
    import traceback

    if isinstance(error, JaxscaleError):
        print(f"jaxscale: error: {error}", file=sys.stderr, flush=True)
        return 2
    traceback.print_exception(error, file=sys.stderr)
    return 1


def command_name(module: str) -> str:
    """`jaxscale NAME` of the entry point in `module`; run by `jaxscale NAME` or `python -m`,
    an entry point's module is `__main__`, whose spec still names `jaxscale.launch.X`."""
    import sys

    if module == "__main__":
        spec = getattr(sys.modules.get("__main__"), "__spec__", None)
        module = spec.name if spec is not None else module
    leaf = module.rpartition(".")[2]  # launch/NAME.py is `jaxscale NAME` (launch.COMMANDS;
    return f"jaxscale {leaf.replace('_', '-')}"  # lm-eval, harness.py, raises no UsageError)


def usage_error(name: str, argv: list[str], message: str) -> JaxscaleError:
    """absl's `app.UsageError` as one paragraph: absl itself would print the whole flag help and
    exit 1, burying the one line that says what was wrong. `name` is `jaxscale COMMAND`."""
    extra = argv[1:]
    if message.startswith("Unexpected arguments") and extra:
        return JaxscaleError(paragraph(
            f"{name} takes no positional arguments, and was given {len(extra)}",
            f"({' '.join(extra)}): pass its settings as --flags (`{name} --help` lists them)."))
    return JaxscaleError(paragraph(f"{name}: {message}", f"(`{name} --help` lists its flags)."))


def exit_on_user_error(fn):
    """Decorator for entry points: a JaxscaleError (or absl's `app.UsageError`) exits with its
    paragraph and status 2, and a Ctrl-C with one line and 130 (128 + SIGINT, as a shell
    reports it), not a traceback."""
    import functools
    import sys

    from absl import app

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except JaxscaleError as e:
            sys.exit(report(e))
        except app.UsageError as e:
            argv = list(args[0]) if args and isinstance(args[0], (list, tuple)) else []
            sys.exit(report(usage_error(command_name(fn.__module__), argv, str(e))))
        except KeyboardInterrupt:
            print("jaxscale: interrupted (Ctrl-C); it stopped where it was.", file=sys.stderr,
                  flush=True)
            sys.exit(130)

    return wrapper
