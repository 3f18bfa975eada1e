"""What the Lo-Fi store tests share: synthetic parameters with a leaf larger than the averager's
chunk budget, and a push helper. The `store` fixture (tests/conftest.py) publishes round 0."""

import json
import os
import threading

import numpy as np

from jaxscale.lofi import aggregate
from jaxscale.lofi import store as S
from jaxscale.lofi.averager import AveragerConfig, run_round
from jaxscale.weights import snapshot as W
from jaxscale.weights.kv import Store
from jaxscale.weights.manifest import CHUNK

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIG = CHUNK * 3 + 123  # a leaf spanning several chunks and larger than the test budget
TINY_BUDGET = AveragerConfig(chunk_budget_bytes=1)

# A worker process (python -c KILL_MID_PUSH STORE) SIGKILLed after its first leaf of worker 3's
# step 7 is written: a push with data but no COMMIT.
KILL_MID_PUSH = """
import os, signal, sys, numpy as np
from jaxscale.lofi import store as S
from jaxscale.weights import snapshot as W
real = W._write_leaf
calls = []
def dying(*a, **k):
    calls.append(1)
    if len(calls) == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    return real(*a, **k)
W._write_leaf = dying
S.push(sys.argv[1], 3, 7, {"a": np.ones(10, np.float32), "b": np.ones(5, np.float32)}, 1)
"""


def _params(seed, scale=1.0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {"layers/w": (rng.normal(size=(BIG,)) * scale).astype(dtype).reshape(-1, 1),
            "b": (rng.normal(size=(7,)) * scale).astype(dtype)}


def _push(st, worker, step, params, samples=100):
    return S.push(st, worker, step, params, samples_seen=samples)


def _reference(name, base, pushed, weights, **kw):
    """NumPy reference: the aggregator on whole-model deltas (all leaves concatenated)."""
    leaves = sorted(base)
    flat = lambda p: np.concatenate([p[k].astype(np.float32).ravel() for k in leaves])
    deltas = np.stack([flat(p) - flat(base) for p in pushed])
    new = flat(base) + aggregate.AGGREGATORS[name](deltas, weights, **kw)
    out, start = {}, 0
    for k in leaves:
        out[k] = new[start:start + base[k].size].reshape(base[k].shape)
        start += base[k].size
    return out


def tamper(st, prefix, edit) -> None:
    """Edits the committed manifest at `prefix` in place and re-signs COMMIT: what an attacker
    with write access to the store could do (chunk checksums cannot stop it; validation must)."""
    relative = f"{W.committed_data(st, prefix)}/manifest.json"
    manifest = json.loads(st.read(f"{prefix}/{relative}"))
    edit(manifest)
    data = json.dumps(manifest, sort_keys=True).encode()
    st.kv.write(f"{prefix}/{relative}", data).result()
    st.kv.write(W.commit_key(prefix), f"{W._sha(data)} {relative}".encode()).result()


def uncommit(st, prefix) -> None:
    """Removes the COMMIT of `prefix`: a writer killed after its data, before its marker."""
    st.delete(W.commit_key(prefix))


def data_dir(st, prefix) -> str:
    """Where the committed attempt at `prefix` keeps its arrays."""
    return f"{prefix}/{W.committed_data(st, prefix)}"


def race_two_averagers(location: str, cfg: AveragerConfig) -> list:
    """Two averagers, each with its own Store, start the same round at once; their reports."""
    barrier, reports = threading.Barrier(2), []

    def averager():
        barrier.wait()
        reports.append(run_round(Store(location), cfg))

    threads = [threading.Thread(target=averager) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return reports
