"""The docs cannot drift: their runnable commands run, their links resolve, their names exist.

The runnable marker. An HTML comment on the line right before a fenced block marks it:

    <!-- runnable -->
    ```bash
    jaxscale train --config=tiny_lm:test --workdir=runs/demo --cpu_devices=8
    ```

`<!-- runnable: expects PATH [PATH ...] -->` also asserts that each PATH exists once the block has
run. The runnable blocks of one page (README.md or docs/NAME.md) run in order in one fresh temporary
directory, so a block may use what an earlier block of the same page wrote; `bash` blocks run under
`bash -euo pipefail`, `python` blocks through the venv's `python`, with the running venv's `bin`
first on PATH (`.venv/bin`, `.venv312/bin`), on the CPU backend (`JAX_PLATFORMS=cpu`) and without
the test suite's `XLA_FLAGS`, as in a user's shell, but for the tests' own (`TEST_XLA_FLAGS`,
tests/child_env.py: LLVM at -O0, the same HLO compiled a third faster; the blocks spend their
time compiling). Mark only blocks that
are cheap (seconds, at most about a minute on a loaded 2-core machine: tiny configs, a few steps,
`--cpu_devices`, relative workdirs) and hermetic (no network, no TPU); all of them together take
about nine minutes of one worker in `make test` on a 2-core machine, so a block must show what no
other block shows; the test that runs them is marked `slow` (part of `make test`, like every
slow test).
docs/contributing.md says the same for writers of docs.

Also checked, without running anything: every relative link in README.md and docs/*.md names an
existing file (and, into a Markdown page, an existing heading); every `jaxscale/...`, `bench/...`,
`tests/...` or `launch/...` path and every dotted `jaxscale.` name in backticks exists; a
marker stands right before a fence; README.md stays under 250 lines.
"""

from __future__ import annotations

import dataclasses
import glob
import importlib
import importlib.util
import os
import re
import subprocess
import sys

import pytest

from child_env import TEST_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [os.path.join(ROOT, "README.md"), *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
README_MAX_LINES = 250
BLOCK_TIMEOUT_S = 900  # a hang guard; the blocks themselves take seconds

MARKER = re.compile(r"^<!--\s*runnable(?::\s*expects\s+(?P<expects>[^>]*?))?\s*-->\s*$")
FENCE = re.compile(r"^```(?P<lang>\w*)\s*$")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\((?P<target>[^)\s]+)\)")
PATH = re.compile(r"`(?P<path>(?:jaxscale|bench|tests|launch)/[^`\s]*)`")
DOTTED = re.compile(r"`(?P<name>jaxscale(?:\.[A-Za-z_]\w*)+)")


@dataclasses.dataclass(frozen=True)
class Block:
    page: str
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    expects: tuple[str, ...]


def _rel(page: str) -> str:
    return os.path.relpath(page, ROOT)


def _lines(page: str) -> list[str]:
    with open(page, encoding="utf-8") as f:
        return f.read().split("\n")


def _markers(page: str) -> list[tuple[int, re.Match, re.Match | None]]:
    """(index, marker, fence or None) of every runnable marker on the page."""
    lines, out = _lines(page), []
    for i, line in enumerate(lines):
        marker = MARKER.match(line)
        if marker:
            fence = FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
            out.append((i, marker, fence if fence and fence["lang"] in ("bash", "python") else None))
    return out


def runnable_blocks(page: str) -> list[Block]:
    """The page's marked blocks, in order (a marker without a fence after it is left out here
    and reported by `test_markers_stand_before_a_fence`)."""
    lines, blocks = _lines(page), []
    for i, marker, fence in _markers(page):
        if fence is None:
            continue
        end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith("```"))
        expects = tuple((marker["expects"] or "").split())
        blocks.append(Block(page, i + 2, fence["lang"], "\n".join(lines[i + 2:end]) + "\n",
                            expects))
    return blocks


def _outside_fences(page: str) -> list[tuple[int, str]]:
    """(line number, text) of the page's lines that are prose, not inside a fenced block."""
    out, fenced = [], False
    for n, line in enumerate(_lines(page), 1):
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def _env() -> dict[str, str]:
    venv_bin = os.path.dirname(sys.executable)  # the venv running the tests: .venv, .venv312
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env.update(PATH=venv_bin + os.pathsep + env.get("PATH", ""), JAX_PLATFORMS="cpu",
               PYTHONUNBUFFERED="1", XLA_FLAGS=TEST_XLA_FLAGS)
    return env


PAGES_WITH_BLOCKS = [p for p in PAGES if runnable_blocks(p)]
TORCH = re.compile(r"^\s*(?:import|from) (?:torch|transformers|peft)\b", re.M)


