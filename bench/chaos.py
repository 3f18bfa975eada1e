"""Fault injection before a release: `make chaos` (or `python bench/chaos.py`), docs/faults.md.

Real processes, real faults: `jaxscale train` killed with SIGKILL at seeded random points (local
disk and `s3://` on a SeaweedFS server of tests/servers.py), that server killed and restarted
mid-run, SIGTERM at every phase, a full tmpfs, and a table of bad inputs for every subcommand.
Each check states its invariant and is bounded in time; the script prints one table (scenario,
what was injected, invariant, result, time) and exits 1 if any invariant failed. Slow (many
minutes on 2 cores), so not part of `make test`; tests/test_chaos.py keeps it from rotting.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only reads checkpoints

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": ROOT,
       "PYTHONUNBUFFERED": "1"}
JAXSCALE = [sys.executable, "-m", "jaxscale"]
STEPS, EVERY = 24, 4
TRAIN = [*JAXSCALE, "train", "--config=tiny_lm:test", f"--config.train.steps={STEPS}",
         "--config.train.log_every=1", "--config.train.eval_every=0",
         f"--config.checkpoint.every={EVERY}"]
RUN_TIMEOUT_S = 600      # one train run; a hang is a failure, not a stuck suite
COMMAND_TIMEOUT_S = 120  # one bad-input command: one paragraph, quickly
ERROR = "jaxscale: error:"
SLACK_S = 60  # an outage's end (or its budget) to the run's exit: backoff, a save in flight
PREEMPTED_EXIT = 75


class Skip(Exception):
    """A check that cannot run here (the reason goes into the table)."""


@dataclasses.dataclass
class Result:
    scenario: str
    injected: str
    invariant: str
    status: str  # "pass", "FAIL" or "skipped"
    detail: str
    seconds: float


def check(results: list[Result], scenario: str, injected: str, invariant: str,
          body: Callable[[], str | None]) -> None:
    """Runs one check; an AssertionError (or any error) is a FAIL with its message."""
    began = time.monotonic()
    try:
        status, detail = "pass", body() or ""
    except Skip as e:
        status, detail = "skipped", f"skipped: {e}"
    except AssertionError as e:
        status, detail = "FAIL", str(e) or "assertion failed"
    except Exception as e:  # the harness reports every error as a failure
        status, detail = "FAIL", f"{type(e).__name__}: {e}"
    results.append(Result(scenario, injected, invariant, status, " ".join(detail.split())[:300],
                          time.monotonic() - began))
    print(f"[{status}] {scenario}: {injected} ({results[-1].seconds:.0f} s) {detail[:300]}",
          flush=True)


def table(results: list[Result]) -> str:
    """The Markdown table the script prints (and bench/RESULTS.md records)."""
    rows = ["| scenario | injected | invariant | result | time |", "|---|---|---|---|---|"]
    for r in results:
        shown = r.status if not r.detail else f"{r.status}: {r.detail}"
        cells = [r.scenario, r.injected, r.invariant, shown, f"{r.seconds:.0f} s"]
        rows.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(rows)


def exit_code(results: list[Result]) -> int:
    """1 when any invariant failed (a skip is not a failure), else 0."""
    return 1 if any(r.status == "FAIL" for r in results) else 0


# ------------------------------------------------------------ running jaxscale
class Proc:
    """A child process whose merged output is read by a thread, so the caller can wait for a
    line and then inject a fault at that moment."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None):
        self.began = time.monotonic()
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env or ENV, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout),
                                       daemon=True)
        self.reader.start()

    @property
    def out(self) -> str:
        return "".join(self.lines)

    def wait_for(self, ready: Callable[[str], bool], timeout: float = RUN_TIMEOUT_S) -> bool:
        """Polls every 2 ms until `ready(output)`; False if the process ended first."""
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            if ready(self.out):
                return True
            time.sleep(0.002)
        return False

    def finish(self, timeout: float = RUN_TIMEOUT_S) -> int:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired as e:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"still running after {timeout:.0f} s: {self.out[-500:]}") from e
        self.reader.join(30)
        return self.proc.returncode


def run(cmd: list[str], env: dict[str, str] | None = None,
        timeout: float = RUN_TIMEOUT_S) -> tuple[int, str]:
    p = Proc(cmd, env)
    return p.finish(timeout), p.out


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


def one_paragraph(out: str) -> str:
    assert "Traceback" not in out, f"a traceback: {out[-600:]}"
    assert out.count(ERROR) == 1, f"{out.count(ERROR)} `{ERROR}` lines: {out[-600:]}"
    return out[out.index(ERROR):].split("\n")[0][:160]


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
            lambda out: os.path.exists(os.path.join(workdir, "config.json")),
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


# ------------------------------------------------------------ 5. bad inputs
def bad_input_files(tmp: str) -> dict[str, str]:
    """Paths the bad-input table names: missing, corrupt and syntax-error files."""
    d = os.path.join(tmp, "bad")
    os.makedirs(os.path.join(d, "workdir"), exist_ok=True)
    files = {"missing": os.path.join(d, "no-such-thing"), "workdir": os.path.join(d, "workdir"),
             "cfg": os.path.join(d, "broken_cfg.py"), "junk": os.path.join(d, "junk.xplane.pb"),
             "tok": os.path.join(d, "tokenizer.json"), "docs": os.path.join(d, "docs.txt"),
             "out": os.path.join(d, "out"), "empty": os.path.join(d, "empty-store")}
    os.makedirs(files["empty"], exist_ok=True)
    with open(files["cfg"], "w") as f:
        f.write("def get_config(arg=None:\n    return None\n")
    for name in ("junk", "tok"):
        with open(files[name], "wb") as f:
            f.write(bytes(random.Random(0).randrange(256) for _ in range(4096)))
    with open(os.path.join(files["workdir"], "config.json"), "w") as f:
        f.write("{not json")
    with open(os.path.join(files["workdir"], "metrics.jsonl"), "w") as f:
        f.write("garbage\n{\n")
    with open(files["docs"], "w") as f:
        f.write("the quick brown fox\n" * 50)
    return files


