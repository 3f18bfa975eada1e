"""Nested parameter dicts <-> flat `{'a/b/c': leaf}` maps, and trainable/frozen splits.

Parameters are plain nested dicts (the pure form of an NNX state); every module that stores,
averages, converts or places them addresses leaves by their '/'-joined path. These helpers know
nothing of models or training, so models, checkpoints, interop and Lo-Fi can share them without
reaching into `train/`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def flatten(tree: Mapping) -> dict[str, Any]:
    """Nested dict -> {'a/b/c': leaf}."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            out.update({f"{key}/{k}": v for k, v in flatten(value).items()})
        else:
            out[str(key)] = value
    return out


def unflatten(flat: Mapping[str, Any]) -> dict:
    """{'a/b/c': leaf} -> nested dict (the inverse of `flatten`)."""
    out: dict = {}
    for path, value in flat.items():
        node = out
        *parents, leaf = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return out


def merge_trees(a: Mapping, b: Mapping) -> dict:
    """Union of two nested dicts with disjoint leaves (trainable + frozen)."""
    return unflatten({**flatten(a), **flatten(b)})


def split_trainable(params: Mapping, is_trainable: Callable[[str], bool]) -> tuple[dict, dict]:
    """(trainable, frozen) nested dicts, by a predicate on each leaf's path."""
    flat = flatten(params)
    return (unflatten({k: v for k, v in flat.items() if is_trainable(k)}),
            unflatten({k: v for k, v in flat.items() if not is_trainable(k)}))


def all_trainable(path: str) -> bool:
    """The default predicate: every parameter gets gradients (no LoRA)."""
    return True
