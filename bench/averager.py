"""Lo-Fi averager throughput and peak memory vs the disk's raw copy speed, for growing models.

For each model size, N workers push float32 weights to a local store; then, in a fresh process
(so its peak RSS is its own, started with `AVERAGER_ENV` as `launch.lofi_local` starts the
averager), one `mean` round streams them and publishes the average. Two
baselines, measured in the same run on the same files: a raw copy (plain file reads of every
chunk file the round reads, N pushes + the base average, and one synced file write of the
output size) and a "ts copy" (the same bytes through tensorstore's zarr3 driver, which checks
each chunk's crc32c, block by block, with no averaging: the averager's own I/O path, on a local
disk as on object stores). Throughput = (bytes read + bytes written) / seconds for all three, so
the ratios compare like with like; all read the same files in the same cache state (see
`--cache`) and make their output durable (fsync). Targets (issue 6): >= 50% of raw copy speed,
and peak RSS flat in model size.

Two cache states (`--cache`): `warm` reads what the pushes just wrote from the page cache, so
"raw copy" is a memcpy; `cold` writes everything back and evicts the store's files from the
page cache (posix_fadvise DONTNEED, no root needed; file data only, not directory metadata)
before each pass, so every pass reads from the disk, as an averager does when the pushes came
from other machines over a shared filesystem or were written hours earlier. (On a tmpfs there
is no disk: run it where the temporary directory is on one.) The raw copy runs four times, reading
the chunk files with one thread and with 8 (one thread leaves a cold disk idle between 1 MiB
files, while 8 threads slow a memcpy from the page cache), each writing its output through the
page cache and with O_DIRECT (a write into fresh page-cache memory costs 1.2-3 CPU-seconds per
GiB on this project's VM), and the fastest counts: the best a plain copy tool could do. Likewise the
averager's round runs `--repeats` times (the round it published is removed in between) and the
fastest counts, with the highest peak RSS of the repeats: on a shared VM one slow pass says more
about the neighbours than about the code.

    python bench/averager.py [--sizes_mib=64,256,1024] [--workers=4] [--budget_mib=64]
                             [--cache=warm,cold] [--repeats=2]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np

from jaxscale.lofi.job import AVERAGER_ENV  # as launch.lofi_local starts it

LEAF = 1 << 24  # 16M float32 values = 64 MiB per leaf
CRC = 4  # bytes of crc32c at the end of each chunk file

CHILD = """
import json, sys, time
from jaxscale.lofi.averager import AveragerConfig, run_round
from jaxscale.weights.kv import Store
def hwm_mib():  # this process's peak RSS (VmHWM; ru_maxrss would include the parent's pre-exec)
    line = [l for l in open("/proc/self/status") if l.startswith("VmHWM")][0]
    return int(line.split()[1]) / 1024
store = Store(sys.argv[1])
idle = hwm_mib()
t0 = time.perf_counter()
report = run_round(store, AveragerConfig(chunk_budget_bytes=int(sys.argv[2])))
seconds = time.perf_counter() - t0
assert report.published, report.note
print(json.dumps({"seconds": seconds, "read": report.bytes_read, "written": report.bytes_written,
                  "rss_mib": hwm_mib(), "idle_rss_mib": idle}))
"""


def make_store(path: str, size_mib: int, workers: int) -> None:
    from jaxscale.lofi.averager import publish_initial
    from jaxscale.lofi.store import push
    from jaxscale.weights.kv import Store

    store = Store(path)
    n = size_mib * 2**20 // 4
    sizes = [LEAF] * (n // LEAF) + ([n % LEAF] if n % LEAF else [])
    rng = np.random.default_rng(0)
    base = {f"layers_{i}/w": rng.standard_normal(s, np.float32) for i, s in enumerate(sizes)}
    publish_initial(store, base)
    for w in range(workers):
        push(store, w, 10, {k: v + np.float32(0.01 * (w + 1)) for k, v in base.items()}, 100 + w)


def evict(path: str) -> None:
    """Writes back and drops every file under `path` from the page cache: the next read is
    from the disk."""
    os.sync()
    for dirpath, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def aligned_empty(n: int) -> np.ndarray:
    """An uninitialised byte buffer starting on a 4 KiB boundary (O_DIRECT needs it)."""
    raw = np.empty(n + 4096, np.uint8)
    skip = -raw.ctypes.data % 4096
    return raw[skip:skip + n]


def read_file(name: str, aligned: bool = False) -> bytes | np.ndarray:
    """A file's bytes; `aligned`: into a page-aligned buffer, ready for an O_DIRECT write."""
    with open(name, "rb", buffering=0) as f:
        if not aligned:
            return f.read()
        buf = aligned_empty(os.fstat(f.fileno()).st_size)
        got = f.readinto(buf)
        assert got == buf.size, f"short read of {name}"
        return buf


