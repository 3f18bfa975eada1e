"""The Llama presets of `configs/llama.py` on TPU targets, sized and checked by the TPU
compiler (`bench/presets.py`); skipped without libtpu. The other families' presets of
`configs/finetune_lm.py` (sized by the memory estimate) compile only with
JAXSCALE_COMPILE_PRESETS=1.
"""

import json
import os
import re

import pytest

from aot_common import libtpu_test, run
from configs import finetune_lm, llama
from jaxscale.aot.plan import fits
from jaxscale.aot.topology import parse_topology
from jaxscale.compat import memory_drifted
from jaxscale.errors import ConfigError

TPU_TARGETS = {name: t for name, t in llama.TARGETS.items() if not t.gpu}
PRESET_VARIANTS = [v for v in llama.VARIANTS if "," in v and v.split(",")[1] in TPU_TARGETS]


def test_every_tpu_preset_is_sized_by_the_compiler():
    assert [_tightest(s) for s in llama.SIZES] == ["tiny,v5e-8", "125m,v5e-8", "1b,v5e-8",
                                                   "7b,v5e-16"]
    for name, target in TPU_TARGETS.items():
        assert parse_topology(target.topology).num_chips == target.total, name
    # Every SIZE,TARGET pair the compiler was asked about has its answer in COMPILED, and the
    # variants are exactly those it said fit (`bench/presets.py`), except where FSDP cannot
    # split the embed dimension (never compiled).
    for size, spec in llama.SIZES.items():
        for target, t in TPU_TARGETS.items():
            divides = spec.strategy == "dp" or spec.model["embed"] % t.devices == 0
            compiled = llama.COMPILED.get((size, target))
            assert (compiled is not None) == divides, (size, target)
            if compiled is None:
                continue
            fits = compiled.micro_batch > 0
            assert (compiled.gib <= t.budget_gib) == fits, (size, target)
            if fits:
                c = llama.get_config(f"{size},{target}")
                rows = c.data.batch_size // (c.train.grad_accum * t.total)
                assert rows == compiled.micro_batch and compiled.step_ms[0] > 0
    with pytest.raises(ConfigError, match="as the TPU compiler has it"):
        llama.get_config("7b,v5e-8")
    # The long-context presets: a sequence per `context` chips on a mesh the compiler sized.
    for size, preset in llama.LONG_CONTEXT.items():
        for target, (t, context, compiled) in preset.targets.items():
            c = llama.get_config(f"{size},{target}")
            assert parse_topology(t.topology).num_chips == t.total == c.mesh.fsdp * context
            assert c.mesh.context == context and c.data.seq_len % (2 * context) == 0
            assert compiled.gib <= t.budget_gib
    with pytest.raises(ConfigError, match="needs one of its targets"):
        llama.get_config("8b-128k,v5e-16")


def _tightest(size: str) -> str:
    """The TPU preset of SIZE that leaves the least HBM free, as COMPILED records it."""
    fits = [(c.gib / llama.TARGETS[t].budget_gib, f"{s},{t}")
            for (s, t), c in llama.COMPILED.items() if s == size and c.micro_batch]
    return max(fits)[1]


# Compiled for its slice by one `bench/presets.py --check` process: in every `make test` the
# tightest TPU preset of the two smallest sizes (the sweep's answers, read from its cache); with
# JAXSCALE_COMPILE_PRESETS=1 every one of them (21, which would take `make test` past CI's 30
# minutes: bench/RESULTS.md has the times). `python bench/presets.py --check` runs the same full
# check on its own.
CHECKED = (PRESET_VARIANTS if os.environ.get("JAXSCALE_COMPILE_PRESETS")
           else [_tightest(size) for size in list(llama.SIZES)[:2]])
SWEPT = "v5e-8"  # the target the sweep searches: that of both tightest presets in CHECKED


