"""The attention components by name (`model.attention_kind`): an explicit table.

A new kind (latent attention, attention sinks, ...) is one module with an `AttentionKind`
subclass (`component.py` says what it answers) and one line here; nothing registers itself by
being imported. `model.attention` is another choice: the kernel (`kernels.ATTENTION_IMPLS`) a
kind computes its scores with.
"""

from __future__ import annotations

from typing import Any

from jaxscale.errors import ConfigError, paragraph
from jaxscale.models.attention.component import AttentionKind
from jaxscale.models.attention.grouped_query import GroupedQuery

DEFAULT_ATTENTION = "grouped_query"  # what a config without `model.attention_kind` builds

ATTENTIONS: dict[str, type[AttentionKind]] = {
    "grouped_query": GroupedQuery,
}


def attention_of(cfg: Any) -> AttentionKind:
    """The attention component of a decoder config (its `attention_kind`)."""
    kind = getattr(cfg, "attention_kind", DEFAULT_ATTENTION)
    if kind not in ATTENTIONS:
        raise ConfigError(paragraph(
            f"model.attention_kind={kind!r} is not an attention component; use one of",
            f"{', '.join(ATTENTIONS)} (jaxscale/models/attention/kinds.py), or add one: a",
            "module with an AttentionKind subclass and a line in ATTENTIONS."))
    return ATTENTIONS[kind](cfg)
