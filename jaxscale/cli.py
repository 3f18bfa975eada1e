"""Command-line parsing for entry points with a config flag: mistakes exit with one paragraph.

ml_collections checks `--config.*` overrides while absl parses flags, before `main` runs, and
reports them its own way: a typo'd field is a raw AttributeError with a long traceback, a wrong
type is "FATAL Flags parsing error", and an error raised by a config file's `get_config` arrives
wrapped around that file's whole traceback. `parse_flags` is an absl `flags_parser`
(`app.run(main, flags_parser=cli.parse_flags)`) that turns all of these into one
`jaxscale: error:` paragraph naming the field, its type and the valid fields, and exits 2 like
`errors.exit_on_user_error` does for errors raised later. A config file that does not parse, or
whose `get_config` raises, is named with the user's own innermost frame (file, line, code) and
the error, without absl's, runpy's and importlib's frames.

absl users put flags in any order, but ml_collections applies a `--config.a.b=v` override to
whatever config the flag holds when absl reaches it: given before `--config=FILE`, the override
meets the default config (or none) and fails with a misleading type error. `config_first`
therefore moves every `--NAME=FILE` of a config-file flag ahead of the other arguments (in
`sys.argv`, which ml_collections reads itself, when the flag is defined, and in the argv absl
parses), so overrides apply to the named file whatever their position.

The same overrides say which fields the user set: `resolved` hands them to
`jaxscale.weights.resolve`, which takes a stand-in model from `config.init_from`'s weights and
refuses a `--config.model.*` flag that contradicts them.
"""

from __future__ import annotations

import difflib
import glob
import importlib.util
import os
import re
import sys
import sysconfig
import traceback
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from absl import flags

from jaxscale import configs
from jaxscale.errors import JaxscaleError, paragraph

FLAGS = flags.FLAGS
EXIT_CODE = 2
# Errors of the flags themselves (ml_collections raises these for a bad `--config.a.b=v`).
_FLAG_ERRORS = (flags.Error, AttributeError, KeyError, TypeError, ValueError, OSError)
# Frames that are not the user's: Python's own, installed packages', jaxscale's (but the
# bundled configs are config files like the user's).
_FRAMEWORK = tuple(sorted({os.path.realpath(sysconfig.get_paths()[key]) + os.sep
                           for key in ("stdlib", "platstdlib", "purelib", "platlib")}))
_PACKAGE = os.path.dirname(os.path.realpath(__file__)) + os.sep


def parse_flags(argv: Sequence[str]) -> list[str]:
    """Parses `argv` into absl FLAGS; on a mistake prints one paragraph and exits."""
    argv = resolve_config_files(config_first(argv, _config_flag_names()))
    try:
        rest = _parse_or_help(argv)
        for name in _config_flag_names():
            _touch(FLAGS[name].value)  # a missing config file only raises when first read
            if FLAGS[name].value is None:  # its get_config returned nothing
                raise ValueError(f"Unexpected None value for flag {name}")
        return rest
    except Exception as e:  # those of a config file's code; the flags' own; else re-raised
        _fail_on_user_error(e, argv)
        raise


# absl's help flags: each prints and exits with status 1; asked for, help is a success (0).
HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def _parse_or_help(argv: Sequence[str]) -> list[str]:
    try:
        return FLAGS(argv)
    except SystemExit as stop:
        passed = argv[1:argv.index("--")] if "--" in argv else argv[1:]
        if stop.code == 1 and any(arg in HELP_FLAGS for arg in passed):
            sys.exit(0)
        raise


def config_first(argv: Sequence[str], names: Sequence[str]) -> list[str]:
    """`argv` with the config-file flags (`--NAME=FILE`, `--NAME FILE`) moved right after the
    program name, keeping their relative order and that of the rest; arguments after a bare
    `--` are left where they are (they belong to another program)."""
    argv = list(argv)
    end = argv.index("--") if "--" in argv else len(argv)
    moved, rest, i = [], [], 1
    while i < end:
        arg = argv[i]
        if any(arg.startswith(f"--{n}=") for n in names):
            moved.append(arg)
        elif arg in {f"--{n}" for n in names} and i + 1 < end:
            moved += [arg, argv[i + 1]]
            i += 1
        else:
            rest.append(arg)
        i += 1
    return argv[:1] + moved + rest + argv[end:]


