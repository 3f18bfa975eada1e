"""Loggers: loop hooks that receive each logged step's metrics, chosen by name in the config.

`config.train.loggers` lists built-in loggers by name (`LOGGERS`: `jsonl`, `tensorboard`,
`wandb`); any other logger is a hook passed to `train(config, workdir, hooks=[...])`. A hook
that defines `on_metrics(info)` is called on every logged step with a `jaxscale.train.hooks.
StepInfo` whose `metrics` are the numbers `metrics.jsonl` gets (host floats; null-able).
`Logger` is a convenience base class whose other hook methods do nothing, so a custom logger
only writes `on_metrics`. Hooks are called on every process; the built-in loggers write on
process 0 only (`trainer.is_primary`, read when they are built).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

from jaxscale.errors import ConfigError, paragraph
from jaxscale.observe.metrics import MetricsWriter
from jaxscale.storage.diskfull import file_full_error, is_disk_full, naming_a_full_disk
from jaxscale.storage.locations import is_remote
from jaxscale.storage.workdir_files import TensorBoardMirror


class Logger:
    """Base class of loggers: override `on_metrics` (and `close` to flush at the end)."""

    order = 0  # loggers run before the other hooks (jaxscale.train.hooks.ORDER["logger"])

    def on_metrics(self, info: Any) -> None:
        """Called on every logged step (`config.train.log_every`) with a `StepInfo`:
        `info.step` and that step's `info.metrics`."""

    def close(self) -> None:
        """Called once at the end of the run, or when it stops for a pre-emption."""

    def after_step(self, info: Any) -> None:
        return None

    def at_end(self, info: Any) -> None:
        self.close()

    def at_preemption(self, info: Any) -> None:
        self.close()


class JsonlLogger(Logger):
    """WORKDIR/metrics.jsonl (`metrics.MetricsWriter`): on resume, lines after the restored
    step are dropped first, so the file ends as an uninterrupted run's would."""

    def __init__(self, trainer: Any, start_step: int):
        self.writer = MetricsWriter(trainer.workdir, enabled=trainer.is_primary)
        self.writer.truncate_after(start_step)

    def on_metrics(self, info: Any) -> None:
        self.writer.write(info.step, info.metrics)

    def close(self) -> None:
        self.writer.close()


# What tensorboardX imports only for what jaxscale never asks of it: torch to name
# `torch.Tensor` in type hints (over a second of CPU where torch is installed, the `parity`
# extra), boto3 and google-cloud-storage to register its own s3:// and gs:// writers (about 0.4 s;
# jaxscale writes the events to a local mirror and uploads them itself).
_UNUSED_BY_TENSORBOARDX = ("torch", "boto3", "google.cloud.storage")


class _RefusedInThisThread:
    """A meta-path finder that refuses `names` (and their submodules) to the thread that made
    it (`summary_writer`); other threads import them as usual."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names
        self.thread = threading.get_ident()

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        refused = any(name == n or name.startswith(n + ".") for n in self.names)
        if refused and threading.get_ident() == self.thread:
            raise ModuleNotFoundError(f"{name} is not imported for tensorboardX", name=name)
        return None


def summary_writer(logdir: str, purge_step: int | None) -> Any:
    """A tensorboardX `SummaryWriter`, its first import made with what it would import for
    nothing (`_UNUSED_BY_TENSORBOARDX`) refused to this thread only: this thread imports them
    as usual afterwards, and one already imported is tensorboardX's to use."""
    finder = _RefusedInThisThread(tuple(n for n in _UNUSED_BY_TENSORBOARDX
                                        if n not in sys.modules))
    if "tensorboardX" not in sys.modules and finder.names:
        sys.meta_path.insert(0, finder)
    try:
        from tensorboardX import SummaryWriter
    finally:
        if finder in sys.meta_path:
            sys.meta_path.remove(finder)
    return SummaryWriter(logdir, purge_step=purge_step)


class TensorBoardLogger(Logger):
    """Scalars in WORKDIR/tensorboard/ (tensorboardX); events after the restored step of a
    resumed run are purged (`purge_step`). On gs:// / s3:// the events are written to a local
    mirror and uploaded (`workdir_files.TensorBoardMirror`)."""

    def __init__(self, trainer: Any, start_step: int):
        self._tb = None
        if trainer.is_primary and trainer.workdir:
            self._mirror = TensorBoardMirror(trainer.workdir)
            self._tb = summary_writer(self._mirror.local, start_step + 1)

    def on_metrics(self, info: Any) -> None:
        if self._tb is None:
            return
        for k, v in info.metrics.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                self._tb.add_scalar(k, float(v), int(info.step))
        with naming_a_full_disk(self._mirror.local):  # the loop then stops the run
            self._tb.flush()
        self._mirror.sync()

    def close(self) -> None:
        if self._tb is not None:
            tb, self._tb = self._tb, None
            try:
                tb.close()
            except OSError as e:
                if not is_disk_full(e):
                    raise
                _drop_unwritable_events(tb)
                raise file_full_error(self._mirror.local) from None
            self._mirror.close()


