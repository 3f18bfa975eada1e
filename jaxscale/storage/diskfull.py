"""A full disk (or quota) under a Lo-Fi store: one paragraph naming the store and the space.

tensorstore reports it as `RESOURCE_EXHAUSTED` (in a ValueError), direct file writes as OSError
ENOSPC or EDQUOT. The writer that hit it removes its own unpublished attempt directory (never
another writer's: those are named by their own random token) and raises `DiskFullError`; once
space is freed, pushing or averaging again simply works.
"""

from __future__ import annotations

import errno

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
