"""The local tier's directory, checked before the tier restores or deletes anything there.

Each process's directory (`local_directory`: `checkpoint.local_dir` with `{process}` replaced)
must be apart from the run's workdir, writable, used by no other process of this run, and
this run's own: `claim` binds it to the run's workdir with a small record,
`.jaxscale-tier-owner.json`, written once and never rewritten.

Why the owner: the local tier is found by its path alone, and a run restores its newest local
step when that is at least as new as its persistent one, which in a fresh workdir is always.
So a second run given another run's `local_dir` (a habit such as `--config.checkpoint.
local_dir=/ssd/tier` for every run) would silently start from that run's weights and step,
and its saves would then delete that run's steps (orbax keeps `local_keep`). A tier whose
record names another workdir is refused on every process, before anything is read or
deleted. So are local steps in a tier whose workdir holds no earlier start (no config.json,
which every start writes before its first step): the steps of a run whose workdir was deleted
or emptied, which a fresh start would otherwise continue. A tier without a record (empty, or
made by a jaxscale before the record) is claimed.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

import jax
import numpy as np

from jaxscale.errors import EveryProcessError, JaxscaleError, paragraph
from jaxscale.storage import locations, workdir_files
from jaxscale.train.local_faults import all_agree, broadcast_json, failed_processes, gather_texts

log = logging.getLogger("jaxscale.train")
OWNER_FILE = ".jaxscale-tier-owner.json"


def local_directory(template: str) -> str:
    """This process's local tier: `template` with `{process}` replaced, made absolute."""
    return os.path.abspath(template.replace("{process}", str(jax.process_index())))


def prepare_directory(directory: str, workdir: str) -> None:
    """Runs the checks of the module docstring, in the order that makes each safe: refused on
    every process at once where one is refused."""
    check_apart(directory, workdir)
    check_usable(directory)
    check_not_shared(directory)  # a run refused here leaves no record
    claim(directory, workdir)


def check_apart(directory: str, workdir: str) -> None:
    """The local tier is not the workdir or its persistent checkpoints: two orbax managers in
    one directory would delete each other's steps (each keeps only its newest few)."""
    if not workdir or locations.is_remote(workdir):
        return
    for place in (workdir, os.path.join(workdir, "checkpoints")):
        if os.path.realpath(directory) == os.path.realpath(place):
            raise JaxscaleError(paragraph(
                f"checkpoint.local_dir resolves to {directory}, the run's own",
                f"{'workdir' if place == workdir else 'persistent checkpoint directory'}: the",
                "local tier writes and deletes numbered step directories of its own, which would",
                "mix with (or delete) the run's. Give it a directory of its own on the host's fast",
                "disk, e.g. /ssd/tier-{process}."))


def check_usable(directory: str) -> None:
    """Makes this process's tier directory and writes a probe file there; refuses, on every
    process at once (not on the failing one alone, its peers left waiting in the next
    collective), a tier that some process cannot use."""
    probe = os.path.join(directory, f".jaxscale-probe-{jax.process_index()}")
    error: OSError | None = None
    try:
        os.makedirs(directory, exist_ok=True)  # orbax's create=True refuses a subset
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        error = e
    failed = failed_processes(error is None)
    if not failed:
        return
    texts = gather_texts(f"{error.strerror or error}: {error.filename or directory}"
                         if error is not None else "")
    raise EveryProcessError(paragraph(
        f"checkpoint.local_dir cannot be used as the local tier of {_where(failed, texts)}: a",
        "regular file, a path below one, a read-only filesystem, or no permission. Give a",
        "writable directory on the host's own disk (it may contain {process})."))


def owner_of(workdir: str) -> str:
    """How a tier's record names a workdir: a local one by its real path, a bucket by URL."""
    if locations.is_remote(workdir):
        return locations.parse(workdir).url()
    return os.path.realpath(workdir)


def claim(directory: str, workdir: str) -> None:
    """Checks this process's tier against the run (another run's record; steps the workdir
    never made), agreed by every process, then records `workdir` as its owner where it has no
    record; a record made meanwhile by another run (two claiming one new tier) is checked too."""
    if not workdir:
        return
    ours, path = owner_of(workdir), os.path.join(directory, OWNER_FILE)
    _agree_owner(directory, _read_owner(path), ours)
    _agree_started(directory, workdir)
    # Once more, for a record another run linked in between (on every process, as a collective)
    _agree_owner(directory, _read_owner(path) if _record(path, ours) is False else None, ours)


