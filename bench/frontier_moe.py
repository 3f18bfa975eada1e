"""Frontier MoE models compiled for TPU pods on this machine (libtpu, nothing runs; issue 43).

For each record: compiles the step (cached like the planner's, `aot.search.compile_cached`, so
a record that `jaxscale plan` compiled is read back) and prints the compiled memory per chip
against HBM and against the analytic memory model (`aot.guess.remat_bytes`, the planner's
guess, and its uncalibrated count), the FLOPs per chip per step as the HLO has them (grouped
matmuls at their static rows, and at the routed rows: `StepReport.step_flops`) against the
analytic count, and the roofline step ESTIMATE. The analytic count is checked twice: the
model table's (`models/decoder/flops.py`, what `jaxscale compile` reports) against one written
out here from the config alone (`independent_flops_per_token`: latent attention's low-rank
q / kv projections and decoupled rope dims, the dense first layers, routed, shared experts and
the router), so an error in either shows.

    python bench/frontier_moe.py [--only="NAME;..."] [--cache_dir=DIR] [--code_root=DIR] [--list]
        [--saved="NAME=report.json;..."]

Each record's command line is printed with it (bench/RESULTS.md, "Frontier MoE on TPU pods").
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from jaxscale.aot.topology import compile_only_env

compile_only_env()

# name -> (config, topology, overrides). Fine-tuning: the published weights trained in full
# (bf16-mixed, AdamW), 4,096-token sequences, one a chip at once, 8 micro-batches a step.
_FT = {"data.batch_size": 64, "train.grad_accum": 8, "train.eval_every": 0,
       "model.attention": "splash"}
RECORDS: dict[str, tuple[str, str, dict]] = {
    "gpt-oss-20b,v5p-16": ("gpt_oss:20b", "v5p:2x2x2",
                           {**_FT, "mesh.fsdp": 4, "mesh.expert": 2}),
    "deepseek-v2-lite,v5p-16": ("deepseek:v2-lite", "v5p:2x2x2",
                                {**_FT, "mesh.fsdp": 4, "mesh.expert": 2}),
    # Pre-training at the preset's recipe (256 x 4,096 tokens a step), one sequence a chip.
    # DeepSeek-V3 on v5p-512 (256 chips), the capacity path (dropless does not fit here: its
    # worst-case receive buffers alone are over HBM), one sequence a chip, 60 micro-batches.
    "deepseek-v3,v5p-512": ("deepseek:v3", "v5p:4x8x8",
                            {"mesh.fsdp": 16, "mesh.expert": 16, "train.grad_accum": 60,
                             "train.eval_every": 0, "model.attention": "splash",
                             "model.moe.capacity_factor": 1.25}),
    # The plan's winner there (`jaxscale plan --topology=v5p --config=deepseek:v3
    # --config.model.moe.capacity_factor=1.25 --max_candidates=4 --workers=1`).
    "deepseek-v3,v5p-512,plan": ("deepseek:v3", "v5p:4x8x8",
                                 {"mesh.fsdp": 8, "mesh.tensor": 4, "rules_preset": "fsdp_tp",
                                  "model.attention": "splash", "model.loss_chunks": 8,
                                  "precision": "bf16-mixed,logits=bfloat16",
                                  "train.grad_accum": 120, "train.eval_every": 0,
                                  "mesh.expert": 8, "model.moe.capacity_factor": 1.25}),
    "gpt-oss-120b,v5p-128": ("gpt_oss:120b", "v5p:4x4x4",
                             {"mesh.fsdp": 16, "mesh.expert": 4, "train.grad_accum": 4,
                              "train.eval_every": 0, "model.attention": "splash"}),
    "gpt-oss-120b,v6e-256": ("gpt_oss:120b", "v6e:16x16",
                             {"mesh.fsdp": 64, "mesh.expert": 4, "train.eval_every": 0,
                              "model.attention": "splash"}),
}


def independent_flops_per_token(m: dict, seq_len: int) -> float:
    """PaLM-convention training FLOPs per token written out from `config.model` alone: 6 per
    matmul parameter a token passes through plus 6·H·(Q + V)·K for QK^T and AV (12·H·D·K when
    Q = V = D), K the keys a query sees (T, or the window on a sliding-window layer), summed
    layer by layer."""
    e, h, layers = m["embed"], m["num_heads"], m["num_layers"]
    moe, mla = m.get("moe") or {}, m.get("mla") or {}
    if m.get("attention_kind") == "latent":
        rope, nope, v = mla["qk_rope_head_dim"], mla["qk_nope_head_dim"], mla["v_head_dim"]
        q_rank, kv_rank = mla["q_lora_rank"], mla["kv_lora_rank"]
        q = e * q_rank + q_rank * h * (nope + rope) if q_rank else e * h * (nope + rope)
        kv = e * (kv_rank + rope) + kv_rank * h * (nope + v)  # compressed kv + shared rope key
        attn, qk, vd = q + kv + h * v * e, nope + rope, v
    else:
        d, kvh = m["head_dim"], m["num_kv_heads"]
        attn, qk, vd = 2 * e * h * d + 2 * e * kvh * d, d, d
    dense_mlp = 3 * e * m["mlp"]
    experts = moe.get("num_experts", 0)
    width = moe.get("mlp") or m["mlp"]
    active = 3 * e * width * (moe.get("experts_per_token", 0) + moe.get("shared_experts", 0))
    first_dense = moe.get("first_k_dense_replace", 0) if experts else layers
    window = m.get("sliding_window") or 0
    kinds = m.get("layer_types") or (["sliding_attention"] * layers if window else [])
    total = 0.0
    for i in range(layers):
        ffn = dense_mlp if i < first_dense else active + e * experts  # + the router
        # a sliding-window layer's query sees at most `window` keys (GPT-OSS: every other layer)
        keys = min(window, seq_len) if i < len(kinds) and kinds[i] == "sliding_attention" \
            else seq_len
        total += 6 * (attn + ffn) + 6 * h * (qk + vd) * keys
    return total + 6 * e * m["vocab_size"]


def build(name: str):
    from jaxscale.aot.plan import apply
    from jaxscale.aot.topology import parse_topology

    config_arg, topo, overrides = RECORDS[name]
    config = apply(_config(config_arg), overrides)
    return config, parse_topology(topo)


def _config(arg: str):
    from jaxscale.configs import deepseek, gpt_oss

    family, size = arg.split(":")
    return {"gpt_oss": gpt_oss, "deepseek": deepseek}[family].get_config(size)


def command(name: str) -> str:
    config_arg, topo, overrides = RECORDS[name]
    flags = " ".join(f"--config.{k}={v}" for k, v in overrides.items())
    return f"jaxscale compile --topology={topo} --config={config_arg} {flags}"


def report(name: str, cache_dir: str, saved: str = "") -> dict:
    from jaxscale.aot import guess
    from jaxscale.aot.memory import BF16, state_bytes_per_param, step_bytes
    from jaxscale.aot.plan import fits
    from jaxscale.aot.search import compile_cached
    from jaxscale.hardware import hbm_budget
    from jaxscale.models import entry_of

    config, topology = build(name)
    r = (json.load(open(saved)) if saved else
         compile_cached(json.dumps(config.to_dict(), default=list), topology, cache_dir))
    gib = lambda n: n / 2**30
    print(f"\n== {name}: {command(name)}")
    if "error" in r or "over_hbm" in r:
        print(f"  {r.get('error') or r['over_hbm']}: {gib(r.get('total_bytes', 0)):.2f} GiB")
        return r
    r = {**r, **analytic(config, r)}
    mesh = {k: v for k, v in r["mesh"].items() if v > 1}
    budget = hbm_budget(r["hbm_limit_bytes"] or r["hbm_bytes"], 0.1)
    dims = guess.dims_of(config)
    accum = config.train.grad_accum
    guessed = guess.remat_bytes(config, dims, dict(r["mesh"]), accum, config.model.attention,
                                max(1, config.model.get("loss_chunks", 1)), config.model.remat)
    tokens = config.data.batch_size * config.data.seq_len / (
        r["mesh"]["data"] * r["mesh"]["fsdp"] * r["mesh"].get("expert", 1) * accum)
    counted = step_bytes(dims, tokens=tokens, seq_len=config.data.seq_len,
                         state_bytes=state_bytes_per_param(accumulate=accum > 1),
                         param_shards=r["mesh"]["fsdp"], tensor=r["mesh"]["tensor"],
                         remat=config.model.remat, einsum_scores=False,
                         loss_chunks=max(1, config.model.get("loss_chunks", 1)),
                         expert=r["mesh"].get("expert", 1))
    print(f"  {topology.num_chips} chips, mesh {mesh}, compiled in {r['compile_s']:.0f} s")
    print(f"  memory per chip: arguments {gib(r['argument_bytes']):.2f} GiB, temporaries "
          f"{gib(r['temp_bytes']):.2f} GiB, total {gib(r['total_bytes']):.2f} GiB of "
          f"{gib(r['hbm_bytes']):.2f} (budget with 10% free {gib(budget):.2f}): "
          f"{'fits' if fits(r) else 'DOES NOT FIT'}")
    print(f"  memory ESTIMATE (aot.memory, uncalibrated) {gib(counted):.2f} GiB, the planner's "
          f"guess {gib(guessed):.2f} GiB: compiled / estimate = "
          f"{r['total_bytes'] / counted:.2f}, compiled / guess = {r['total_bytes'] / guessed:.2f}")
    chips, d = r["num_chips"], config.data
    per_token = entry_of(config.model).flops_per_token(config.model, d.seq_len)
    independent = independent_flops_per_token(config.model.to_dict(), d.seq_len)
    print(f"  analytic FLOPs a token: model table {per_token:.6e}, written out here "
          f"{independent:.6e} (ratio {per_token / independent:.6f}); active matmul params "
          f"{(per_token - _attention_part(config)) / 6 / 1e9:.2f}B")
    print(f"  FLOPs per chip per step: HLO {r['flops']:.4e} (grouped matmuls at static rows "
          f"{r['grouped_flops']:.4e}), at the routed rows {r['step_flops']:.4e}; model "
          f"{r['model_flops']:.4e}, expected (model + remat) {r['expected_flops']:.4e}: "
          f"HLO / expected {r['flops'] / r['expected_flops']:.3f}, routed / expected "
          f"{r['step_flops'] / r['expected_flops']:.3f}, routed / model "
          f"{r['step_flops'] / r['model_flops']:.3f}")
    e = r["estimate"]
    print(f"  step ESTIMATE {e['full_overlap_s']:.2f}..{e['no_overlap_s']:.2f} s (compute "
          f"{e['compute_s']:.2f} s, ICI {e['ici_s']:.2f} s), MFU "
          f"{e['mfu_full_overlap']:.0%}..{e['mfu_no_overlap']:.0%}, "
          f"{d.batch_size * d.seq_len / e['no_overlap_s'] / chips:,.0f} tokens/s/chip at no "
          f"overlap; {dims.num_params / 1e9:,.1f}B parameters, "
          f"{dims.num_params * BF16 / 2**30:,.0f} GiB in bf16")
    return r


def analytic(config, r: dict) -> dict:
    """The analytic fields of a compile result, computed by this tree's `aot` (so a result
    compiled by another, `--code_root`, is read against the current count): expected FLOPs,
    the grouped matmuls at the routed rows, and the roofline estimate of those."""
    from jaxscale.aot import flops
    from jaxscale.aot.roofline import estimate
    from jaxscale.hardware import TPUS

    chips = r["num_chips"]
    routed = flops.routed_flops(config, chips) if r["grouped_flops"] else 0.0
    step = r["flops"] - r["grouped_flops"] + routed
    model = flops.model_flops(config, chips)
    chip = TPUS[r["topology"].split(":")[0]]
    e = estimate(chip, step, r["collectives"], model, r.get("int8_flops", 0.0))
    return {"expected_flops": flops.expected_flops(config, chips), "routed_flops": routed,
            "step_flops": step, "model_flops": model, "estimate": vars(e)}


def use_code_of(root: str) -> None:
    """Cache keys as the jaxscale tree at `root` computes them (`search.code_version` digests
    the sources): reads what that tree compiled (e.g. the plan's run) with this tree's counts."""
    import jaxscale
    from jaxscale.aot import search

    own = jaxscale.__file__
    jaxscale.__file__ = os.path.join(root, "jaxscale", "__init__.py")
    search.code_version.cache_clear()
    search.code_version()
    jaxscale.__file__ = own


def _attention_part(config) -> float:
    """The score FLOPs a token (PaLM: 3 x the forward QK^T and AV), for the active-parameter
    line."""
    from jaxscale.models import entry_of

    attn = entry_of(config.model).attention(config.model)
    return 3.0 * config.model.num_layers * attn.score_flops(config.data.seq_len)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="Record names, separated by ;.")
    parser.add_argument("--cache_dir", default=os.path.expanduser("~/.cache/jaxscale/plan"))
    parser.add_argument("--list", action="store_true", help="Print the records' commands.")
    parser.add_argument("--code_root", default="", help="Read results compiled by the jaxscale "
                        "tree at this root (its cache keys); the analytic counts are this one's.")
    parser.add_argument("--saved", default="", help="NAME=PATH;...: read a record from the "
                        "JSON `jaxscale compile --out=PATH` wrote for its command instead.")
    args = parser.parse_args()
    if args.code_root:
        use_code_of(args.code_root)
    saved = dict(kv.split("=", 1) for kv in args.saved.split(";") if kv)
    names = [n for n in args.only.split(";") if n] or list(RECORDS)
    for name in names:
        if args.list:
            print(f"{name}: {command(name)}")
        else:
            report(name, args.cache_dir, saved.get(name, ""))


if __name__ == "__main__":
    main()
