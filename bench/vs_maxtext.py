"""MaxText and jaxscale side by side on the same work, compiled ahead of time for a TPU slice.

Nothing runs on a TPU: both train steps are compiled by libtpu for the topology on this machine,
and both compiled programs are read with jaxscale's own counters (`aot/hlo.py`,
`aot/hlo_flops.py`) and roofline (`aot/roofline.py`), so the table compares the programs, not two
tools' bookkeeping. One table: memory per chip, FLOPs, collectives, and the step-time ESTIMATE
with full and with no overlap.

MaxText needs Python 3.12 or newer and its own environment (about 3 GB; 15 minutes to install
on a loaded 2-core VM). The script creates it on first use at `--maxtext_venv`, exactly as:

    python3.12 -m venv VENV                 # pyenv: $(pyenv root)/versions/3.12.1/bin/python3.12
    VENV/bin/pip install "maxtext[tpu]==0.2.5"   # MaxText 0.2.5, jax 0.12.0.1, libtpu 0.0.52

and reuses it afterwards. jaxscale compiles in the interpreter running this script (`.venv312`
or `.venv`, with the `tpu` extra). Use the same libtpu on both sides (0.0.52 here).

    .venv312/bin/python bench/vs_maxtext.py --model=7b --topology=v5p:2x2x4 --per_chip=32 \
        [--remat=full] [--maxtext_venv=.venv-maxtext] [--jaxscale_flags="--config.mesh.data=4 ..."]

`--jaxscale_flags` adds a second jaxscale row with those overrides for the same global batch
(paste a `launch.plan` winner line). Results: bench/RESULTS.md ("jaxscale and MaxText").
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MAXTEXT = "maxtext[tpu]==0.2.5"
# jaxscale size -> (MaxText model_name, overrides that make MaxText's model the same one).
MODELS = {
    "7b": ("llama2-7b", []),
    "1b": ("llama2-7b", ["override_model_config=True", "base_emb_dim=2048",
                         "base_num_query_heads=32", "base_num_kv_heads=8", "base_mlp_dim=8192",
                         "base_num_decoder_layers=16", "head_dim=64",
                         "rope_max_timescale=500000"]),
}
# TensorCores per chip in Google's slice names (v5p-32 is 16 chips of 2 cores; v5e-256 256).
_CORES = {"v4": 2, "v5p": 2, "v5e": 1, "v6e": 1}
_MEMORY = re.compile(r"(\w+_size_in_bytes)=(\d+)")


def maxtext_python(venv: str) -> str:
    """The venv's python, creating the venv and installing MaxText first when it is missing."""
    python = os.path.join(venv, "bin", "python")
    if os.path.exists(python):
        return python
    base = subprocess.run([os.path.join(ROOT, ".ci", "find-python"), "python3.12"],
                          capture_output=True, text=True).stdout.strip()
    if not base:
        sys.exit("vs_maxtext: MaxText needs Python 3.12 (not found on PATH or in pyenv)")
    subprocess.run([base, "-m", "venv", venv], check=True)
    subprocess.run([python, "-m", "pip", "install", "--quiet", MAXTEXT], check=True)
    return python


def slice_name(topology: str) -> str:
    """jaxscale's `v5p:2x2x4` as Google names the slice (`v5p-32`: TensorCores)."""
    from jaxscale.aot.topology import parse_topology

    generation = topology.split(":")[0]
    return f"{generation}-{parse_topology(topology).num_chips * _CORES[generation]}"


def compile_maxtext(python: str, args: argparse.Namespace, dump: str) -> dict:
    """MaxText's `train_compile` for the work; its memory (printed) and its HLO dump's path.
    A dump directory that holds a finished compile (`memory.json`) is read, not compiled again."""
    done = os.path.join(dump, "memory.json")
    if os.path.exists(done):
        with open(done) as f:
            return {**json.load(f), "dump": dump}
    model, overrides = MODELS[args.model]
    base = subprocess.run([python, "-c", "import maxtext, os; print(os.path.dirname("
                           "maxtext.__file__))"], capture_output=True, text=True, check=True)
    cmd = [python, "-m", "maxtext.trainers.pre_train.train_compile",
           os.path.join(base.stdout.strip(), "configs", "base.yml"),
           f"compile_topology={slice_name(args.topology)}", "compile_topology_num_slices=1",
           f"model_name={model}", *overrides, f"per_device_batch_size={args.per_chip}",
           f"remat_policy={args.remat}", f"max_target_length={args.seq_len}",
           "attention=flash", "dataset_type=synthetic", "enable_checkpointing=false",
           "run_name=vs_maxtext", f"base_output_directory={dump}/out", *args.maxtext_flags]
    env = {**os.environ, "XLA_FLAGS": f"--xla_dump_to={dump} --xla_dump_hlo_as_text "
           "--xla_dump_hlo_pass_re=spmd-partitioning --xla_dump_hlo_module_re=train_step"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("Memory analysis:")), "")
    if proc.returncode or not line:
        sys.exit(f"vs_maxtext: MaxText's train_compile failed:\n{proc.stderr[-3000:]}")
    memory = {k: int(v) for k, v in _MEMORY.findall(line)}
    with open(done, "w") as f:
        json.dump(memory, f)
    return {**memory, "dump": dump}


