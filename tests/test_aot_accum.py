"""Gradient accumulation compiled for TPU (issue 40), and a compiler failure as one paragraph.

libtpu 0.0.52 failed every accumulated `bf16-mixed` step on an FSDP mesh with
`RET_CHECK ... while_loop_all_reduce_code_motion.cc ... user->opcode() == HloOpcode::kAdd`: the
vocabulary matrices' gradients are reduce-scattered in bf16 and converted to float32 before the
loop adds them to its carry, a form that pass accepts when it checks a loop and then fails on
when it rewrites it (`models/nn/shard_sums.settle`, bench/RESULTS.md). The sweep over every TPU
generation, mesh and accumulation is `bench/accum_sweep.py`; here is its smallest failing case.
"""

import json
import textwrap

from aot_common import TINY, libtpu_test, run, run_module

ACCUM = [*TINY, "--config.mesh.fsdp=4", "--config.data.batch_size=16",
         "--config.train.grad_accum=2"]


@libtpu_test
def test_accumulation_compiles_with_the_vocabulary_gradients_reduced_in_the_loop(tmp_path):
    # The smallest step that failed on 17d7dfe (2 layers, vocabulary 256, 4 chips). The
    # vocabulary gradients are still reduce-scattered once per micro-batch, in the accumulation
    # loop (2 runs a step; the layers' run in the layer loop within it, 2 x 2), so the
    # accumulator stays a shard: the pass did not move them out of the loop.
    out = tmp_path / "r.json"
    proc = run_module(["launch.compile", "--topology=v5e:2x2", *ACCUM, f"--out={out}"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["fits"]
    scatters = [c for c in r["collectives"] if c["kind"] == "reduce-scatter"]
    assert all(c["in_loop"] for c in scatters), scatters
    assert {c["executions"] for c in scatters} == {2, 4}, scatters


@libtpu_test
def test_a_compiler_failure_is_one_paragraph_with_the_settings(tmp_path):
    # A cheap real failure: libtpu refuses a compile option it does not know, before compiling.
    script = textwrap.dedent("""
        import sys

        import jax
        from absl import app

        from jaxscale import cli
        from jaxscale.launch import compile as entry

        compile = jax.stages.Lowered.compile

        def refused(self, compiler_options=None, **kw):
            options = {**(compiler_options or {}), "xla_no_such_option_here": True}
            return compile(self, compiler_options=options, **kw)

        jax.stages.Lowered.compile = refused
        sys.argv = ["launch.compile", *sys.argv[1:]]
        app.run(entry.main, flags_parser=cli.parse_flags)
    """)
    proc = run(["-c", script, "--topology=v5e:2x2", *ACCUM], tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    err = proc.stderr[proc.stderr.index("jaxscale: error:"):]
    assert err.startswith("jaxscale: error: libtpu failed to compile the train step for "
                          "v5e:2x2 with mesh fsdp=4, rules_preset=fsdp, remat=none, "), err
    assert "precision=bf16-mixed, grad_accum=2, batch 16 x 64: INVALID_ARGUMENT: No such " \
           "compile option: 'xla_no_such_option_here'. This is the compiler's own failure" in err
    assert "Traceback" not in proc.stderr and len(err.strip().splitlines()) == 1


def test_the_barrier_changes_no_value_of_an_accumulated_step(monkeypatch):
    # On CPU (no libtpu): one bf16-mixed step of 2 micro-batches on data=2 x fsdp=4, with the
    # vocabulary gradients' reduce-scatters behind `settle`'s barrier and without it, gives
    # the same loss, gradient norm and parameters to the bit. (That accumulation equals the
    # large batch is test_parallel_equivalence's.)
    import jax
    import numpy as np

    from configs.tiny_lm import get_config
    from jaxscale.models.nn import shard_sums
    from jaxscale.train.loop import Trainer

    def step(settle) -> tuple:
        monkeypatch.setattr(shard_sums, "settle", settle)
        c = get_config("test")
        c.mesh.update(data=2, fsdp=4)
        c.model.num_layers = 1
        c.precision = "bf16-mixed"
        c.train.update(grad_accum=2, eval_every=0)
        trainer = Trainer.build(c, None)
        batch = trainer.to_global(next(trainer.batches.iterator()))
        state, metrics = trainer.train_fn(trainer.state, batch)
        return jax.device_get((metrics["loss"], metrics["grad_norm"], state.params))

    settled = []
    barrier = shard_sums.settle
    with_barrier = step(lambda g: settled.append(g.shape) or barrier(g))
    assert len(settled) == 2  # the embedding's and the LM head's gradients, traced once each
    without = step(lambda g: g)
    for got, want in zip(jax.tree.leaves(with_barrier), jax.tree.leaves(without)):
        np.testing.assert_array_equal(got, want)
