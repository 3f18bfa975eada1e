"""Loss curves of one or more runs on one figure, read from each run's metrics.jsonl."""

from __future__ import annotations

import os
from collections.abc import Sequence

from jaxscale.observe.metrics import read_metrics


def _series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a finite `key` (null marks non-finite)."""
    pairs = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def plot_runs(workdirs: Sequence[str], out: str, labels: Sequence[str] | None = None) -> str:
    """Draws train loss (solid) and eval loss (dashed, dots) vs step, one colour per run.

    Labels default to the workdir names. Returns the path written (`out`, plus ".png" if it has
    no extension). Raises ValueError naming the workdir when a run has no metrics.jsonl, since
    an empty curve would silently hide the mistake.
    """
    import matplotlib
    matplotlib.use("Agg")  # no display on servers / CI
    import matplotlib.pyplot as plt

    labels = list(labels) if labels else [os.path.basename(os.path.normpath(w)) for w in workdirs]
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (workdir, label) in enumerate(zip(workdirs, labels)):
        records = read_metrics(workdir)
        if not records:
            plt.close(fig)
            raise ValueError(f"{workdir}/metrics.jsonl is missing or empty: nothing to plot. "
                             "Pass the --workdir of a run that has logged at least one step.")
        color = f"C{i % 10}"
        steps, loss = _series(records, "loss")
        ax.plot(steps, loss, color=color, label=f"{label} train")
        steps, loss = _series(records, "eval_loss")
        if steps:
            ax.plot(steps, loss, color=color, linestyle="--", marker="o", markersize=3,
                    label=f"{label} eval")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    if not os.path.splitext(out)[1]:  # what matplotlib would write: say so, not `out`
        out += ".png"
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