# `slow`: about nine minutes of subprocesses in all (19 pages) on a 2-core machine (still part of
# `make test`; the checks below that run nothing are not marked). `docs_blocks`: CI runs them in
# its first leg only (`.ci/run`), since what they check (the docs' text against the code) does
# not change with jax; the second leg runs every test of the code itself.
@pytest.mark.slow
@pytest.mark.docs_blocks
@pytest.mark.parametrize("page", PAGES_WITH_BLOCKS, ids=_rel)
def test_runnable_blocks_run(page, tmp_path):
    if importlib.util.find_spec("torch") is None and any(
            TORCH.search(b.code) for b in runnable_blocks(page)):
        pytest.skip("its blocks build Hugging Face models with torch, not installed here (the "
                    "`parity` extra: Python 3.11's leg)")
    env = _env()
    for block in runnable_blocks(page):
        where = f"{_rel(page)}:{block.line}"
        argv = (["bash", "-euo", "pipefail", "-c", block.code] if block.lang == "bash"
                else ["python", "-"])
        stdin = block.code if block.lang == "python" else None
        try:
            done = subprocess.run(argv, cwd=tmp_path, env=env, input=stdin, text=True,
                                  capture_output=True, timeout=BLOCK_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{where}: the block ran over {BLOCK_TIMEOUT_S} s:\n{block.code}")
        assert done.returncode == 0, (
            f"{where}: the block exited with status {done.returncode}:\n{block.code}\n"
            f"--- stdout (end)\n{done.stdout[-4000:]}\n--- stderr (end)\n{done.stderr[-4000:]}")
        missing = [p for p in block.expects if not glob.glob(str(tmp_path / p))]
        assert not missing, f"{where}: the block ran but did not write {missing}:\n{block.code}"


def _anchors(page: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for _, line in _outside_fences(page):
        if line.startswith("#"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for n, line in _outside_fences(page):
            for link in LINK.finditer(line):
                target = link["target"]
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
                    continue
                path, _, anchor = target.partition("#")
                full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
                if not os.path.exists(full):
                    broken.append(f"{_rel(page)}:{n}: {target} (no file {_rel(full)})")
                elif anchor and full in PAGES and anchor not in _anchors(full):
                    broken.append(f"{_rel(page)}:{n}: {target} (no heading #{anchor})")
    assert not broken, "Broken links; fix the link or the heading:\n" + "\n".join(broken)


def test_named_paths_exist():
    missing = []
    for page in PAGES:
        for n, line in _outside_fences(page):
            for m in PATH.finditer(line):
                path = m["path"].rstrip(".,:;")
                if re.search(r"[<>*{}\[\]]|\.\.\.", path):  # a pattern, not a path
                    continue
                if not os.path.exists(os.path.join(ROOT, path)):
                    missing.append(f"{_rel(page)}:{n}: {path}")
    assert not missing, ("Paths named in the docs that do not exist (moved or renamed? update the "
                         "docs):\n" + "\n".join(missing))


def _resolves(name: str) -> bool:
    """Whether `jaxscale.a.b.c` names a module, or an attribute reached from the longest
    importable module prefix."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_named_python_names_exist():
    names = {}
    for page in PAGES:
        for n, line in _outside_fences(page):
            for m in DOTTED.finditer(line):
                names.setdefault(m["name"], f"{_rel(page)}:{n}")
    missing = [f"{where}: {name}" for name, where in sorted(names.items()) if not _resolves(name)]
    assert not missing, ("Python names in the docs that do not exist (moved or renamed? update "
                         "the docs):\n" + "\n".join(missing))


def test_architecture_names_every_module():
    """docs/architecture.md is the map: every module of `jaxscale/` appears in it, by its file
    name or its path under jaxscale/ (packages' `__init__.py` aside)."""
    text = open(os.path.join(ROOT, "docs", "architecture.md")).read()
    missing = [os.path.relpath(p, ROOT) for p in sorted(glob.glob(
        os.path.join(ROOT, "jaxscale", "**", "*.py"), recursive=True))
        if not p.endswith("__init__.py") and os.path.basename(p) not in text
        and os.path.relpath(p, os.path.join(ROOT, "jaxscale")) not in text]
    assert not missing, f"docs/architecture.md does not name {missing}: add each to its row."


def test_readme_stays_short():
    lines = len(_lines(PAGES[0]))
    assert lines < README_MAX_LINES, (
        f"README.md has {lines} lines, the limit is {README_MAX_LINES}: move the new text into a "
        f"page under docs/ and link it from README.md.")


def test_markers_stand_before_a_fence():
    stray = [f"{_rel(page)}:{i + 1}" for page in PAGES for i, _, fence in _markers(page)
             if fence is None]
    assert not stray, ("A runnable marker must stand on the line right before a ```bash or "
                       "```python fence:\n" + "\n".join(stray))
