"""`jaxscale compile --decode_batch`: a decoding step compiled for a TPU topology, against the
bound of reading its weights and KV cache at the HBM bandwidth (`jaxscale/aot/decode.py`).

The issue's case: an 8B Llama-3-shaped model (grouped-query, 8 kv heads, 128k vocabulary) on
v5e:2x4 at batch 64. Tensor-parallel weights decode within 1.3x of the bound (each layer
all-reduces its output, a small payload); the training mesh's FSDP gathers every weight for
each token and lands far above it, which the report makes plain.
"""

from __future__ import annotations

import json

from aot_common import libtpu_test, run_module

LLAMA3_8B = ["--config=configs/llama.py:7b", "--config.model.num_kv_heads=8",
             "--config.model.vocab_size=128256", "--config.model.mlp=14336",
             "--config.precision=bf16-true", "--config.mesh.data=1"]


def _decode(tmp_path, *flags: str) -> dict:
    out = tmp_path / "report.json"
    done = run_module(["jaxscale.launch.compile", "--topology=v5e:2x4", *LLAMA3_8B, *flags,
                       "--decode_only", "--decode_batch=64", "--decode_context=2048",
                       f"--out={out}"], tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Decode step (ESTIMATE), batch 64, cache of 2048 positions" in done.stdout
    return json.loads(out.read_text())["decode"]


@libtpu_test
def test_tensor_parallel_decoding_is_within_1_3x_of_the_bandwidth_bound(tmp_path):
    tp = _decode(tmp_path, "--config.rules_preset=tp", "--config.mesh.tensor=8",
                 "--config.mesh.fsdp=1")
    params = 8_030_261_248  # Llama-3-8B with untied embeddings, bf16, split 8 ways
    assert abs(tp["weight_bytes"] - 2 * params / 8) / (2 * params / 8) < 0.01
    cache = 32 * 64 * 2048 * 2 * 8 * 128 * 2 / 8  # layers, rows, slots, k and v, kv heads x dim
    assert cache <= tp["cache_bytes"] <= cache * 1.02  # (+ the slots' segment ids)
    assert tp["weight_bytes"] + tp["cache_bytes"] <= tp["argument_bytes"] * 1.001
    assert 1.0 <= tp["ratio"] <= 1.3, tp["ratio"]
    kinds = {c["kind"] for c in tp["collectives"]}
    assert "all-reduce" in kinds and tp["collective_s"] > 0

    fsdp = _decode(tmp_path, "--config.mesh.fsdp=8")
    gathered = sum(c["bytes"] * c["executions"] for c in fsdp["collectives"]
                   if c["kind"] == "all-gather")
    assert gathered > 0.8 * 2 * params  # every weight, gathered for one token
    assert fsdp["ratio"] > 5 * tp["ratio"]