class _Discarded:
    """An event file that takes and keeps nothing (`_drop_unwritable_events`)."""

    def write(self, data: bytes) -> None:
        return None

    def flush(self) -> None:
        return None

    def close(self) -> None:
        return None


def _drop_unwritable_events(tb: Any) -> None:
    """Closes a tensorboardX writer whose buffered events a full disk refused. Its close()
    flushes first and gives up at the error, leaving its writer thread running and its atexit
    hook to fail the same way: tracebacks at exit (the thread's through multiprocessing's
    queue), after the run's one-paragraph error. The events are dropped instead (TensorBoard is a
    view of metrics.jsonl): the file's descriptor is pointed at /dev/null, so that its buffer
    drains there, and the writer is closed over a file that keeps nothing. Checked against
    tensorboardX 2.6 (`FileWriter.event_writer`, `EventFileWriter._ev_writer`,
    `EventsWriter._py_recordio_writer`, `RecordWriter._writer`)."""
    for file_writer in list(getattr(tb, "all_writers", {}).values()):
        try:
            events = file_writer.event_writer
            record = events._ev_writer._py_recordio_writer
            record._writer  # noqa: B018 (another tensorboardX: its exit prints what it may)
        except AttributeError:
            return
        if hasattr(record._writer, "fileno"):
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, record._writer.fileno())
            finally:
                os.close(null)
            record._writer.close()
        record._writer = _Discarded()
        events.close()


WANDB_MISSING = paragraph(
    "config.train.loggers names 'wandb', but the wandb package is not installed. Install it",
    "with `pip install 'jaxscale[wandb]'` (or `pip install wandb`) and log in (`wandb login`,",
    "or set WANDB_API_KEY; WANDB_MODE=offline logs locally), or drop 'wandb' from",
    "config.train.loggers, e.g. \"--config.train.loggers=('jsonl', 'tensorboard')\".",
)


class WandbLogger(Logger):
    """Weights & Biases: the resolved config once, then every logged step's metrics. The run id
    is derived from the workdir, so a resumed run (after a pre-emption) continues the same W&B
    run. Project from WANDB_PROJECT (default 'jaxscale'); other settings from wandb's own
    environment variables."""

    def __init__(self, trainer: Any, start_step: int):
        self.run = None
        if not trainer.is_primary:
            return
        if importlib.util.find_spec("wandb") is None:
            raise ConfigError(WANDB_MISSING)
        import wandb
        remote = bool(trainer.workdir) and is_remote(trainer.workdir)
        workdir = trainer.workdir.rstrip("/") if remote else os.path.abspath(
            trainer.workdir or "jaxscale")
        run_id = hashlib.sha256(workdir.encode()).hexdigest()[:16]
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jaxscale"),
                              name=os.path.basename(workdir), id=run_id, resume="allow",
                              dir=None if remote else trainer.workdir or None,
                              config=trainer.config.to_dict())

    def on_metrics(self, info: Any) -> None:
        if self.run is not None:
            self.run.log({k: v for k, v in info.metrics.items() if v is not None},
                         step=int(info.step))

    def close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None


# The names `config.train.loggers` accepts: an explicit table, nothing registers itself.
LOGGERS: dict[str, Callable[[Any, int], Logger]] = {
    "jsonl": JsonlLogger,
    "tensorboard": TensorBoardLogger,
    "wandb": WandbLogger,
}


def check_names(names: Sequence[str]) -> None:
    """Raises a one-paragraph ConfigError for an unknown logger name or a missing package,
    before anything is built."""
    for name in names:
        if name not in LOGGERS:
            raise ConfigError(paragraph(
                f"config.train.loggers names {name!r}, which is not a logger. Use any of",
                f"{', '.join(LOGGERS)}, e.g. \"--config.train.loggers=('jsonl', 'wandb')\"; other",
                "loggers are hooks passed to jaxscale.train.loop.train(..., hooks=[...]).",
            ))
    if "wandb" in names and importlib.util.find_spec("wandb") is None:
        raise ConfigError(WANDB_MISSING)


def make_loggers(trainer: Any, start_step: int) -> list[Logger]:
    """The loggers `config.train.loggers` names, opened for a run starting after `start_step`."""
    names = list(trainer.config.train.get("loggers", ("jsonl", "tensorboard")))
    check_names(names)
    return [LOGGERS[name](trainer, start_step) for name in dict.fromkeys(names)]