@pytest.fixture(scope="module")
def plan_cache(tmp_path_factory):
    """One compile cache for the sweep and the check: the check compiles the tightest presets
    (v5e-8) as configured, which are the sweep's answers, so it reads them from the cache
    (`aot.search.compile_cached`: keyed by the whole config and topology) instead of compiling
    them again."""
    return tmp_path_factory.mktemp("plan_cache")


@pytest.fixture(scope="module")
def sweep(plan_cache, tmp_path_factory):
    return run(["bench/presets.py", "--sizes=tiny,125m", f"--targets={SWEPT}",
                f"--cache_dir={plan_cache}"], tmp_path_factory.mktemp("sweep"))


@pytest.fixture(scope="module")
def presets_compiled(sweep, plan_cache, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("presets")
    proc = run(["bench/presets.py", "--check", f"--variants={';'.join(CHECKED)}",
                f"--json={tmp}/r.json", f"--cache_dir={plan_cache}"], tmp, timeout=3600)
    return proc, json.loads((tmp / "r.json").read_text())


@libtpu_test
@pytest.mark.slow
@pytest.mark.parametrize("variant", PRESET_VARIANTS)
def test_preset_fits_its_target(variant, presets_compiled):
    if variant not in CHECKED:
        pytest.skip("set JAXSCALE_COMPILE_PRESETS=1 to compile every TPU preset, or run "
                    "`python bench/presets.py --check`")
    proc, results = presets_compiled
    report = results[variant]
    assert "error" not in report, report
    gib = report["total_bytes"] / 2**30
    assert fits(report), f"{gib:.2f} GiB"
    assert not memory_drifted(gib, llama.COMPILED[llama.parse_arg(variant)].gib), (
        f"{variant}: the compiler now needs {gib:.2f} GiB per chip; rerun bench/presets.py")
    assert proc.returncode == 0 and "presets fit as recorded" in proc.stdout, proc.stdout


@libtpu_test
def test_the_sweep_reproduces_what_compiled_records(sweep):
    # bench/presets.py's search: micro-batches largest first until one fits (`aot.plan.fits`).
    # On v5e-8 tiny takes its chips' whole share (2 sequences) at once; 125m fits neither 32
    # nor 16 sequences of 1,024 a chip at once within the margin of v5e's 16 GiB: it tries 32
    # and 16, then takes 8.
    proc = sweep
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = dict(re.findall(rf"\('(\w+)', '{SWEPT}'\): Compiled\((\d+), ", proc.stdout))
    assert {s: int(m) for s, m in found.items()} == {
        s: llama.COMPILED[(s, SWEPT)].micro_batch for s in ("tiny", "125m")}
    assert re.search(rf"\| `125m,{SWEPT}` \| v5e:2x4 \| data=8 \| 8 x 4 \|.*\| 3, \d+ s \|",
                     proc.stdout), proc.stdout


FAMILY_TPU_VARIANTS = [v for v in finetune_lm.VARIANTS if v.split(",")[0] in finetune_lm.FAMILIES
                       and "," in v and v.split(",")[-1] in TPU_TARGETS]


# The estimate errs on the safe side on TPU (configs/llama.py), so these are a check, not a
# sizing; 48 compiles (the Gemmas' 20 not compiled yet), too many for `make test`.
@libtpu_test
@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("JAXSCALE_COMPILE_PRESETS"),
                    reason="set JAXSCALE_COMPILE_PRESETS=1 to compile the families' TPU presets")
@pytest.mark.parametrize("variant", FAMILY_TPU_VARIANTS)
def test_family_preset_fits_its_target_as_compiled(variant, tmp_path):
    target = llama.TARGETS[variant.split(",")[-1]]
    proc = run(["-m", "launch.compile", f"--config=finetune_lm:{variant}",
                f"--config.init_from={tmp_path}", f"--topology={target.topology}",
                f"--out={tmp_path}/r.json"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    gib = report["total_bytes"] / 2**30
    assert fits(report), f"{variant}: {gib:.2f} GiB per chip"
