"""One training run per workdir: the run holds the workdir's lock from before it writes or
deletes anything there (its event log, config.json, the sweep of unfinished saves in
`checkpoints/` and the local tier) until it ends.

Why: two runs on one workdir overwrite each other's checkpoints, metrics.jsonl and
config.json, and the start of a run deletes the unfinished orbax steps it finds
(`storage.orbax_paths.remove_unfinished`), which would be the other run's save in flight. A
second `jaxscale train` on a workdir in use is refused in one paragraph naming the holder
(host, pid, start, command). Readers (evaluate, generate, export, convert, the Lo-Fi
averager) take no lock.

A local workdir: `WORKDIR/run.lock` holds a POSIX record lock (`fcntl.lockf`), which the
kernel drops when its process dies, SIGKILL included, and which a forked child does not
inherit, so a killed run leaves no stale lock and its rerun starts at once. The file records
the holder as JSON, written once the lock is held; it is never deleted (a deletion races with
a run opening it). POSIX drops a process's lock when that process closes ANY descriptor of the
file: the process-wide `_HELD` table keeps one descriptor per lock, and a second acquisition
in the same process only counts up (never a deadlock, never a silent release).

A bucket workdir (gs://, s3://): the key `WORKDIR/run.lease`, a lease (`storage.lease`)
written create-if-absent and renewed by a daemon thread. A lease not renewed for `lease_s`
(a holder that died) is taken over by compare-and-swap, at once if its holder was on this host
and its pid is gone; release deletes it if it is still ours.

Several processes: only process 0 writes the persistent workdir, so only it takes the lock;
its verdict is broadcast, and every process raises the same refusal (`hold`) rather than
waiting for process 0 at a later barrier.
"""

from __future__ import annotations

import datetime
import errno
import fcntl
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import jax

from jaxscale.errors import EveryProcessError, JaxscaleError, paragraph, short_error
from jaxscale.storage import lease, locations
from jaxscale.storage.retry import for_workdir
from jaxscale.train.local_faults import broadcast_json
from jaxscale.weights.kv import Store

log = logging.getLogger("jaxscale.train")
LOCK_FILE = "run.lock"
LEASE_KEY = "run.lease"


class WorkdirInUse(EveryProcessError):
    """Another run holds the workdir (or its lock could not be taken): raised on every
    process of the run, by agreement."""


@dataclass
class _Held:
    """One lock this process holds: a local file's descriptor, or a lease and its renewal."""

    count: int
    fd: int | None = None
    store: Any = None
    token: str = ""
    renewal: lease.Renewal | None = None
    created: tuple[str, ...] = ()  # the directories taking the lock made, deepest first


_HELD: dict[str, _Held] = {}  # lock file's real path / lease location -> what is held
_TABLE = threading.Lock()


class WorkdirLock:
    """This process's hold on a workdir (a no-op one for a process that takes none);
    `release()` is idempotent."""

    def __init__(self, key: str | None):
        self.key = key

    def release(self) -> None:
        self._release(abandon=False)

    def abandon(self) -> None:
        """Releases the lock of a run that ends before it wrote anything (its build failed):
        a workdir that taking the lock created is removed again, so that a refused run leaves
        no directory behind; an existing workdir keeps its run.lock."""
        self._release(abandon=True)

    def _release(self, abandon: bool) -> None:
        key, self.key = self.key, None
        if key is None:
            return
        with _TABLE:  # held throughout: a new hold of this file must not meet our close
            held = _HELD[key]
            held.count -= 1
            if held.count:
                return
            del _HELD[key]
            try:
                if held.fd is not None:  # unlock; the file stays (a waiter may open it), but
                    # that of a workdir an abandoned run made goes, unlinked while still held
                    if abandon and held.created:
                        _unlink_while_held(key, held.created)
                    fcntl.lockf(held.fd, fcntl.LOCK_UN)
                    os.close(held.fd)
                    if abandon:
                        _remove_empty(held.created)
                else:
                    held.renewal.stop()
                    lease.release(held.store, LEASE_KEY, held.token)
            except Exception as e:  # the run's own end (or error) matters more than this
                log.warning("releasing the workdir lock %s failed: %s", key, short_error(e))


def holder_fields() -> dict:
    """What a lock records of its holder: host, pid, start time, command."""
    argv = getattr(sys, "orig_argv", sys.argv)  # `python -m jaxscale train ...` as typed
    return {"host": socket.gethostname(), "pid": os.getpid(), "started": time.time(),
            "command": " ".join([os.path.basename(argv[0]), *argv[1:]])[:300]}


def refusal(workdir: str, held_by: dict) -> str:
    """The one paragraph a run refused a workdir in use prints."""
    return paragraph(
        f"--workdir={workdir} is in use by another training run: {describe(held_by)}.",
        "Two runs on one workdir overwrite each other's checkpoints, metrics.jsonl and",
        "config.json, and the start of a run deletes the unfinished checkpoint saves it finds,",
        "which would be the other run's save in flight. Wait for that run to end or stop it,",
        "or pass another --workdir. Nothing was written.")


def describe(held_by: dict) -> str:
    """'pid P on host H, started T UTC (command: C)' from a lock's record."""
    if not held_by.get("pid"):
        return "its holder has not recorded itself yet (it is starting)"
    try:
        started = datetime.datetime.fromtimestamp(float(held_by["started"]), datetime.UTC)
        when = f", started {started:%Y-%m-%d %H:%M:%S} UTC"
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        when = ""
    command = " ".join(str(held_by.get("command") or "").split())  # one line, as the error
    command = f" (command: {command[:160]}{'...' if len(command) > 160 else ''})" if command else ""
    return f"pid {held_by['pid']} on host {held_by.get('host', '?')}{when}{command}"