def direct_supported(folder: str) -> bool:
    """Whether files in `folder` can be opened with O_DIRECT (not on every filesystem)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    probe = os.path.join(folder, ".direct_probe")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT))
        return True
    except OSError:
        return False
    finally:
        if os.path.exists(probe):
            os.remove(probe)


def raw_copy(path: str, out: str, threads: int, direct: bool) -> tuple[float, int]:
    """Reads every chunk file of the pushes and round 0 (`threads` readers, in order), writes
    one output of param size (the base's bytes), through the page cache or with O_DIRECT
    (round 0's files read straight into page-aligned buffers, as the averager's output is
    computed into one), and syncs it."""
    files = []
    for sub in ("workers", os.path.join("average", "0")):
        for dirpath, _, names in os.walk(os.path.join(path, sub)):
            files += [os.path.join(dirpath, f) for f in names if "/c/" in dirpath + "/"]
    is_base = [f"{os.sep}average{os.sep}" in f for f in files]
    moved = 0
    t0 = time.perf_counter()
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | (os.O_DIRECT if direct else 0))
    try:
        with ThreadPoolExecutor(threads) as pool:
            for data, base in zip(pool.map(read_file, files, [direct and b for b in is_base]),
                                  is_base):
                moved += len(data)
                if base:  # its values: 1 MiB, aligned for O_DIRECT (the last 4 bytes of a
                    view, done = memoryview(data)[:len(data) - CRC], 0  # chunk file: crc32c)
                    while done < len(view):
                        done += os.write(fd, view[done:])
                    moved += len(view)
        os.fsync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0, moved


def ts_copy(path: str) -> tuple[float, int]:
    """The round's reads and write through tensorstore alone: every pushed leaf and the base,
    block by block, and the base written to a fresh array (fsynced per chunk by tensorstore's
    file kvstore, as the averager's output is)."""
    from jaxscale.lofi.store import worker_pushes
    from jaxscale.weights.kv import Store
    from jaxscale.weights.snapshot import average_prefix, load_snapshot

    store = Store(path)
    ckpts = [load_snapshot(store, average_prefix(0))] + [
        load_snapshot(store, f"workers/{w}/{steps[-1]}")
        for w, steps in worker_pushes(store).items()]
    block, moved = 1 << 20, 0
    t0 = time.perf_counter()
    for leaf, entry in sorted(ckpts[0].leaves.items()):
        size = int(np.prod(entry["shape"]))
        out = store.array(f"scratch_copy/{leaf}", size, entry["dtype"])
        for a in range(0, size, block):
            futures = [store.open_array(f"{c.data}/arrays/{leaf}", size, entry["dtype"],
                                        c.chunk)[a:a + block].read() for c in ckpts]
            values = [np.asarray(f.result()) for f in futures]
            out[a:a + block].write(values[0]).result()
            moved += sum(v.nbytes for v in values) + values[0].nbytes
    return time.perf_counter() - t0, moved


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--sizes_mib", default="64,256,1024")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--budget_mib", type=int, default=64)
    p.add_argument("--cache", default="warm,cold", help="warm, cold or both (see above)")
    p.add_argument("--repeats", type=int, default=2,
                   help="averager rounds per measurement; the fastest counts (see above)")
    p.add_argument("--store", default="",
                   help="s3://bucket/prefix or gs://...: measure on that object store against "
                        "tensorstore copying the same bytes there (endpoint and credentials "
                        "from AWS_ENDPOINT_URL_S3 / AWS_* as everywhere, see jaxscale/storage/locations.py)")
    args = p.parse_args()
    if args.store:
        return main_remote(args)
    caches = args.cache.split(",")
    if not set(caches) <= {"warm", "cold"}:
        raise SystemExit(f"--cache={args.cache}: use warm, cold or warm,cold")
    root = tempfile.mkdtemp(prefix="lofi_avg_bench_")
    rows = []
    try:
        for size in [int(s) for s in args.sizes_mib.split(",")]:
            for cache in caches:  # a fresh store each: the round publishes into it
                rows.append((cache, size, *measure(root, size, cache, args)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"\n{args.workers} workers, float32, mean, chunk budget {args.budget_mib} MiB")
    print(f"{'cache':>5} {'model':>9} {'moved':>9} {'round':>7} {'averager':>10} {'raw copy':>10} "
          f"{'ratio':>6} {'ts copy':>10} {'ratio':>6} {'peak RSS':>9} {'RSS idle':>9}")
    for cache, size, r, avg_gbs, raw_gbs, ts_gbs in sorted(rows, key=lambda row: row[0]):
        moved = (r["read"] + r["written"]) / 2**20
        print(f"{cache:>5} {size:>5} MiB {moved:>5.0f} MiB {r['seconds']:>5.2f} s {avg_gbs:>6.2f} GB/s "
              f"{raw_gbs:>6.2f} GB/s {avg_gbs / raw_gbs:>5.0%} {ts_gbs:>6.2f} GB/s "
              f"{avg_gbs / ts_gbs:>5.0%} {r['rss_mib']:>5.0f} MiB {r['idle_rss_mib']:>5.0f} MiB")


def measure(root: str, size: int, cache: str, args: argparse.Namespace
            ) -> tuple[dict, float, float, float]:
    """One store of `size` MiB: raw copy, ts copy and the averager's round on it, each after
    evicting the store from the page cache when `cache` is cold. Returns (averager report,
    averager GB/s, raw copy GB/s, ts copy GB/s)."""
    path = os.path.join(root, f"s{size}")
    make_store(path, size, args.workers)
    before = evict if cache == "cold" else (lambda _: None)
    copies = []
    for threads, direct in itertools.product((1, 8), (False, True)[:1 + direct_supported(root)]):
        before(path)
        copies.append(raw_copy(path, os.path.join(root, "copy.bin"), threads, direct))
    copy_s, copy_bytes = min(copies)  # the fastest (same bytes)
    before(path)
    ts_s, ts_bytes = ts_copy(path)
    rounds = []
    for attempt in range(args.repeats):
        if attempt:  # the same round again: remove what the previous attempt published
            shutil.rmtree(os.path.join(path, "average", "1"))
            os.remove(os.path.join(path, "commits", "average", "1"))
        before(path)
        out = subprocess.run([sys.executable, "-c", CHILD, path, str(args.budget_mib << 20)],
                             env={**os.environ, "PYTHONPATH": ROOT, **AVERAGER_ENV}, cwd=ROOT,
                             capture_output=True, text=True, check=True)
        rounds.append(json.loads(out.stdout.strip().splitlines()[-1]))
    r = min(rounds, key=lambda round_: round_["seconds"])  # the fastest, like the raw copy's
    r["rss_mib"] = max(round_["rss_mib"] for round_ in rounds)  # but the highest peak RSS
    shutil.rmtree(path)
    return (r, (r["read"] + r["written"]) / r["seconds"] / 1e9, copy_bytes / copy_s / 1e9,
            ts_bytes / ts_s / 1e9)


def main_remote(args: argparse.Namespace) -> None:
    """The object-store variant: per size, a fresh store under `--store`, the tensorstore copy
    of the round's bytes on the same server, then the averager's round(s) in a fresh process.
    No page cache to evict and no raw copy (there is no file to memcpy): the bar is the ts copy."""
    from jaxscale.storage import locations as storage
    from jaxscale.weights.kv import Store
    from jaxscale.weights.snapshot import average_prefix, commit_key

    storage.check(args.store)
    print(f"\n{args.workers} workers, float32, mean, chunk budget {args.budget_mib} MiB, "
          f"store {args.store} at {storage.s3_endpoint() or 'the provider'}")
    print(f"{'model':>9} {'moved':>9} {'round':>7} {'averager':>10} {'ts copy':>10} "
          f"{'ratio':>6} {'peak RSS':>9} {'RSS idle':>9}")
    for size in [int(s) for s in args.sizes_mib.split(",")]:
        location = storage.join(args.store, f"s{size}-{os.getpid()}")
        make_store(location, size, args.workers)
        ts_s, ts_bytes = ts_copy(location)
        rounds = []
        for attempt in range(args.repeats):
            if attempt:  # the same round again: remove what the previous attempt published
                store = Store(location)
                store.delete(commit_key(average_prefix(1)))
                store.delete_prefix(average_prefix(1))
            out = subprocess.run([sys.executable, "-c", CHILD, location,
                                  str(args.budget_mib << 20)], env={**os.environ,
                                  "PYTHONPATH": ROOT}, cwd=ROOT, capture_output=True,
                                 text=True, check=True)
            rounds.append(json.loads(out.stdout.strip().splitlines()[-1]))
        r = min(rounds, key=lambda round_: round_["seconds"])
        r["rss_mib"] = max(round_["rss_mib"] for round_ in rounds)
        import tensorstore as ts

        Store(location).kv.delete_range(ts.KvStore.KeyRange()).result()  # the whole run
        avg_gbs = (r["read"] + r["written"]) / r["seconds"] / 1e9
        ts_gbs = ts_bytes / ts_s / 1e9
        print(f"{size:>5} MiB {(r['read'] + r['written']) / 2**20:>5.0f} MiB "
              f"{r['seconds']:>5.2f} s {avg_gbs:>6.2f} GB/s {ts_gbs:>6.2f} GB/s "
              f"{avg_gbs / ts_gbs:>5.0%} {r['rss_mib']:>5.0f} MiB {r['idle_rss_mib']:>5.0f} MiB",
              flush=True)


if __name__ == "__main__":
    main()