def compile_jaxscale(args: argparse.Namespace, flags: list[str], out_dir: str) -> dict:
    """jaxscale's compile of the same work (`jaxscale compile`), its JSON report."""
    out = os.path.join(out_dir, "report.json")
    if os.path.exists(out):  # compiled by an earlier run into the same --work_dir
        with open(out) as f:
            return json.load(f)
    cmd = [sys.executable, "-m", "jaxscale", "compile", f"--topology={args.topology}",
           f"--config=llama:{args.model}", f"--config.data.seq_len={args.seq_len}",
           f"--config.data.batch_size={args.batch}", "--config.model.attention=splash",
           f"--config.model.remat={args.remat}", "--config.train.eval_every=0", *flags,
           f"--out={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode:  # a row of the table says so (e.g. an internal compiler error)
        lines = [l for l in proc.stderr.splitlines() if l.strip()]
        return {"error": lines[-1][:300] if lines else f"exit status {proc.returncode}"}
    with open(out) as f:
        return json.load(f)


def read_maxtext(mt: dict, same_work: dict) -> dict:
    """MaxText's compiled step counted as jaxscale counts its own: collectives from the
    optimized HLO, matmul FLOPs from the partitioned HLO, plus its flash (splash) kernels'
    attention FLOPs, which no dot shows, counted as jaxscale's same-work report counts its own."""
    from jaxscale.aot import hlo, hlo_flops

    def largest(pattern: str) -> str:
        return max(glob.glob(os.path.join(mt["dump"], pattern)), key=os.path.getsize)

    with open(largest("*after_tpu-spmd-partitioning*.txt")) as f:
        partitioned = hlo.parse(f.read())
    with open(largest("*after_optimizations.txt")) as f:
        optimized = hlo.parse(f.read())
    calls = hlo_flops.kernel_calls(partitioned)
    kernels = same_work["kernel_flops"] if calls else 0.0
    return {"argument_bytes": mt["argument_size_in_bytes"],
            "output_bytes": mt["output_size_in_bytes"], "alias_bytes": mt["alias_size_in_bytes"],
            "temp_bytes": mt["temp_size_in_bytes"],
            "total_bytes": (mt["argument_size_in_bytes"] + mt["output_size_in_bytes"]
                            - mt["alias_size_in_bytes"] + mt["temp_size_in_bytes"]),
            "flops": hlo_flops.flops(partitioned) + kernels, "kernel_calls": calls,
            "collectives": [vars(c) for c in hlo.collectives(optimized)],
            "model_flops": same_work["model_flops"]}


def row(name: str, r: dict, chip) -> list[str]:
    from jaxscale.aot.hlo import KINDS
    from jaxscale.aot.roofline import estimate

    e = estimate(chip, r["flops"], r["collectives"], r["model_flops"])
    by_kind = {k: sum(c["bytes"] * c["executions"] for c in r["collectives"] if c["kind"] == k)
               for k in KINDS}
    gib = lambda b: f"{b / 2**30:.2f}"
    return [name, gib(r["total_bytes"]), gib(r["temp_bytes"]), f"{r['flops']:.4e}",
            f"{r['flops'] / r['model_flops']:.3f}",
            " / ".join(gib(by_kind[k]) for k in ("all-gather", "reduce-scatter", "all-reduce",
                                                  "collective-permute", "all-to-all")),
            f"{e.full_overlap_s * 1e3:,.1f}..{e.no_overlap_s * 1e3:,.1f}"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=sorted(MODELS), default="7b")
    p.add_argument("--topology", default="v5p:2x2x4")
    p.add_argument("--per_chip", type=int, default=32, help="sequences per chip per step")
    p.add_argument("--seq_len", type=int, default=2048)
    p.add_argument("--remat", default="full", help="the same policy name on both sides")
    p.add_argument("--maxtext_venv", default=os.path.join(ROOT, ".venv-maxtext"))
    p.add_argument("--maxtext_flags", type=shlex.split, default=[],
                   help='more MaxText key=value settings, e.g. "gradient_accumulation_steps=2"')
    p.add_argument("--jaxscale_flags", type=shlex.split, default=None,
                   help="a second jaxscale row with these --config overrides (a plan's winner)")
    p.add_argument("--work_dir", default=None, help="keeps the dumps and reports (else a temp "
                   "dir); a rerun with the same settings reads what it holds")
    args = p.parse_args()

    from jaxscale.aot.topology import parse_topology

    topology = parse_topology(args.topology)
    args.batch = args.per_chip * topology.num_chips
    python = maxtext_python(args.maxtext_venv)
    work = args.work_dir or tempfile.mkdtemp(prefix="vs_maxtext_")
    rows = [("jaxscale, same settings", [])]
    if args.jaxscale_flags is not None:
        rows.append(("jaxscale, " + " ".join(args.jaxscale_flags), args.jaxscale_flags))
    reports = []
    for i, (name, flags) in enumerate(rows):
        os.makedirs(os.path.join(work, f"jaxscale{i}"), exist_ok=True)
        reports.append((name, compile_jaxscale(args, flags, os.path.join(work, f"jaxscale{i}"))))
    if "error" in reports[0][1]:
        sys.exit(f"vs_maxtext: jaxscale's same-settings compile failed: {reports[0][1]['error']}")
    maxtext = read_maxtext(compile_maxtext(python, args, os.path.join(work, "maxtext")),
                           reports[0][1])
    print(f"{args.model} on {args.topology} ({slice_name(args.topology)}), {args.batch} x "
          f"{args.seq_len} tokens a step ({args.per_chip} a chip), remat {args.remat}; libtpu "
          "compiles, jaxscale's counters on both (ESTIMATES, nothing ran)")
    print("| step | GiB/chip | temporaries | FLOPs/chip | / model | collectives GiB: AG / RS / "
          "AR / permute / A2A | step ms, full..no overlap |")
    print("|---|---:|---:|---:|---:|---|---|")
    for name, r in [("MaxText 0.2.5 `train_compile`", maxtext), *reports]:
        cells = row(name, r, topology.chip) if "error" not in r else [
            name, f"compile failed: {r['error']}", *["-"] * 5]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
