"""A full disk (or quota) under a Lo-Fi store: one paragraph naming the store and the space.

tensorstore reports it as `RESOURCE_EXHAUSTED` (in a ValueError), direct file writes as OSError
ENOSPC or EDQUOT. The writer that hit it removes its own unpublished attempt directory (never
another writer's: those are named by their own random token) and raises `DiskFullError`; once
space is freed, pushing or averaging again simply works.

A training run's other workdir files (metrics.jsonl, events.jsonl, TensorBoard's events) meet
the same full disk, often first: the checkpoint that fills it commits in the background and
reports its failure only at the next save. Those writes raise `file_full_error`, naming the file;
the train loop (`Trainer.run`) then lets the checkpoint in flight report itself first.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator

from jaxscale.errors import JaxscaleError, paragraph


class DiskFullError(JaxscaleError):
    """The store's disk (or quota) is full."""


def is_disk_full(e: BaseException) -> bool:
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(e)
    return "RESOURCE_EXHAUSTED" in text or "No space left on device" in text


def disk_full_error(location: str, what: str, need_bytes: int, removed: str) -> DiskFullError:
    return DiskFullError(paragraph(
        f"The store {location} ran out of space while {what}, which needs about",
        f"{need_bytes / 2**20:,.1f} MiB free. This attempt's files ({removed}) were removed and",
        "nothing was committed, so the store is as before. Free space (or raise the quota) and",
        "run it again: it continues from the newest complete checkpoint.",
    ))


def file_full_error(path: str) -> DiskFullError:
    """A workdir file (metrics.jsonl, events.jsonl, TensorBoard's events) that could not be
    written for a full disk: a raw ENOSPC names no file, and it is not a broken file to move
    aside (what a generic OSError paragraph would suggest)."""
    return DiskFullError(paragraph(
        f"The disk under {path} is full (or its quota reached): writing it failed and the run",
        "stopped. The lines already written and every checkpoint listed in the workdir are",
        "intact. Free space (or raise the quota) and run it again: it continues from the newest",
        "complete checkpoint.",
    ))


@contextlib.contextmanager
def naming_a_full_disk(path: str) -> Iterator[None]:
    """Writes to `path` inside: a full disk (or quota) there becomes `file_full_error(path)`;
    any other error passes unchanged."""
    try:
        yield
    except OSError as e:
        if is_disk_full(e):
            raise file_full_error(path) from None
        raise
