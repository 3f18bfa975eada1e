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


def paragraph(*sentences: str) -> str:
    """Joins sentences into one readable paragraph (errors are read in terminals and logs)."""
    return " ".join(s.strip() for s in sentences if s and s.strip())
