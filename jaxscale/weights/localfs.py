"""Guards for snapshot stores on a local (or NFS) disk: what tensorstore's file driver would do
with a hostile file tree, checked before it opens anything.

The file driver follows symbolic links and opens whatever it finds: a link replacing an array
directory would feed data from outside the store into the weights, and a FIFO in place of a
chunk file blocks the reading thread forever (where SIGTERM cannot stop it). So before a
snapshot is read, its files are walked with `os.lstat` (links are never followed): every path
from the store root down must be a real directory, and every file a regular file; anything else
makes the snapshot corrupt. Object stores (gs://, s3://) have no links or FIFOs: no-ops there.
"""

from __future__ import annotations

import os
import stat

from jaxscale.errors import paragraph
from jaxscale.weights.manifest import StoreError


def local_root(spec: dict) -> str | None:
    """The store's directory on this machine (None for object and memory stores)."""
    return spec["path"].rstrip("/") if spec.get("driver") == "file" else None


def _kind(mode: int) -> str:
    return "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"


def check_path(spec: dict, key: str, leaf_is_dir: bool | None = None) -> None:
    """Each component of `key` below the store root is a real directory (the last one a
    regular file, a directory, or either when `leaf_is_dir` is None), or absent (a missing key
    reads as missing, as before). Raises StoreError naming the culprit otherwise."""
    root = local_root(spec)
    if root is None:
        return
    path, parts = root, [p for p in key.split("/") if p]
    for i, part in enumerate(parts):
        path = os.path.join(path, part)
        try:
            mode = os.lstat(path).st_mode
        except FileNotFoundError:
            return
        last = i == len(parts) - 1
        ok = (stat.S_ISDIR(mode) and (not last or leaf_is_dir is not False)) or (
            last and stat.S_ISREG(mode) and not leaf_is_dir)
        if not ok:
            raise _corrupt(path, _kind(mode))


def check_tree(spec: dict, prefix: str) -> None:
    """`prefix` and everything under it: real directories and regular files only."""
    root = local_root(spec)
    if root is None:
        return
    check_path(spec, prefix, leaf_is_dir=True)
    top = os.path.join(root, prefix)
    for dirpath, dirnames, filenames in os.walk(top, followlinks=False):
        for name in dirnames + filenames:  # os.walk lists links to directories as dirnames
            path = os.path.join(dirpath, name)
            mode = os.lstat(path).st_mode
            if not (stat.S_ISDIR(mode) or stat.S_ISREG(mode)):
                raise _corrupt(path, _kind(mode))


def _corrupt(path: str, kind: str) -> StoreError:
    return StoreError(paragraph(
        f"{path} is {kind}, which a snapshot store never contains: a link could feed data from",
        "outside the store into the weights (a Lo-Fi average), and reading a FIFO or device",
        "would block. The snapshot holding it is treated as corrupt; remove the entry.",
    ))
