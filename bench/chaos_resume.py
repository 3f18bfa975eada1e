"""Round-four faults of training runs for `make chaos` (issue 44): a resume whose model fields
differ from the workdir's (refused naming the fields, `config.json` untouched), a non-finite
`moe.capacity_factor` (refused at validation, in seconds), and MoE buffers that drop most
assignments (trains, with one console warning). A tiny Mixtral (`--config=mixtral`)."""

from __future__ import annotations

import os

from bench.chaos_harness import COMMAND_TIMEOUT_S, JAXSCALE, check, one_paragraph, run

MIXTRAL = [*JAXSCALE, "train", "--config=mixtral", "--config.train.eval_every=0",
           "--config.checkpoint.every=2"]


def resume_changed(tmp: str) -> str:
    workdir = os.path.join(tmp, "resume-changed")
    status, out = run([*MIXTRAL, f"--workdir={workdir}", "--config.train.steps=2"])
    assert status == 0, f"the first run failed ({status}): {out[-600:]}"
    with open(os.path.join(workdir, "config.json")) as f:
        before = f.read()
    said = []
    for field, value in (("experts_per_token", 1), ("num_experts", 2)):
        status, out = run([*MIXTRAL, f"--workdir={workdir}", "--config.train.steps=4",
                           f"--config.model.moe.{field}={value}"], timeout=COMMAND_TIMEOUT_S)
        assert status == 2, f"exit {status}, want 2: {out[-600:]}"
        said.append(one_paragraph(out))
        assert f"model.moe.{field}: saved" in out and "strict" not in out, out[-600:]
        with open(os.path.join(workdir, "config.json")) as f:
            assert f.read() == before, "config.json was rewritten"
    return "; ".join(s[:90] for s in said)


def capacity_inf(tmp: str) -> str:
    status, out = run([*MIXTRAL, f"--workdir={tmp}/capacity-inf", "--config.train.steps=2",
                       "--config.model.moe.capacity_factor=inf"], timeout=COMMAND_TIMEOUT_S)
    assert status == 2, f"exit {status}, want 2: {out[-600:]}"
    said = one_paragraph(out)
    assert "capacity_factor" in said, said
    return said


def heavy_drops(tmp: str) -> str:
    status, out = run([*MIXTRAL, f"--workdir={tmp}/drops", "--config.train.steps=2",
                       "--config.model.moe.capacity_factor=0.05"])
    assert status == 0, f"exit {status}: {out[-600:]}"
    warnings = [line for line in out.splitlines() if line.startswith("jaxscale: warning: step")]
    assert len(warnings) == 1 and "capacity_factor" in warnings[0], out[-600:]
    return warnings[0][:160]


def scenario_resume(results, tmp: str) -> None:
    check(results, "changed model on resume", "moe.experts_per_token, then moe.num_experts, "
          "changed after a save", "exit 2, one paragraph naming the field, config.json kept",
          lambda: resume_changed(tmp))
    check(results, "MoE values", "moe.capacity_factor=inf", "exit 2 at validation, one "
          "paragraph", lambda: capacity_inf(tmp))
    check(results, "MoE values", "moe.capacity_factor=0.05 (most assignments dropped)",
          "trains, one console warning naming capacity_factor", lambda: heavy_drops(tmp))
