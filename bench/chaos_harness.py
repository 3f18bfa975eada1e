"""The harness of `make chaos` (bench/chaos.py, bench/chaos_bad_input.py): checks judged and
timed into one Markdown table, and `jaxscale` child processes whose output a thread collects, so
a check can wait for a line and inject its fault at that moment."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this process only reads checkpoints

ENV = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "", "PYTHONPATH": ROOT,
       "PYTHONUNBUFFERED": "1"}
JAXSCALE = [sys.executable, "-m", "jaxscale"]
RUN_TIMEOUT_S = 600      # one train run; a hang is a failure, not a stuck suite
COMMAND_TIMEOUT_S = 120  # one bad-input command: one paragraph, quickly
ERROR = "jaxscale: error:"


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



def one_paragraph(out: str) -> str:
    assert "Traceback" not in out, f"a traceback: {out[-600:]}"
    assert out.count(ERROR) == 1, f"{out.count(ERROR)} `{ERROR}` lines: {out[-600:]}"
    return out[out.index(ERROR):].split("\n")[0][:160]

