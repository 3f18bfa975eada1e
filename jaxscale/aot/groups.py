"""Replica groups of an HLO collective, in each of the three spellings XLA prints."""

from __future__ import annotations

import math
import re

import numpy as np

_GROUPS_LIST = re.compile(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}")
_GROUPS_IOTA = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")


def replica_groups(rest: str, partitions: int) -> list[list[int]] | None:
    """The replica groups of a collective as lists of partition ids (None: all devices)."""
    m = _GROUPS_LIST.search(rest)
    if m:
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}",
                                                                          m.group(1))]
        return groups or None
    m = _GROUPS_IOTA.search(rest)
    if m:
        out_shape = [int(x) for x in m.group(1).split(",")]
        ids = np.arange(math.prod(int(x) for x in m.group(2).split(",")))
        ids = ids.reshape([int(x) for x in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(x) for x in m.group(3).split(",")])
        return ids.reshape(out_shape[0], -1).tolist()
    m = _GROUPS_MESH.search(rest)
    if m:
        axes = re.findall(r"'(\w+)'=(\d+)", m.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        chosen = [names.index(a) for a in re.findall(r"'(\w+)'", m.group(2))]
        ids = np.arange(math.prod(sizes)).reshape(sizes)
        others = [i for i in range(len(sizes)) if i not in chosen]
        grouped = ids.transpose(others + chosen)
        return grouped.reshape(-1, math.prod(sizes[i] for i in chosen) or 1).tolist()
    return None