def _agree_owner(directory: str, theirs: str | None, ours: str) -> None:
    """Refuses, on every process, when some process's tier records another workdir."""
    failed = failed_processes(theirs in (None, ours))
    if not failed:
        return
    texts = gather_texts(f"{directory} belongs to {theirs}" if theirs not in (None, ours) else "")
    raise EveryProcessError(paragraph(
        f"checkpoint.local_dir holds another run's local tier, on {_where(failed, texts)};",
        f"this run's workdir is {ours}. Its steps would be restored into this run as its own",
        "(a fresh workdir resumes from the local tier's newest step), and this run's saves",
        "would delete them. Give this run a local_dir of its own (e.g. /ssd/tier-RUN-{process}),",
        "or delete that directory if that run is over and its local steps are no longer",
        f"needed (if the workdir was only renamed, delete its {OWNER_FILE}). Nothing was",
        "restored or deleted."))


def _agree_started(directory: str, workdir: str) -> None:
    """Refuses, on every process, local steps in a tier whose workdir holds no earlier start of
    its run: every start writes config.json before its first step, so such steps are of a run
    whose workdir was deleted or emptied (or of a tier made before owner records), and a
    fresh start would silently continue that run instead."""
    started = broadcast_json(_has_started(workdir) if jax.process_index() == 0 else None, 0)
    steps = sorted(int(n) for n in os.listdir(directory) if n.isdigit())
    failed = failed_processes(started or not steps)
    if not failed:
        return
    texts = gather_texts(f"{directory} holds step {steps[-1]}" if steps else "")
    raise EveryProcessError(paragraph(
        "checkpoint.local_dir holds the local steps of an earlier run, on",
        f"{_where(failed, texts)}, but --workdir={workdir} holds no start of one (no",
        "config.json: it is new, or was deleted or emptied). This run would resume from those",
        "steps, continuing that earlier run instead of starting afresh. Delete that directory",
        "to start afresh, give this run another local_dir, or bring back the workdir the steps",
        "belong to. Nothing was restored or deleted."))


def _has_started(workdir: str) -> bool:
    """Whether `workdir` holds config.json (every start writes it before its first step); a
    workdir that cannot be read counts as started: the run's own reads report it."""
    try:
        return workdir_files.read_bytes(locations.join(workdir, "config.json")) is not None
    except (ValueError, OSError):  # JaxscaleError (an outage past the retry budget), tensorstore
        return True


def _read_owner(path: str) -> str | None:
    """The workdir a tier's record names (None: the tier has no record)."""
    if not os.path.lexists(path):
        return None
    try:
        with open(path) as f:
            return str(json.load(f)["workdir"])
    except (OSError, ValueError, KeyError, TypeError):
        return f"an unreadable owner record, {path}"


def _record(path: str, ours: str) -> bool | None:
    """Whether `ours` became the tier's record (False: a record exists): written whole beside
    it, then linked in place only if no record exists yet (two runs claiming one new tier at
    once: one wins). None: no record could be written (a full disk), which leaves the tier
    unclaimed, with a warning."""
    if os.path.lexists(path):
        return False
    staged = f"{path}.{os.getpid()}.tmp"
    try:
        with open(staged, "w") as f:
            json.dump({"workdir": ours}, f)
        os.link(staged, path)
        return True
    except FileExistsError:
        return False
    except OSError as e:
        log.warning("could not record this run as the owner of its local tier (%s: %s)",
                    e.strerror, e.filename)
        return None
    finally:
        with contextlib.suppress(OSError):
            os.remove(staged)


def check_not_shared(directory: str) -> None:
    """Refuses, on every process, a local tier that another process of this run also uses (a
    `checkpoint.local_dir` without {process} for processes sharing a machine): their steps
    would overwrite each other's. Each process leaves a marker named after this run's nonce
    (from process 0) and its index, and looks for the others' after a barrier."""
    if jax.process_count() == 1:
        return
    from jax.experimental import multihost_utils
    nonce = int(multihost_utils.broadcast_one_to_all(
        np.int32(int.from_bytes(os.urandom(3), "little"))))
    mine = os.path.join(directory, f".jaxscale-tier-{nonce}-{jax.process_index()}")
    with open(mine, "w"):
        pass
    multihost_utils.sync_global_devices("jaxscale-local-tier-markers")
    others = [n for n in os.listdir(directory)
              if n.startswith(f".jaxscale-tier-{nonce}-") and os.path.join(directory, n) != mine]
    shared = not all_agree(not others)
    multihost_utils.sync_global_devices("jaxscale-local-tier-checked")
    os.remove(mine)
    if shared:
        raise EveryProcessError(paragraph(
            "checkpoint.local_dir: processes of this run share a local tier directory",
            f"({directory} here): their saves would overwrite each other's. Put {{process}} in",
            "checkpoint.local_dir (e.g. /ssd/tier-{process}) so that each process has its own."))


def _where(failed: list[int], texts: list[str]) -> str:
    """'this process (TEXT)' or 'process 1 (TEXT); process 3 (TEXT)'."""
    return "; ".join(f"{'this process' if jax.process_count() == 1 else f'process {p}'} "
                     f"({texts[p]})" for p in failed)
