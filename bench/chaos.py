"""Fault injection before a release: `make chaos` (or `python bench/chaos.py`), docs/faults.md.

Real processes, real faults: `jaxscale train` killed with SIGKILL at seeded random points (local
disk and `s3://` on a SeaweedFS server of tests/servers.py), that server killed and restarted
mid-run, SIGTERM at every phase, a full tmpfs, a table of bad inputs for every subcommand, and
hostile Hugging Face directories and convert targets (bench/chaos_hf.py).
Each check states its invariant and is bounded in time; the script prints one table (scenario,
what was injected, invariant, result, time) and exits 1 if any invariant failed. Slow (many
minutes on 2 cores), so not part of `make test`; tests/test_chaos.py keeps it from rotting.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.chaos_bad_input import scenario_bad_inputs
from bench.chaos_harness import (
    ENV,
    JAXSCALE,
    Proc,
    Result,
    Skip,
    check,
    exit_code,
    one_paragraph,
    run,
    table,
)
from bench.chaos_hf import scenario_hostile_hf
from bench.chaos_plan import scenario_plan
from bench.chaos_resume import scenario_resume

STEPS, EVERY = 24, 4
TRAIN = [*JAXSCALE, "train", "--config=tiny_lm:test", f"--config.train.steps={STEPS}",
         "--config.train.log_every=1", "--config.train.eval_every=0",
         f"--config.checkpoint.every={EVERY}"]
SLACK_S = 60  # an outage's end (or its budget) to the run's exit: backoff, a save in flight
PREEMPTED_EXIT = 75


def losses(workdir: str) -> dict[int, float]:
    from jaxscale.observe.metrics import read_metrics

    records = [m for m in read_metrics(workdir) if "loss" in m]
    steps = [m["step"] for m in records]
    assert steps == sorted(set(steps)), f"metrics.jsonl steps repeat or go back: {steps}"
    return {m["step"]: m["loss"] for m in records}


def assert_resumed_equal(workdir: str, want: dict[int, float]) -> None:
    got = losses(workdir)
    bad = [s for s in want if got.get(s) != want[s]]
    assert not bad and len(got) == len(want), (
        f"losses differ from the uninterrupted run at steps {bad[:5]} "
        f"(got {[got.get(s) for s in bad[:3]]}, want {[want[s] for s in bad[:3]]})")


def committed(workdir: str) -> list[int]:
    from jaxscale.storage import locations
    from jaxscale.weights.restore import saved_steps

    return saved_steps(locations.join(workdir, "checkpoints"))


def assert_restorable(workdir: str) -> str:
    """Every checkpoint a restore may pick (every listed step) restores completely."""
    from jaxscale.storage import locations
    from jaxscale.weights.restore import restore_params

    steps = committed(workdir)
    for step in steps:
        assert "params" in restore_params(locations.join(workdir, "checkpoints"), step), step
    return f"committed {steps}"


def reference(tmp: str) -> dict[int, float]:
    workdir = os.path.join(tmp, "reference")
    status, out = run([*TRAIN, f"--workdir={workdir}"])
    assert status == 0, f"the uninterrupted run failed ({status}): {out[-800:]}"
    return losses(workdir)


# ------------------------------------------------------------ 1. kill -9
def kill_points(rng: random.Random, n_step: int, n_save: int) -> list[tuple[str, int, float]]:
    """(kind, step whose log line triggers, delay s): during steps, and right after a save
    step's line (the save of that step is then in flight)."""
    steps = [("step", rng.randrange(1, STEPS - 1), rng.uniform(0, 0.05)) for _ in range(n_step)]
    saves = [("save", EVERY * rng.randrange(1, STEPS // EVERY), rng.uniform(0, 0.3))
             for _ in range(n_save)]
    return steps + saves


def kill9_then_resume(workdir: str, want: dict[int, float], step: int, delay: float,
                      env: dict[str, str] | None = None) -> str:
    cmd = [*TRAIN, f"--workdir={workdir}"]
    p = Proc(cmd, env)
    hit = p.wait_for(lambda out: f"step {step}/{STEPS}" in out)
    time.sleep(delay)
    p.proc.kill()
    status = p.finish()
    if not hit:
        raise AssertionError(f"the run ended ({status}) before step {step}: {p.out[-500:]}")
    found = assert_restorable(workdir)
    status, out = run(cmd, env)
    assert status == 0, f"the rerun failed ({status}): {out[-600:]}"
    assert_resumed_equal(workdir, want)
    return f"{found} after the kill; rerun equal"


def scenario_kill9(results, tmp: str, want, rng: random.Random, seaweed) -> None:
    invariant = "rerun resumes, losses equal; every listed checkpoint restores"
    for i, (kind, step, delay) in enumerate(kill_points(rng, 2, 2)):
        workdir = os.path.join(tmp, f"kill9-{i}")
        check(results, "kill -9 (local)", f"SIGKILL {delay * 1000:.0f} ms after step {step} "
              f"({kind})", invariant, lambda w=workdir, s=step, d=delay:
              kill9_then_resume(w, want, s, d))
    for kind, step, delay in kill_points(rng, 1, 2):
        def body(s=step, d=delay):
            server = seaweed()
            with s3_env(server):
                return kill9_then_resume(f"s3://{server.make_bucket()}/run", want, s, d,
                                         {**ENV, **server.env()})
        check(results, "kill -9 (s3)", f"SIGKILL {delay * 1000:.0f} ms after step {step} "
              f"({kind})", invariant, body)


@contextlib.contextmanager
def s3_env(server):
    """This process's S3 variables point at `server` (for checking checkpoints in-process)."""
    from jaxscale.storage import locations

    saved = dict(os.environ)
    os.environ.update(server.env())
    locations.configure()
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        locations.configure()


# ------------------------------------------------------------ 2. S3 outages
def outage(server, want, seconds: float, retry_s: float) -> str:
    """Kills the server after step 6's line, restarts it `seconds` later (from this thread: the
    server dies with the thread that started it)."""
    workdir = f"s3://{server.make_bucket()}/run"
    env = {**ENV, **server.env()}
    cmd = [*TRAIN, f"--workdir={workdir}", f"--config.storage.retry_s={retry_s}"]
    p = Proc(cmd, env)
    p.wait_for(lambda out: f"step 6/{STEPS}" in out)
    server.kill()
    killed = time.monotonic()
    time.sleep(seconds)
    server.start()
    restarted = time.monotonic()
    status = p.finish()
    ended = time.monotonic()
    back = f"exit {ended - restarted:.0f} s after the restart"
    with s3_env(server):
        if seconds < retry_s:
            assert status == 0, f"did not ride out a {seconds:.0f} s outage ({status}): " \
                                f"{p.out[-600:]}"
            assert "Traceback" not in p.out, p.out[-600:]
            assert ended - restarted < SLACK_S, f"{back}, want < {SLACK_S} s"
            assert_resumed_equal(workdir, want)
            return f"rode it out, {back}; {assert_restorable(workdir)}"
        assert status == 2, f"exit {status}, want 2: {p.out[-600:]}"
        said = one_paragraph(p.out)
        assert ended - killed < retry_s + SLACK_S, (
            f"stopped {ended - killed:.0f} s after the outage began, budget {retry_s} s: {said}")
        status, out = run(cmd, env)
        assert status == 0, f"the rerun failed ({status}): {out[-600:]}"
        assert_resumed_equal(workdir, want)
        return f"stopped ({back}): {said}; rerun equal"


def scenario_outage(results, want, seaweed) -> None:
    invariant = "rides it out with equal losses if retry_s covers it, else one paragraph " \
                "(exit 2) and the rerun resumes with equal losses"
    for seconds, retry_s in ((3, 120), (45, 120), (20, 5)):
        check(results, "S3 outage", f"SeaweedFS killed {seconds} s after step 6, "
              f"retry_s={retry_s}", invariant,
              lambda s=seconds, r=retry_s: outage(seaweed(), want, s, r))


# ------------------------------------------------------------ 3. SIGTERM
def in_save(workdir: str) -> Callable[[str], bool]:
    """True once orbax's temporary step directory exists, or at step 12's line (a save step)."""
    root = os.path.join(workdir, "checkpoints")

    def ready(out: str) -> bool:
        with contextlib.suppress(OSError):
            if any(not n.isdigit() for n in os.listdir(root)):
                return True
        return f"step 12/{STEPS}" in out
    return ready


def sigterm_phases(workdir: str) -> dict[str, Callable[[str], bool]]:
    return {"start-up (before compile)":
            lambda out: os.path.exists(os.path.join(workdir, "events.jsonl")),
            "compile": lambda out: "jaxscale: mesh " in out,
            "a step": lambda out: f"step 9/{STEPS}" in out,
            "a save": in_save(workdir)}


def sigterm_then_resume(workdir: str, want, ready: Callable[[str], bool]) -> str:
    cmd = [*TRAIN, f"--workdir={workdir}"]
    p = Proc(cmd)
    assert p.wait_for(ready), f"the run ended before the phase: {p.out[-500:]}"
    before = set(committed(workdir)) if os.path.isdir(workdir) else set()
    p.proc.send_signal(signal.SIGTERM)
    status = p.finish()
    assert status == PREEMPTED_EXIT, f"exit {status}, want {PREEMPTED_EXIT}: {p.out[-600:]}"
    assert "Traceback" not in p.out, p.out[-600:]
    after = set(committed(workdir)) if os.path.isdir(workdir) else set()
    assert before <= after, f"committed {sorted(before)} before, {sorted(after)} after"
    assert_restorable(workdir)
    status, out = run(cmd)
    assert status == 0, f"the rerun failed ({status}): {out[-600:]}"
    assert_resumed_equal(workdir, want)
    return f"exit 75 with {sorted(after)} committed; rerun equal"


def scenario_sigterm(results, tmp: str, want) -> None:
    invariant = "exit 75, nothing committed lost, rerun resumes with equal losses"
    for i, phase in enumerate(sigterm_phases("")):
        workdir = os.path.join(tmp, f"sigterm-{i}")
        check(results, "SIGTERM", f"during {phase}", invariant,
              lambda w=workdir, ph=phase: sigterm_then_resume(w, want, sigterm_phases(w)[ph]))


# ------------------------------------------------------------ 4. a full disk
def full_disk(tmp: str) -> str:
    mount = os.path.join(tmp, "small-disk")
    os.makedirs(mount)
    if os.geteuid() != 0 or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", mount],
            capture_output=True).returncode != 0:
        raise Skip("cannot mount a 3 MiB tmpfs here (needs root and mount rights)")
    try:
        workdir = os.path.join(mount, "run")
        status, out = run([*TRAIN, f"--workdir={workdir}"])
        assert status == 2, f"exit {status}, want 2: {out[-600:]}"
        said = one_paragraph(out)
        return f"{said}; {assert_restorable(workdir)}; metrics {len(losses(workdir))} steps"
    finally:
        subprocess.run(["umount", mount], check=False)


# ------------------------------------------------------------ main
SCENARIOS = ("kill9", "outage", "sigterm", "disk", "inputs", "hf", "resume", "plan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", default=",".join(SCENARIOS), help="comma-separated: "
                        + ", ".join(SCENARIOS))
    parser.add_argument("--subcommands", default="", help="bad inputs of these only")
    parser.add_argument("--seed", type=int, default=0, help="where the kills land")
    args = parser.parse_args(argv)
    chosen = set(args.only.split(","))
    results: list[Result] = []
    began = time.monotonic()
    tmp = tempfile.mkdtemp(prefix="jaxscale-chaos-")
    servers_started: list = []

    def seaweed():
        from tests import servers

        if not servers_started:
            try:
                servers_started.append(servers.start(servers.SeaweedFS))
            except servers.Unavailable as e:
                raise Skip(f"SeaweedFS cannot start: {e}") from e
        return servers_started[0]

    try:
        want: dict[int, float] = {}
        if chosen & {"kill9", "outage", "sigterm"}:
            want = reference(tmp)
        if "kill9" in chosen:
            scenario_kill9(results, tmp, want, random.Random(args.seed), seaweed)
        if "outage" in chosen:
            scenario_outage(results, want, seaweed)
        if "sigterm" in chosen:
            scenario_sigterm(results, tmp, want)
        if "disk" in chosen:
            check(results, "full disk", "a 3 MiB tmpfs workdir fills during training",
                  "exit 2, one paragraph, every listed checkpoint restores", lambda: full_disk(tmp))
        if "inputs" in chosen:
            scenario_bad_inputs(results, tmp, set(args.subcommands.split(","))
                                if args.subcommands else None)
        if "hf" in chosen:
            scenario_hostile_hf(results, tmp)
        if "resume" in chosen:
            scenario_resume(results, tmp)
        if "plan" in chosen:
            scenario_plan(results, tmp)
    finally:
        for server in servers_started:
            server.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(table(results))
    failed = sum(r.status == "FAIL" for r in results)
    print(f"\n{len(results)} checks, {failed} failed, "
          f"{sum(r.status == 'skipped' for r in results)} skipped, "
          f"{time.monotonic() - began:.0f} s in all")
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