def define_config_file(name: str, default: str, help_string: str) -> Any:
    """`config_flags.DEFINE_config_file`, whose overrides of the default config are checked at
    definition time when the command line has no `--NAME=`: those mistakes exit cleanly too."""
    from ml_collections import config_flags
    default = configs.resolve(default)
    # ml_collections reads the overrides from sys.argv itself (not from the argv absl parses)
    # and refuses one given before `--NAME=`, so the reordering must happen there.
    sys.argv[:] = config_first(sys.argv, [name])
    given = [a for a in sys.argv[1:] if a == f"--{name}" or a.startswith(f"--{name}=")]
    if len(given) > 1:
        fail(paragraph(f"--{name} is given {len(given)} times ({', '.join(given)}): give one",
                       f"config file, and change its fields with --{name}.FIELD=VALUE."))
    try:
        return config_flags.DEFINE_config_file(name, default, help_string)
    except Exception as e:  # those of a config file's code; the flags' own; else re-raised
        _fail_on_user_error(e, sys.argv, {name: default})
        raise


def resolve_config_files(argv: Sequence[str]) -> list[str]:
    """`argv` with every config-file flag's value (`--config=tiny_lm:test`, `--config X`) made a
    concrete path by `configs.resolve`: bundled configs are found from any directory."""
    names = set(_config_flag_names())
    out = list(argv)
    for i, arg in enumerate(out):
        name, eq, value = arg[2:].partition("=") if arg.startswith("--") else ("", "", "")
        if name in names and eq:
            out[i] = f"--{name}={configs.resolve(value)}"
        elif name in names and i + 1 < len(out):
            out[i + 1] = configs.resolve(out[i + 1])
    return out


def overridden(argv: Sequence[str] | None = None, name: str = "config") -> set[str]:
    """The dotted fields the command line's `--NAME.a.b=v` flags set (`model.num_layers`);
    `argv` defaults to `sys.argv`, which ml_collections applies the overrides from."""
    return {path for path, _ in _overrides(sys.argv if argv is None else argv, name)}


def resolved(config: Any, name: str = "config") -> Any:
    """`config` with the model and tokenizer its `config.init_from` supplies, the command
    line's `--NAME.model.*` / `--NAME.data.tokenizer` flags counting as set by the user
    (`jaxscale.weights.resolve`); reads the shapes the weights record, never a weight."""
    from jaxscale.weights.resolve import resolve  # lazy: the flags parse without jax
    return resolve(config, overridden(None, name))


def fail(message: str) -> NoReturn:
    print(f"jaxscale: error: {message}", file=sys.stderr)
    sys.exit(EXIT_CODE)


def _fail_on_user_error(error: Exception, argv: Sequence[str],
                        defaults: dict[str, str] | None = None) -> None:
    """Exits with one paragraph if `error` is the user's: raised by a config file's code (not a
    JaxscaleError, whose message is that paragraph already) or by the flags; else returns."""
    if defaults is None:
        defaults = {n: FLAGS[n].default_as_str.strip("'") for n in _config_flag_names()}
    if not isinstance(error, JaxscaleError):
        files = {os.path.realpath(_spec(argv, name, default).split(":", 1)[0]): name
                 for name, default in defaults.items()}
        broken = config_file_error(error, files) or _get_config_error(
            error, {name: _spec(argv, name, default) for name, default in defaults.items()},
            lambda: all(_load(argv, name, default) is None for name, default in defaults.items()))
        if broken:
            fail(broken)
    if isinstance(error, _FLAG_ERRORS):
        fail(describe(error, argv, defaults))


def config_file_error(error: BaseException, files: dict[str, str]) -> str | None:
    """One paragraph for an error out of loading a config file (`files`: its real path -> its
    flag's name): a syntax error, or anything its code or `get_config` raised. It names the file,
    the user's own innermost frame (file, line, code) and the error. None for other errors."""
    frames = traceback.extract_tb(error.__traceback__)
    through = [f for f in frames if os.path.realpath(f.filename) in files]
    syntax = isinstance(error, SyntaxError) and error.filename is not None
    if not through and not (syntax and os.path.realpath(error.filename) in files):
        return None
    path = through[0].filename if through else error.filename
    flag = files[os.path.realpath(path)]
    if syntax:
        where = f"{error.filename}, line {error.lineno}"
        code, message = (error.text or "").strip(), error.msg
    else:
        frame = ([f for f in frames if _is_users(f.filename)] or through)[-1]
        where = f"{frame.filename}, line {frame.lineno}, in {frame.name}"
        code, message = (frame.line or "").strip(), str(error)
    message = paragraph(*message.splitlines()).rstrip(".")
    code = f": `{code}`." if code else "."
    hint = ("Bundled configs are imported as `jaxscale.configs.NAME` (`configs.NAME` only "
            "from a checkout's root)." if isinstance(error, ModuleNotFoundError)
            and (error.name or "").split(".")[0] == "configs" else "")
    return paragraph(f"--{flag}={path}: the config file failed to load with",
                     f"{type(error).__name__}: {message}, at {where}{code}", hint,
                     "Fix the file and run the command again.")


