"""A config's fields against the reference config: names, presence and value kinds.

Command-line overrides are checked by ml_collections at parse time; these checks catch the same
mistakes made inside a config file (`c.train.stepz = 3` silently adds a field) or in a config
built in Python, before anything is built. `config.check_fields` builds the reference (the base
config with the model family's dataclass fields) and asks `check_group`.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

import ml_collections as mlc

from jaxscale.errors import ConfigError, paragraph


def as_field(default: Any) -> Any:
    """A model dataclass field's default as a config value: a nested dataclass (`model.moe`)
    becomes a group of fields."""
    if dataclasses.is_dataclass(default):
        return mlc.ConfigDict(dataclasses.asdict(default))
    return default


def check_group(node: mlc.ConfigDict, ref: mlc.ConfigDict, path: str, model_path: str,
                hints: Mapping[str, str]) -> None:
    """`node`'s fields against `ref`'s, recursively: no unknown field (with the closest known
    one), none missing outside the model group (whose fields default to its dataclass's), no
    required field unset (`hints` says what to give), each value of its default's kind."""
    unknown = sorted(set(node.keys()) - set(ref.keys()))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(ref.keys()), n=1)
        raise ConfigError(paragraph(
            f"{path} has no field '{unknown[0]}'" + (f" (did you mean '{close[0]}'?)." if close
                                                     else "."),
            f"Its fields: {', '.join(sorted(ref.keys()))}.",
            "Config files start from jaxscale.config.base_config() and may only change fields.",
        ))
    missing = sorted(set(ref.keys()) - set(node.keys()))
    if missing and not path.startswith(model_path):  # model fields default to the dataclass's
        raise ConfigError(paragraph(
            f"{path} lacks the field(s) {', '.join(missing)}. Start config files from",
            "jaxscale.config.base_config() so that every field has a value.",
        ))
    for key in node.keys():
        value, expected, where = node[key], ref[key], f"{path}.{key}"
        if isinstance(expected, mlc.ConfigDict):
            if not isinstance(value, mlc.ConfigDict):  # the message reprs the value: only then
                raise ConfigError(paragraph(
                    f"{where} must be a group of fields (a ConfigDict), not {value!r}."))
            check_group(value, expected, where, model_path, hints)
        elif value is None and expected is not None:
            hint = hints.get(key, "a value")
            raise ConfigError(paragraph(
                f"{where} is required by this config but not set: pass",
                f"--{where}=VALUE ({hint}).",
            ))
        elif expected is not None and not _same_kind(value, expected):
            raise ConfigError(paragraph(
                f"{where}={value!r} has type {type(value).__name__}, but the field holds",
                f"{type(expected).__name__} values (default {expected!r}).",
            ))


def _same_kind(value: Any, expected: Any) -> bool:
    """Type compatibility as ml_collections allows it: int for float, list for tuple."""
    if isinstance(expected, bool) or isinstance(value, bool):
        return isinstance(value, bool) and isinstance(expected, bool)
    if isinstance(expected, float):
        return isinstance(value, (int, float))
    if isinstance(expected, (tuple, list)):
        return isinstance(value, (tuple, list))
    return isinstance(value, type(expected))