def bad_inputs(f: dict[str, str]) -> list[tuple[str, str, list[str]]]:
    """(subcommand, what is wrong, flags): a few per subcommand."""
    tiny = "--config=tiny_lm:test"
    return [
        ("train", "bad flag value", [tiny, f"--workdir={f['out']}/t", "--config.train.steps=x"]),
        ("train", "unknown config field", [tiny, f"--workdir={f['out']}/t", "--config.nope=1"]),
        ("train", "config file with a syntax error", [f"--config={f['cfg']}",
                                                      f"--workdir={f['out']}/t"]),
        ("evaluate", "missing workdir", [f"--workdir={f['missing']}"]),
        ("evaluate", "corrupt config.json", [f"--workdir={f['workdir']}"]),
        ("evaluate", "bad flag value", [f"--workdir={f['workdir']}", "--max_batches=x"]),
        ("generate", "missing workdir", [f"--workdir={f['missing']}", "--prompt=hi"]),
        ("generate", "corrupt config.json", [f"--workdir={f['workdir']}", "--prompt=hi"]),
        ("generate", "bad flag value", [f"--workdir={f['workdir']}", "--steps=x"]),
        ("convert", "missing HF directory", [f"--from_hf={f['missing']}", f"--out={f['out']}/c"]),
        ("convert", "corrupt workdir", [f"--from_workdir={f['workdir']}", f"--to_hf={f['out']}/h"]),
        ("convert", "corrupt HF config.json", [f"--from_hf={f['workdir']}",
                                               f"--out={f['out']}/c"]),
        ("inspect", "missing config file", [f"--config={f['missing']}.py"]),
        ("inspect", "unknown config field", [tiny, "--config.model.nope=1"]),
        ("inspect", "config file with a syntax error", [f"--config={f['cfg']}"]),
        ("compile", "bad topology", [tiny, "--topology=v99:1x1"]),
        ("compile", "unknown config field", [tiny, "--topology=v5p:2x2x1", "--config.nope=1"]),
        ("compile", "config file with a syntax error", [f"--config={f['cfg']}",
                                                        "--topology=v5p:2x2x1"]),
        ("plan", "bad topology", [tiny, "--topology=garbage"]),
        ("plan", "bad flag value", [tiny, "--topology=v5p:2x2x1", "--workers=-3"]),
        ("plan", "config file with a syntax error", [f"--config={f['cfg']}",
                                                     "--topology=v5p:2x2x1"]),
        ("prepare-data", "missing sources", [f"--sources={f['missing']}/*.txt",
                                             f"--out={f['out']}/p1", "--tokenizer=bytes"]),
        ("prepare-data", "zero shards", [f"--sources={f['docs']}", f"--out={f['out']}/p2",
                                         "--tokenizer=bytes", "--num_shards=0"]),
        ("prepare-data", "corrupt tokenizer", [f"--sources={f['docs']}", f"--out={f['out']}/p3",
                                               f"--tokenizer={f['tok']}"]),
        ("lofi-local", "zero workers", [f"--store={f['out']}/l1", "--num_workers=0"]),
        ("lofi-local", "unknown sync", [f"--store={f['out']}/l2", "--sync=bogus"]),
        ("lofi-local", "store below a regular file", [f"--store={f['docs']}/store"]),
        ("lofi-average", "missing store", [f"--store={f['missing']}"]),
        ("lofi-average", "unknown aggregator", [f"--store={f['empty']}", "--aggregator=bogus"]),
        ("lofi-average", "negative budget, empty store", [f"--store={f['empty']}",
                                                          "--chunk_budget_mb=-1"]),
        ("plot", "missing workdir", [f['missing'], f"--out={f['out']}/x.png"]),
        ("plot", "corrupt metrics.jsonl", [f['workdir'], f"--out={f['out']}/y.png"]),
        ("plot", "no workdir given", [f"--out={f['out']}/z.png"]),
        ("profile-summary", "missing workdir", [f['missing']]),
        ("profile-summary", "corrupt trace file", [f['junk']]),
        ("profile-summary", "bad flag value", [f['workdir'], "--top=x"]),
    ]


def bad_input(subcommand: str, flags: list[str]) -> str:
    began = time.monotonic()
    status, out = run([*JAXSCALE, subcommand, *flags], timeout=COMMAND_TIMEOUT_S)
    assert status == 2, f"exit {status}, want 2: {out[-400:]}"
    said = one_paragraph(out)
    return f"{said} ({time.monotonic() - began:.0f} s)"


def scenario_bad_inputs(results, tmp: str, only: set[str] | None = None) -> None:
    invariant = f"exit 2, one `{ERROR}` paragraph, no traceback, < {COMMAND_TIMEOUT_S} s"
    for subcommand, what, flags in bad_inputs(bad_input_files(tmp)):
        if only is None or subcommand in only:
            check(results, f"bad input: {subcommand}", what, invariant,
                  lambda s=subcommand, fl=flags: bad_input(s, fl))


# ------------------------------------------------------------ main
SCENARIOS = ("kill9", "outage", "sigterm", "disk", "inputs")


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