def _get_config_error(error: BaseException, specs: dict[str, str],
                      no_config: Callable[[], bool]) -> str | None:
    """One paragraph for a config file whose `get_config` is missing, takes no argument while
    `FILE:ARG` passes one, or returns None (`specs`: the one config flag -> `file[:arg]`);
    these fail inside ml_collections, in no frame of the user's file. None for other errors."""
    if len(specs) != 1:
        return None
    [(name, spec)] = specs.items()
    path, _, arg = spec.partition(":")
    text = _last_line(error)  # ml_collections embeds the whole traceback in its message
    shape = ("A config file defines `def get_config(arg=None)` returning an "
             "ml_collections.ConfigDict (configs/tiny_lm.py is one).")
    if "no attribute 'get_config'" in text:
        return paragraph(f"--{name}={spec}: {path} defines no get_config.", shape)
    if "get_config()" in text and "argument" in text:
        given = f"passes {arg!r} to it" if arg else "passes no argument"
        return paragraph(f"--{name}={spec}: calling its get_config failed ({text}); the",
                         f"command line {given}.", shape)
    if f"Unexpected None value for flag {name}" in text or ("NoneType" in text and no_config()):
        return paragraph(f"--{name}={spec}: its get_config returned None, not a config.", shape)
    return None


def _is_users(filename: str) -> bool:
    """Whether a frame's file is the user's code (a config file, a module of their own)."""
    if filename.startswith("<"):  # <frozen importlib._bootstrap>, <string>
        return False
    path = os.path.realpath(filename)
    if path.startswith(_PACKAGE):
        return path.startswith(os.path.realpath(configs.DIRECTORY) + os.sep)
    return not path.startswith(_FRAMEWORK)


def _config_flag_names() -> list[str]:
    """Names of the defined config-file flags (they alone have a `config_filename`)."""
    return [name for name in FLAGS
            if name == FLAGS[name].name and hasattr(type(FLAGS[name]), "config_filename")]


def _touch(config: Any) -> None:
    """Reads an attribute: ml_collections' stand-in for an unloadable config raises OSError."""
    getattr(config, "keys", None)


def describe(error: BaseException, argv: Sequence[str],
             defaults: dict[str, str] | None = None) -> str:
    """One paragraph for a flag-parsing error: the culprit override, else the error's own text.

    `defaults` maps config flag names to their default config files (default: the defined ones).
    """
    if defaults is None:
        defaults = {n: FLAGS[n].default_as_str.strip("'") for n in _config_flag_names()}
    if isinstance(error, flags.UnrecognizedFlagError):
        return _unknown_flag(error.flagname, bool(defaults))
    for name, default in defaults.items():
        path = _spec(argv, name, default).split(":", 1)[0]
        if not os.path.isfile(path):
            found = sorted(f for f in glob.glob(os.path.join(os.path.dirname(path) or ".", "*.py"))
                           if not f.endswith("__init__.py"))
            return paragraph(f"--{name}={path}: no such config file.",
                             f"Config files there: {', '.join(found)}." if found else "",
                             f"Bundled configs (--{name}=NAME[:ARG]): "
                             f"{', '.join(configs.bundled_names())}.")
        overrides = _overrides(argv, name)
        config = _load(argv, name, default)
        if config is None:
            continue
        for path, _ in overrides:
            problem = _unknown_field(config, path, name)
            if problem:
                return paragraph(f"--{name}.{path}: {problem}")
        culprit = re.search(rf"--{re.escape(name)}\.([\w.]+)=", str(error))
        if culprit:
            return _wrong_type(name, culprit.group(1), dict(overrides).get(culprit.group(1)),
                               config)
    return _last_line(error)


def _unknown_flag(name: str, has_config: bool) -> str:
    """An unknown flag named with this command's own flags (not absl's logging flags, which
    absl's own "Did you mean" draws from)."""
    own = sorted(f"--{f.name}" for module, defined in FLAGS.flags_by_module_dict().items()
                 if module == sys.argv[0] or module.startswith(("jaxscale.", "launch."))
                 for f in defined)  # a command run as __main__ registers under argv[0]
    close = difflib.get_close_matches(f"--{name}", own, n=1)
    hint = f" Did you mean {close[0]}?" if close else ""
    passed = (" Flags for the processes it starts go after `--` (e.g. `-- --config=tiny_lm`)."
              if name.startswith("config") and not has_config else "")
    return paragraph(f"--{name} is not a flag of this command.{hint}{passed} Its flags:",
                     f"{', '.join(own) or 'none'} (`--help` describes them, and any arguments",
                     "it takes).")


