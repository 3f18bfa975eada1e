"""Which Lo-Fi aggregators hold against how many hostile workers (the threat model of docs/lofi.md).

Each of N workers pushes a delta from the previous average; honest deltas are one true update
plus per-worker noise of the same size. f of them are hostile and push one of the attacks
below while claiming 2^61 samples seen (the averager bounds every weight: `trust.py`). For each
aggregator the script prints the error of the round relative to the honest update,
||aggregate - honest mean|| / ||honest mean||, over `--trials` random draws (the worst one).
An aggregator "holds" when that error stays below 1: the round moves less than one honest
update away from where the honest workers alone would take it.

    .venv/bin/python bench/lofi_threat.py [--workers=8] [--dim=4096] [--trials=5]
"""

from __future__ import annotations

import argparse
import os
import sys
import types

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxscale.lofi import aggregate
from jaxscale.lofi.trust import worker_weights

ATTACKS = {
    "x1000": lambda honest, rng: 1000.0 * honest[0],           # one push scaled up
    "flip x10": lambda honest, rng: -10.0 * honest.mean(0),    # the opposite direction
    "noise x100": lambda honest, rng: 100.0 * rng.normal(size=honest.shape[1]) *
    np.abs(honest).mean(),                                      # random garbage
}


def round_error(name: str, n: int, f: int, attack: str, dim: int, rng: np.random.Generator,
                batch: int = 4, step: int = 100) -> float:
    update = rng.normal(size=dim) * 0.01
    honest = update + rng.normal(size=(n - f, dim)) * 0.01
    hostile = np.stack([ATTACKS[attack](honest, rng) for _ in range(f)]) if f else np.empty(
        (0, dim))
    deltas = np.concatenate([honest, hostile]).astype(np.float32)
    claims = [step * batch] * (n - f) + [2**61] * f
    pushes = [types.SimpleNamespace(step=step, manifest={"samples_seen": s}) for s in claims]
    weights = worker_weights(pushes, batch)
    tau = float(np.linalg.norm(honest - honest.mean(0), axis=1).mean())  # the honest spread
    try:
        got = aggregate.AGGREGATORS[name](deltas, weights, trim=0.2, tau=tau)
    except ValueError:  # trimmed_mean refusing a trim that removes nothing
        return float("nan")
    target = honest.mean(0)
    return float(np.linalg.norm(got - target) / np.linalg.norm(target))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--dim", type=int, default=4096)
    parser.add_argument("--trials", type=int, default=5)
    args = parser.parse_args()
    n = args.workers
    print(f"{n} workers, dim {args.dim}, worst of {args.trials} trials; error = ||round - "
          "honest mean|| / ||honest mean|| (holds: < 1); hostile workers claim 2^61 samples")
    header = f"{'attack':<11} {'aggregator':<14}" + "".join(f"{f'f={f}':>9}" for f in
                                                            range(n // 2 + 1))
    print(header + "\n" + "-" * len(header))
    for attack in ATTACKS:
        for name in aggregate.AGGREGATORS:
            row = []
            for f in range(n // 2 + 1):
                errors = [round_error(name, n, f, attack, args.dim, np.random.default_rng(t))
                          for t in range(args.trials)]
                row.append(max(errors))
            print(f"{attack:<11} {name:<14}" + "".join(f"{e:>9.3g}" for e in row))
    print("trimmed_mean trims max(1, floor(0.2 x N)) per side "
          f"(= {max(1, int(0.2 * n))} of {n}); centered_clip's tau = the honest spread")


if __name__ == "__main__":
    main()
