"""Decode tokens/s on CPU: jaxscale's rollout sampler against transformers' `generate`, on the
same converted model (issue 42 item 1).

    python bench/generate.py [--batch=32] [--prompt=16] [--new=128] [--repeats=2] [--profile]

The model is the one the issue measured: a random Qwen3-style model (hidden 256, 4 layers,
vocabulary 2,048) made with transformers, converted to jaxscale, float32, one CPU device. Both
decode `--new` greedy tokens for `--batch` prompts of `--prompt` tokens (no stop: every row runs
to the end); the tokens must be identical. Timings are the best of `--repeats` calls after a
warm-up call (jaxscale's compile is not counted, and is printed apart), measured in one process
one after the other so that other load on the machine hits both alike; transformers runs with
torch's default threads and with one (faster on a loaded machine), and the faster counts; the
Sampler also runs with single-threaded XLA:CPU (a subprocess: the flag is read at start-up).
Also printed: the `copy_weights=True` Sampler (the CPU speed knob), a data mesh of one CPU device
a core (a subprocess, `--replicas`: decoding replicas), the `jaxscale generate` path
(`generate.generate_from_config`, which keeps its sampler, so a second call does not compile
again) and a top-p sampling run (its speed only). `--profile`
prints instead where a greedy Sampler call spends its time: the top XLA:CPU ops of a
`jax.profiler` trace of one call (`jaxscale.observe.profiling`, as `jaxscale profile-summary`).
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax
import numpy as np
import torch
import transformers

from jaxscale.config import base_config
from jaxscale.inference import generate as gen
from jaxscale.inference.sampling import Sampler, Sampling
from jaxscale.interop import hf
from jaxscale.mesh import make_mesh
from jaxscale.models import ModelDef
from jaxscale.precision import get_policy
from jaxscale.rules import AxisRules
from jaxscale.weights.sources import open_huggingface


def best_of(fn, repeats: int) -> tuple[float, object]:
    """(fastest wall seconds, last result) of `repeats` calls."""
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def profile(call, hlo_text: str, steps: int, top: int = int(os.environ.get("TOP", "16"))) -> None:
    """The top ops of one traced `call` (a warm Sampler call), in ms a decoding step, each with
    the jax operation it came from (its `op_name` in the compiled program `hlo_text`)."""
    from jaxscale.observe.profiling import summarize
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            call()
        summary = summarize(next(os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs
                                 if f.endswith(".xplane.pb")))
    origin = {name: (shape.split("{")[0], op.split("/")[-1]) for name, shape, op in re.findall(
        r'^\s*%(\S+) = (\S+) .*?op_name="([^"]+)"', hlo_text, re.M)}
    print(f"one greedy Sampler call of {steps} steps: {summary.total_ns / 1e6 / steps:.2f} ms "
          f"of op time a step ({summary.source})")
    for op in summary.ops[:top]:
        shape, what = origin.get(op.name, ("", ""))
        print(f"{op.name[:32]:<32} {op.total_ns / 1e6 / steps:6.3f} ms/step "
              f"{100 * op.total_ns / summary.total_ns:5.1f}%  {shape:<20} {what[:30]}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--jax_only", action="store_true", help="print only the Sampler's greedy "
                   "tok/s (the single-threaded XLA:CPU run below is this, in a subprocess)")
    p.add_argument("--profile", action="store_true", help="print the top ops of one greedy "
                   "Sampler call instead of the comparison")
    p.add_argument("--replicas", type=int, default=0, help="with --jax_only: decode on a "
                   "data mesh of this many CPU devices (set them with XLA_FLAGS)")
    a = p.parse_args()
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=2048, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    prompt = np.random.default_rng(0).integers(1, 2048, (a.batch, a.prompt)).astype(np.int32)
    tokens = a.batch * a.new

    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        model_cfg, params = hf.load_pretrained(open_huggingface(d))
        run_config, lazy = gen.load_model(hf_dir=d)
        lazy = jax.tree.map(np.asarray, lazy)

    def theirs():
        with torch.no_grad():
            return model.generate(torch.from_numpy(prompt).long(), max_new_tokens=a.new,
                                  min_new_tokens=a.new, do_sample=False,
                                  attention_mask=torch.ones_like(torch.from_numpy(prompt)))
    model_def = ModelDef.build(model_cfg, get_policy("32-true"))
    params = jax.device_put(params)
    sampler = Sampler(model_def, max_len=model_cfg["max_len"])
    if a.replicas:  # the training mesh of a data-parallel run: the rows split, weights whole
        c = base_config()
        c.mesh.data = a.replicas
        mesh = make_mesh(c.mesh)
        params = jax.device_put(params, jax.NamedSharding(mesh, jax.P()))
        sampler = Sampler(model_def, rules=AxisRules.from_config(c), mesh=mesh,
                          max_len=model_cfg["max_len"])
        assert sampler.replica_axes(params) == ("data",)
    start = time.perf_counter()
    jax.block_until_ready(sampler(params, prompt, jax.random.key(0), a.new).tokens)
    compile_s = time.perf_counter() - start
    t_ours, out = best_of(lambda: jax.block_until_ready(
        sampler(params, prompt, jax.random.key(0), a.new).tokens), a.repeats)
    if a.jax_only:
        if a.replicas:  # the rollout is one device's
            one = Sampler(model_def, max_len=model_cfg["max_len"])
            alone = one(jax.device_get(params), prompt, jax.random.key(0), a.new).tokens
            assert np.array_equal(np.asarray(out), np.asarray(alone)), "replicas differ"
        print(tokens / t_ours)
        return
    if a.profile:
        lengths = np.full((a.batch,), a.prompt, np.int32)
        hlo = sampler._jitted.lower(params, prompt, lengths, jax.random.key(0),
                                    steps=a.new).compile().as_text()
        profile(lambda: jax.block_until_ready(
            sampler(params, prompt, jax.random.key(0), a.new).tokens), hlo, a.new)
        return
    env = {**os.environ, "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
    one = subprocess.run([sys.executable, __file__, "--jax_only", f"--batch={a.batch}",
                          f"--prompt={a.prompt}", f"--new={a.new}", f"--repeats={a.repeats}"],
                         env=env, capture_output=True, text=True, check=True)
    one_thread = float(one.stdout.split()[-1])
    cores = os.cpu_count() or 1
    both = subprocess.run(
        [sys.executable, __file__, "--jax_only", f"--replicas={cores}", f"--batch={a.batch}",
         f"--prompt={a.prompt}", f"--new={a.new}", f"--repeats={a.repeats}"],
        env={**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={cores}"},
        capture_output=True, text=True, check=True) if cores > 1 else None
    replicas = float(both.stdout.split()[-1]) if both else None
    timings = {}
    for threads in sorted({torch.get_num_threads(), 1}, reverse=True):  # the default, and 1
        torch.set_num_threads(threads)  # (1 is faster when other jobs load the cores)
        theirs()  # warm-up
        timings[threads], ref = best_of(theirs, a.repeats)
    t_hf = min(timings.values())
    ref = ref.numpy()[:, a.prompt:]
    same = np.array_equal(np.asarray(out), ref)

    gen.generate_from_config(run_config, lazy, prompt, a.new)  # builds its sampler once
    t_cli, cli_out = best_of(lambda: gen.generate_from_config(run_config, lazy, prompt, a.new),
                             a.repeats)
    copies = Sampler(model_def, max_len=model_cfg["max_len"], copy_weights=True)
    copies(params, prompt, jax.random.key(0), a.new)
    t_copies, copied = best_of(lambda: jax.block_until_ready(
        copies(params, prompt, jax.random.key(0), a.new).tokens), a.repeats)
    same = same and np.array_equal(np.asarray(copied), ref)
    top_p = Sampler(model_def, Sampling(temperature=1.0, top_p=0.9, top_k=50))
    top_p(params, prompt, jax.random.key(1), a.new)
    t_top_p, _ = best_of(lambda: jax.block_until_ready(
        top_p(params, prompt, jax.random.key(1), a.new).tokens), a.repeats)

    print(f"batch {a.batch} x prompt {a.prompt} + {a.new} new tokens, float32, "
          f"{jax.device_count()} CPU device(s)")
    for threads, t in timings.items():
        print(f"transformers generate (greedy), {threads} thread(s) {tokens / t:9,.0f} tok/s")
    print("ratios below are against the faster transformers run")
    print(f"jaxscale Sampler (greedy)              {tokens / t_ours:9,.0f} tok/s  "
          f"ratio {t_hf / t_ours:.2f}x  (first call incl. compile {compile_s:.1f} s)")
    print(f"jaxscale Sampler, 1-thread XLA:CPU     {one_thread:9,.0f} tok/s  "
          f"ratio {one_thread * t_hf / tokens:.2f}x  (a subprocess, "
          "XLA_FLAGS=--xla_cpu_multi_thread_eigen=false)")
    print(f"jaxscale Sampler, copy_weights=True   {tokens / t_copies:9,.0f} tok/s  "
          f"ratio {t_hf / t_copies:.2f}x  (per-call copies of the layer weights)")
    if replicas:
        print(f"jaxscale Sampler, data={cores} CPU devices {replicas:9,.0f} tok/s  "
              f"ratio {replicas * t_hf / tokens:.2f}x  (a subprocess: decoding replicas, one "
              "a core)")
    print(f"jaxscale generate_from_config (greedy) {tokens / t_cli:9,.0f} tok/s  "
          f"ratio {t_hf / t_cli:.2f}x  (params placed each call)")
    print(f"jaxscale Sampler (top-k 50, top-p 0.9) {tokens / t_top_p:9,.0f} tok/s")
    print(f"greedy tokens identical to transformers (both Samplers): {same}, "
          f"generate_from_config too: {np.array_equal(cli_out[:, a.prompt:], ref)}")


if __name__ == "__main__":
    main()
