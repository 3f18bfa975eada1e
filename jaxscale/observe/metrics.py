"""Metrics: metrics.jsonl and model FLOPs utilisation (the progress line is in
`jaxscale.observe.progress`, TensorBoard in `jaxscale.observe.loggers`, peak FLOP/s in
`jaxscale.hardware`, each model's FLOPs per token in its model table entry).

`metrics.jsonl` is the source of truth (tests, `launch.plot` and resume all read it); TensorBoard
is a convenience view of the same numbers. Only process 0 writes (`enabled=False` elsewhere), so
a multi-host run produces one file, not one per host.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

from jaxscale.hardware import peak_flops
from jaxscale.storage import locations, workdir_files


def mfu(flops_per_token: float, tokens_per_s: float, num_devices: int,
        device_kind: str) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' combined peak.

    `tokens_per_s` is the global throughput (all devices), hence the `num_devices` factor in the
    peak. None when the device kind has no known peak (CPU), so callers can simply skip it.
    """
    peak = peak_flops(device_kind)
    if peak is None or num_devices <= 0:
        return None
    return flops_per_token * tokens_per_s / (peak * num_devices)


def model_flops_per_token(model: Any, seq_len: int) -> float | None:
    """Training FLOPs per token of a `config.model` section, as its model table entry counts
    them (`jaxscale.models.MODELS`); None for a model without a count, so no MFU is logged
    rather than a wrong one."""
    from jaxscale.models import entry_of  # lazy: importing the models pulls in jax

    count = entry_of(model).flops_per_token
    return None if count is None else count(model, seq_len)


def _plain(value: Any) -> Any:
    """A JSON-safe scalar: numpy/jax scalars become Python numbers, non-finite floats null.

    Python's json would write NaN/Infinity, which is not valid JSON and breaks other readers
    (jq, pandas with strict parsers); null says "no finite value" and stays parseable.
    """
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class MetricsWriter:
    """Appends one JSON object per `write` to WORKDIR/metrics.jsonl.

    Line format: `{"step": <int>, "<name>": <float|int|null>, ...}` with `step` first, metrics in
    the order given, and non-finite floats written as null. Each line is flushed at once so a
    killed process leaves only complete lines. On gs:// / s3:// (no append) the whole file is
    rewritten as one object per write, so a reader sees every line up to the last write.
    Disabled (non-primary processes) it does nothing.
    """

    def __init__(self, workdir: str | None, enabled: bool = True):
        self.enabled = bool(enabled and workdir)
        self.path = locations.join(workdir, "metrics.jsonl") if workdir else None
        self._log = workdir_files.LineLog(self.path) if self.enabled else None

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Logs `metrics` at `step` (numpy/jax scalars accepted)."""
        if not self.enabled:
            return
        record = {"step": int(step), **{k: _plain(v) for k, v in metrics.items()}}
        self._log.append(json.dumps(record) + "\n")

    def truncate_after(self, step: int) -> None:
        """Drops lines with step > `step`, so a run resumed from the checkpoint at `step`
        re-logs those steps and ends with the same file as an uninterrupted run."""
        if not self.enabled:
            return
        kept = [r for r in read_metrics_file(self.path) if r["step"] <= step]
        self._log.replace("".join(json.dumps(r) + "\n" for r in kept))

    def close(self) -> None:
        if self.enabled:
            self._log.close()


def read_metrics_file(path: str) -> list[dict]:
    """Parses a metrics.jsonl (a local path, gs:// or s3://); a missing file is empty and an
    unparseable last line (a write cut short by a crash on a filesystem without line-atomic
    appends) is ignored."""
    text = workdir_files.read_text(path)
    if text is None:
        return []
    lines = [line for line in text.splitlines() if line.strip()]
    records = []
    for i, line in enumerate(lines):
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if i != len(lines) - 1:
                raise ValueError(f"{path}: line {i + 1} is not valid JSON: {line[:80]!r}. "
                                 "Only the last line may be cut short; fix or delete the file."
                                 ) from None
    return records


def read_metrics(workdir: str) -> list[dict]:
    """All records of WORKDIR/metrics.jsonl, in file order."""
    return read_metrics_file(locations.join(workdir, "metrics.jsonl"))
