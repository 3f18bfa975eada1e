"""Round-four faults of `plan` and `compile` for `make chaos` (issue 44): SIGTERM while plan's
workers compile (exit 75, no worker left, the cache whole), truncated and wrong-shaped cache
entries (a note, compiled again), a cache directory below a file, `compile --out=FILE/x`,
`--hbm_margin` outside [0, 1), and a plan where no candidate fits (non-zero, naming the
closest and what would make it fit). Needs libtpu for the compiling checks (skipped without)."""

from __future__ import annotations

import glob
import json
import os
import signal
import time

from bench.chaos_harness import COMMAND_TIMEOUT_S, JAXSCALE, Proc, Skip, check, one_paragraph, run

PLAN = [*JAXSCALE, "plan", "--topology=v5p:2x2x1", "--top=1"]
STOP_S = 30  # SIGTERM to exit, workers stopped


def _children(pid: int) -> list[int]:
    """The process's descendants (Linux /proc), to see that none outlives it."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for task in glob.glob(f"/proc/{p}/task/*/children"):
            try:
                with open(task) as f:
                    kids = [int(c) for c in f.read().split()]
            except OSError:
                continue
            out += kids
            todo += kids
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


def _need_libtpu() -> None:
    from importlib.util import find_spec
    if find_spec("libtpu") is None:
        raise Skip("libtpu is not installed (`pip install 'jaxscale[tpu]'`)")


def _cache_whole(cache: str) -> list[str]:
    from jaxscale.aot.search import read_cached

    names = sorted(os.listdir(cache)) if os.path.isdir(cache) else []
    stray = [n for n in names if not n.endswith(".json")]
    assert not stray, f"the cache holds partial files: {stray}"
    for name in names:
        assert read_cached(os.path.join(cache, name)) is not None, name
    return names


def plan_sigterm(tmp: str) -> str:
    _need_libtpu()
    cache = os.path.join(tmp, "plan-sigterm-cache")
    p = Proc([*PLAN, "--max_candidates=4", "--workers=2", f"--cache_dir={cache}"])
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(_children(p.proc.pid)) < 2:
        time.sleep(0.2)  # the workers are spawned (a resource tracker, then compilers)
    kids = _children(p.proc.pid)
    assert p.proc.poll() is None and kids, f"plan ended before its workers started: {p.out}"
    time.sleep(3)  # into a compile
    kids = _children(p.proc.pid)
    sent = time.monotonic()
    p.proc.send_signal(signal.SIGTERM)
    status = p.finish(STOP_S + 30)
    took = time.monotonic() - sent
    assert status == 75, f"exit {status}, want 75: {p.out[-600:]}"
    assert "Traceback" not in p.out, p.out[-600:]
    time.sleep(1)
    left = [k for k in kids if _alive(k)]
    assert not left, f"workers {left} still running after the plan exited"
    assert took < STOP_S, f"took {took:.0f} s to stop"
    names = _cache_whole(cache)
    return f"exit 75 in {took:.1f} s, {len(kids)} workers stopped, {len(names)} whole entries"


def plan_bad_cache(tmp: str) -> str:
    _need_libtpu()
    cache = os.path.join(tmp, "plan-cache")
    flags = [*PLAN, "--max_candidates=1", "--workers=1", f"--cache_dir={cache}"]
    status, out = run(flags)
    assert status == 0, f"the first plan failed ({status}): {out[-600:]}"
    names = sorted(glob.glob(os.path.join(cache, "*.json")))
    assert len(names) >= 2, names
    with open(names[0], "r+") as f:
        f.truncate(40)  # truncated mid-write
    with open(names[1], "w") as f:
        json.dump([1, 2], f)  # the wrong shape
    status, out = run(flags)
    assert status == 0, f"exit {status}: {out[-600:]}"
    assert "Traceback" not in out, out[-600:]
    notes = [line for line in out.splitlines() if line.startswith("jaxscale: note: plan cache")]
    assert len(notes) == 2, out[-800:]
    _cache_whole(cache)
    return notes[0][:150]


def plan_no_fit(tmp: str) -> str:
    _need_libtpu()
    status, out = run([*PLAN, "--max_candidates=1", "--workers=1", "--hbm_margin=0.99999999",
                       f"--cache_dir={tmp}/plan-cache"])
    assert status == 2, f"exit {status}, want non-zero (2): {out[-600:]}"
    said = one_paragraph(out)
    assert "No candidate fits. Closest:" in out and "To fit:" in out, out[-800:]
    return said


def refused(cmd: list[str], words: list[str]) -> str:
    status, out = run([*JAXSCALE, *cmd], timeout=COMMAND_TIMEOUT_S)
    assert status == 2, f"exit {status}, want 2: {out[-400:]}"
    said = one_paragraph(out)
    missing = [w for w in words if w not in said]
    assert not missing, f"the error does not name {missing}: {said}"
    return said


def bad_plan_inputs(tmp: str) -> list[tuple[str, list[str], list[str]]]:
    a_file = os.path.join(tmp, "a-file")
    with open(a_file, "w") as f:
        f.write("x")
    topo = "--topology=v5p:2x2x1"
    return [("plan --hbm_margin=-0.1", ["plan", topo, "--hbm_margin=-0.1"], ["--hbm_margin"]),
            ("plan --hbm_margin=1", ["plan", topo, "--hbm_margin=1"], ["--hbm_margin"]),
            ("plan --cache_dir below a file", ["plan", topo, f"--cache_dir={a_file}/cache"],
             ["--cache_dir", "Not a directory"]),
            ("compile --out=FILE/x", ["compile", topo, f"--out={a_file}/x"],
             ["--out", "regular file"]),
            ("compile --save_hlo=FILE/x", ["compile", topo, f"--save_hlo={a_file}/x"],
             ["--save_hlo", "Not a directory"]),
            ("plan --time_budget_s=nan", ["plan", topo, "--time_budget_s=nan",
                                          f"--cache_dir={tmp}/plan-cache"], ["--time_budget_s"])]


def scenario_plan(results, tmp: str) -> None:
    paragraph = "exit 2, one paragraph naming the flag, no traceback"
    for what, cmd, words in bad_plan_inputs(tmp):
        check(results, "plan / compile", what, paragraph, lambda c=cmd, w=words: refused(c, w))
    check(results, "plan / compile", "SIGTERM while the workers compile",
          f"exit 75 within {STOP_S} s, no worker left running, only whole cache entries",
          lambda: plan_sigterm(tmp))
    check(results, "plan / compile", "a truncated and a wrong-shaped cache entry",
          "a one-line note each, compiled again, exit 0", lambda: plan_bad_cache(tmp))
    check(results, "plan / compile", "no candidate fits (--hbm_margin=0.99999999)",
          "exit 2 after the table naming the closest candidate and what would make it fit",
          lambda: plan_no_fit(tmp))


def slow_compile(config_json: str, topology, cache_dir: str) -> dict:
    """A stand-in for `search.compile_cached` that starts writing its entry and never ends (a
    compile of minutes): what a stopped plan must kill and clean up after."""
    with open(os.path.join(cache_dir, f"entry.json.{os.getpid()}.tmp"), "w") as f:
        f.write("{")
    time.sleep(600)
    return {}