def acquire(workdir: str, lease_s: float = lease.DEFAULT_LEASE_S) -> WorkdirLock:
    """Takes `workdir`'s lock for this process (WorkdirInUse if another process holds it); a
    memory:// workdir (one process's own) takes none."""
    loc = locations.parse(workdir)
    if loc.scheme == "memory":
        return WorkdirLock(None)
    key = os.path.realpath(os.path.join(loc.path, LOCK_FILE)) if not loc.remote else loc.url()
    with _TABLE:
        if key in _HELD:  # this process holds it already: count up
            _HELD[key].count += 1
            return WorkdirLock(key)
        held = _lock_file(workdir, key) if not loc.remote else _take_lease(workdir, lease_s)
        _HELD[key] = held
    return WorkdirLock(key)


def _missing_dirs(directory: str) -> tuple[str, ...]:
    """`directory` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while directory and not os.path.lexists(directory):
        missing.append(directory)
        parent = os.path.dirname(directory)
        directory = "" if parent == directory else parent
    return tuple(missing)


def _unlink_while_held(path: str, created: tuple[str, ...]) -> None:
    """Deletes the lock file of a workdir this run created and wrote nothing to, while the lock
    is still held: a run that opened the file before is refused by our lock, and one after
    creates a new file, so no two runs ever hold locks at once."""
    if sorted(os.listdir(created[0])) == [LOCK_FILE]:
        os.unlink(path)


def _remove_empty(created: tuple[str, ...]) -> None:
    """Removes the directories taking a lock created, deepest first, while they are empty."""
    for directory in created:
        try:
            os.rmdir(directory)
        except OSError:  # not empty (another run's lock file, a user's file): leave it
            return


def _open_lock_file(path: str) -> tuple[int, tuple[str, ...]]:
    """The lock file's descriptor (made with its directories), and the directories made."""
    for _ in range(3):  # an abandoned run may remove the fresh directory between the two
        created = _missing_dirs(os.path.dirname(path))
        locations.make_local_dir(os.path.dirname(path), "--workdir")
        try:
            return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644), created
        except FileNotFoundError:
            continue
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644), ()


def _lock_file(workdir: str, path: str) -> _Held:
    try:
        fd, created = _open_lock_file(path)
    except OSError as e:
        raise WorkdirInUse(paragraph(
            f"--workdir={workdir}: its lock file {path} cannot be opened ({e.strerror}), so",
            "this run cannot keep a second run off the workdir. Give a workdir you may write",
            "to.")) from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        record = os.pread(fd, 4096, 0)
        os.close(fd)  # never held: closing it drops nothing
        if e.errno not in (errno.EACCES, errno.EAGAIN):
            raise WorkdirInUse(paragraph(
                f"--workdir={workdir}: its lock file {path} cannot be locked ({e.strerror});",
                "the file system may not support POSIX locks. Give a workdir on a local disk",
                "or a bucket.")) from None
        raise WorkdirInUse(refusal(workdir, lease.fields(record))) from None
    try:  # the record only names the holder in a refusal: a full disk must not stop the run here
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(holder_fields()).encode(), 0)
    except OSError as e:
        log.warning("could not record this run in %s (%s); it holds the lock", path, e.strerror)
    return _Held(1, fd=fd, created=created)


def _take_lease(workdir: str, lease_s: float) -> _Held:
    store, token = Store(workdir, retry=for_workdir(workdir)), uuid.uuid4().hex
    mine = lease.lease_value(token, **holder_fields())
    value = None
    for _ in range(3):  # a lease released between the write and the read: try again
        if store.write(LEASE_KEY, mine, if_absent=True):
            break
        value, generation = store.read_stamped(LEASE_KEY)
        if value is None:
            continue
        if not _expired(value, lease_s):
            raise WorkdirInUse(refusal(workdir, lease.fields(value)))
        if store.write(LEASE_KEY, mine, if_generation=generation):
            log.warning("taking over %s/%s from %s, which stopped renewing it", workdir,
                        LEASE_KEY, describe(lease.fields(value)))
            break
    else:
        raise WorkdirInUse(refusal(workdir, lease.fields(value)))
    return _Held(1, store=store, token=token,
                 renewal=lease.Renewal(store, LEASE_KEY, token, lease_s).start())


def _expired(value: bytes, lease_s: float) -> bool:
    """A lease not renewed for `lease_s`, or whose holder was a process of this host that is
    gone, or this very process (which holds none now: `acquire` looked in `_HELD` first), a
    lease left by an earlier run in it whose release met an outage."""
    if lease.age(value) >= lease_s:
        return True
    held_by = lease.fields(value)
    pid = held_by.get("pid")
    return held_by.get("host") == socket.gethostname() and (pid == os.getpid() or not _alive(pid))


def _alive(pid: Any) -> bool:
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, TypeError, ValueError, OverflowError):
        return True  # another user's process, or a record we cannot read: assume alive
    return True


def hold(workdir: str, lease_s: float = lease.DEFAULT_LEASE_S) -> WorkdirLock:
    """Takes `workdir`'s lock for a training run (none for no workdir): on process 0 only (the
    one writer of the persistent workdir), every process raising the same `WorkdirInUse` when
    it is refused."""
    if not workdir:
        return WorkdirLock(None)
    if jax.process_count() == 1:
        return acquire(workdir, lease_s)
    lock, refused = WorkdirLock(None), None
    if jax.process_index() == 0:
        try:
            lock = acquire(workdir, lease_s)
        except JaxscaleError as e:
            refused = str(e)
        except Exception as e:  # told to every process too, or they would wait for it
            refused = paragraph(f"--workdir={workdir} could not be locked:", short_error(e))
    refused = broadcast_json(refused, 0)
    if refused is not None:
        raise WorkdirInUse(refused)
    return lock