def _overrides(argv: Sequence[str], name: str) -> list[tuple[str, str | None]]:
    """[(field path, value or None)] of `--NAME.a.b=value` / `--NAME.a.b value` arguments."""
    out, prefix = [], f"--{name}."
    for i, arg in enumerate(argv):
        if arg.startswith(prefix):
            path, eq, value = arg[len(prefix):].partition("=")
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out.append((path, value if eq else (nxt if nxt and not nxt.startswith("-") else None)))
    return out


def _spec(argv: Sequence[str], name: str, default: str) -> str:
    """The `file.py[:arg]` given by `--NAME=...` / `--NAME ...`, else the default."""
    from jaxscale.runtime.pod_commands import flag_value
    given = flag_value(argv, name)
    return configs.resolve(default if given is None else given)


def _load(argv: Sequence[str], name: str, default: str) -> Any:
    """The config the flag names (or its default), loaded again; None if that fails too."""
    try:
        path, *arg = _spec(argv, name, default).split(":", 1)
        module_spec = importlib.util.spec_from_file_location(f"_jaxscale_cli_{name}", path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_spec.name] = module  # dataclasses look it up while it executes
        module_spec.loader.exec_module(module)
        config = module.get_config(*arg)
        return config if hasattr(config, "keys") else None
    except Exception:  # the config itself is broken: fall back to the original error
        return None


def _unknown_field(config: Any, path: str, name: str = "config") -> str | None:
    """Why `path` names no field of `config`, with the closest valid names; None if it does."""
    node, walked = config, []
    for part in path.split("."):
        keys = list(node.keys()) if hasattr(node, "keys") else None
        if keys is None:
            return (f"config.{'.'.join(walked)} is a value of type {type(node).__name__}, not a "
                    f"group of fields, so it has no field '{part}'.")
        if part not in keys:
            where = f"config.{'.'.join(walked)}" if walked else "the config"
            close = difflib.get_close_matches(part, keys, n=1)
            hint = f" Did you mean --{'.'.join([name] + walked + close)}?" if close else ""
            return (f"{where} has no field '{part}'.{hint} Its fields: {', '.join(sorted(keys))}.")
        node = node[part]
        walked.append(part)
    return None


def _wrong_type(name: str, path: str, value: str | None, config: Any) -> str:
    node = config
    for part in path.split("."):
        node = node[part]
    kind = type(node).__name__
    given = f"--{name}.{path}={value if value is not None else ''}"
    if hasattr(node, "keys"):  # a group: its fields are set one by one
        fields = ", ".join(sorted(node.keys()))
        return paragraph(
            f"{given}: config.{path} is a group of fields, not a value. Set one of its fields,",
            f"e.g. --{name}.{path}.FIELD=VALUE; its fields: {fields}.",
        )
    hint = " (use true or false)" if isinstance(node, bool) else ""
    return paragraph(
        f"{given}: config.{path} has type {kind} (currently {node!r}), and {value!r} does not",
        f"parse as {kind}{hint}.",
    )


def _last_line(error: BaseException) -> str:
    """The error's message without an embedded traceback (ml_collections wraps config-file
    errors in one), and without the 'module.ErrorType: ' prefix of its last line."""
    text = str(error).strip()
    if text[:1] in "'\"" and text[-1:] == text[:1]:  # a KeyError's repr-quoted message
        text = text[1:-1]
    if "Traceback (most recent call last)" in text:
        text = text.strip().splitlines()[-1]
        text = re.sub(r"^[\w.]+(Error|Exception): ", "", text)
    return paragraph(*text.replace("\\n", "\n").splitlines())


def refuse_device_flag(passed: Sequence[str], ours: str) -> None:
    """A launcher (`local-multihost`, `lofi-local`) gives every process it starts its own
    simulated devices (`ours`, e.g. '--devices_per_process=4'); a `--cpu_devices` among the
    flags it passes on would fight it, so it is refused naming the launcher's flag."""
    given = [a for a in passed if a.split("=")[0] == "--cpu_devices"]
    if given:
        raise JaxscaleError(paragraph(
            f"{given[0]} among the flags passed on: the launcher gives each process its own",
            f"simulated devices ({ours}). Set {ours.split('=')[0]}=N instead and drop",
            "--cpu_devices."))
