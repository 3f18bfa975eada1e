"""Hostile Hugging Face directories for `make chaos` (issue 44, faults round four): tiny
checkpoints written with numpy (no torch), then broken one way each: a config.json that
undercounts the layers, NaN / inf weights, a wrong-shaped tensor in a later layer or in one
expert (GPT-OSS's fused `gate_up_proj` and its bias, and its MXFP4 `*_blocks` / `*_scales`
included), a non-numeric field, a config.json that is not an object, more experts per token than
experts. Each must be one `jaxscale: error:` paragraph naming the file and the tensor or field,
from `convert`, `hf.load` and `generate --from_hf` alike, with nothing written."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import numpy as np

LLAMA = dict(model_type="llama", vocab_size=64, hidden_size=16, intermediate_size=32,
             num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=64, tie_word_embeddings=False)
MOE = dict(LLAMA, num_experts_per_tok=2, router_aux_loss_coef=0.0)
FAMILIES = {
    "llama": LLAMA,
    "mixtral": dict(MOE, model_type="mixtral", num_local_experts=4),
    "qwen3_moe": dict(MOE, model_type="qwen3_moe", num_experts=4, moe_intermediate_size=8,
                      head_dim=8),
}
# GPT-OSS: experts stacked in one tensor per layer, gate and up interleaved in `gate_up_proj`;
# widths of 32 so that the MXFP4 variant (`*_blocks` / `*_scales`, 32 values a block) fits.
GPT_OSS = dict(LLAMA, model_type="gpt_oss", hidden_size=32, intermediate_size=32, head_dim=16,
               num_local_experts=4, num_experts_per_tok=2, sliding_window=4)


def tiny_hf(path: str, family: str = "llama") -> str:
    """A random `family` checkpoint at `path` (config.json + model.safetensors), via hf.save."""
    from jaxscale.interop import hf
    from jaxscale.weights.tree import unflatten

    hf_cfg = GPT_OSS if family.startswith("gpt_oss") else FAMILIES[family]
    if family == "llama":
        from jaxscale.interop.hf_config import llama_config_from_hf as from_hf
        model_cfg = from_hf(hf_cfg)
    elif family.startswith("gpt_oss"):
        from jaxscale.interop.hf_gpt_oss import gpt_oss_config_from_hf
        model_cfg = gpt_oss_config_from_hf(hf_cfg)
    else:
        from jaxscale.interop.hf_moe import moe_config_from_hf as from_hf
        model_cfg = from_hf(hf_cfg, name=family)
    rng = np.random.default_rng(0)
    shapes = hf._model_def(model_cfg).shapes()
    params = {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in shapes.items()}
    hf.save((model_cfg, unflatten(params)), path)
    if family == "gpt_oss_mxfp4":
        _pack_mxfp4(path, model_cfg["num_layers"])
    return path


def _pack_mxfp4(path: str, layers: int) -> None:
    """The experts' weights stored as the published GPT-OSS checkpoints store them: MXFP4
    blocks (..., rows, G, 16) and scales (..., rows, G) of each (..., 32 G, rows) tensor."""
    from safetensors.numpy import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    rng = np.random.default_rng(1)
    for i in range(layers):
        for proj in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{i}.mlp.experts.{proj}"
            *lead, cols, rows = tensors.pop(name).shape
            tensors[name + "_blocks"] = rng.integers(0, 256, (*lead, rows, cols // 32, 16),
                                                     dtype=np.uint8)
            tensors[name + "_scales"] = rng.integers(122, 129, (*lead, rows, cols // 32),
                                                     dtype=np.uint8)
    save_file(tensors, file, metadata={"format": "pt"})
    edit_config(path, _set(quantization_config={"quant_method": "mxfp4"}))


def edit_config(path: str, change: Callable[[dict], object]) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg = change(cfg)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


def edit_tensor(path: str, name: str, change: Callable[[np.ndarray], np.ndarray]) -> None:
    from safetensors.numpy import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    assert name in tensors, (name, sorted(tensors)[:5])
    tensors[name] = np.ascontiguousarray(change(tensors[name]))
    save_file(tensors, file, metadata={"format": "pt"})


def _set(**fields) -> Callable[[dict], dict]:
    return lambda cfg: {**cfg, **fields}


def _nan(w: np.ndarray) -> np.ndarray:
    w = w.copy()
    w.flat[3] = np.nan
    return w


def _inf(w: np.ndarray) -> np.ndarray:
    w = w.copy()
    w.flat[0] = -np.inf
    return w


# (what is wrong, family, config edit or None, (tensor, edit) or None, words the error names)
HOSTILE = [
    ("num_hidden_layers smaller than the tensors present", "llama",
     _set(num_hidden_layers=1), None, ["num_hidden_layers", "model.layers.1."]),
    ("a NaN weight in layer 1", "llama", None,
     ("model.layers.1.mlp.down_proj.weight", _nan), ["model.layers.1.mlp.down_proj.weight",
                                                     "NaN"]),
    ("an inf weight in the embedding", "llama", None,
     ("model.embed_tokens.weight", _inf), ["model.embed_tokens.weight", "inf"]),
    ("a wrong-shaped tensor in layer 1", "llama", None,
     ("model.layers.1.self_attn.o_proj.weight", lambda w: w[:, :-1]),
     ["model.layers.1.self_attn.o_proj.weight", "shape"]),
    ("a wrong-shaped tensor in one expert (Mixtral)", "mixtral", None,
     ("model.layers.1.block_sparse_moe.experts.2.w1.weight", lambda w: w[:-1]),
     ["model.layers.1.block_sparse_moe.experts.2.w1.weight", "shape"]),
    ("more expert tensors than num_local_experts (Mixtral)", "mixtral",
     _set(num_local_experts=3), None, ["num_local_experts", "experts.3"]),
    ("a non-numeric num_hidden_layers", "llama", _set(num_hidden_layers="two"), None,
     ["num_hidden_layers", "'two'"]),
    ("a config.json that is not an object", "llama", lambda cfg: [cfg], None,
     ["config.json", "object"]),
    ("Qwen3-MoE num_experts_per_tok > num_experts", "qwen3_moe",
     lambda cfg: {**{k: v for k, v in cfg.items() if k != "num_local_experts"},
                  "num_experts": 4, "num_experts_per_tok": 5}, None,
     ["num_experts_per_tok", "num_experts=4"]),
    ("GPT-OSS gate_up_proj (gate and up interleaved) narrower in layer 1", "gpt_oss", None,
     ("model.layers.1.mlp.experts.gate_up_proj", lambda w: w[..., :-2]),
     ["model.layers.1.mlp.experts.gate_up_proj", "shape"]),
    ("GPT-OSS gate_up_proj_bias narrower in layer 1", "gpt_oss", None,
     ("model.layers.1.mlp.experts.gate_up_proj_bias", lambda w: w[..., :-2]),
     ["model.layers.1.mlp.experts.gate_up_proj_bias", "shape"]),
    ("GPT-OSS MXFP4 gate_up_proj_blocks with a row too few", "gpt_oss_mxfp4", None,
     ("model.layers.1.mlp.experts.gate_up_proj_blocks", lambda w: w[:, :-1]),
     ["model.layers.1.mlp.experts.gate_up_proj_blocks", "shape"]),
    ("GPT-OSS MXFP4 down_proj_scales for another width", "gpt_oss_mxfp4", None,
     ("model.layers.0.mlp.experts.down_proj_scales", lambda w: np.concatenate([w, w], -1)),
     ["model.layers.0.mlp.experts.down_proj_scales", "shape"]),
]


def hostile_dirs(tmp: str) -> list[tuple[str, str, list[str]]]:
    """(what is wrong, HF directory, words its error must name), built under `tmp`."""
    import shutil

    clean: dict[str, str] = {}
    out = []
    for i, (what, family, config_edit, tensor_edit, words) in enumerate(HOSTILE):
        if family not in clean:
            clean[family] = tiny_hf(os.path.join(tmp, f"clean-{family}"), family)
        path = os.path.join(tmp, f"hostile-{i}")
        shutil.rmtree(path, ignore_errors=True)
        shutil.copytree(clean[family], path)
        if config_edit is not None:
            edit_config(path, config_edit)
        if tensor_edit is not None:
            edit_tensor(path, *tensor_edit)
        out.append((what, path, words))
    return out


def refused_in_process(path: str, words: list[str], out: str) -> str:
    """`convert.hf_to_workdir` and `hf.load` refuse `path` in one paragraph naming `words`;
    `out` is not created."""
    from jaxscale.errors import JaxscaleError
    from jaxscale.interop import convert, hf

    said = ""
    for name, fn in (("convert", lambda: convert.hf_to_workdir(path, out)),
                     ("hf.load", lambda: hf.load(path))):
        try:
            fn()
        except JaxscaleError as e:
            said = str(e)
        else:
            raise AssertionError(f"{name} accepted {path}")
        assert "\n" not in said, said
        missing = [w for w in words if w not in said]
        assert not missing, f"{name}'s error does not name {missing}: {said}"
    assert not os.path.exists(out), f"{out} was written"
    return said[:160]


def refused_by_cli(path: str, words: list[str], out: str, generate: bool = False) -> str:
    """`jaxscale convert --from_hf` (or `generate --from_hf`): exit 2, one paragraph naming
    `words`, no traceback, `out` not created."""
    from bench.chaos_harness import COMMAND_TIMEOUT_S, JAXSCALE, one_paragraph, run

    cmd = (["generate", f"--from_hf={path}", "--prompt_ids=1,2,3", "--steps=2"] if generate
           else ["convert", f"--from_hf={path}", f"--out={out}"])
    status, text = run([*JAXSCALE, *cmd], timeout=COMMAND_TIMEOUT_S)
    assert status == 2, f"exit {status}, want 2: {text[-400:]}"
    said = one_paragraph(text)
    line = text[text.index("jaxscale: error:"):].split("\n")[0]
    missing = [w for w in words if w not in line]
    assert not missing, f"the error does not name {missing}: {line}"
    assert not os.path.exists(out), f"{out} was written"
    return said


def overwrite_refused(tmp: str) -> str:
    """`convert --out` / `--to_hf` into a non-empty directory: exit 2, one paragraph, the
    files untouched; with --overwrite, replaced."""
    from bench.chaos_harness import COMMAND_TIMEOUT_S, ENV, JAXSCALE, one_paragraph, run

    hf_dir = tiny_hf(os.path.join(tmp, "overwrite-hf"))
    out, export = os.path.join(tmp, "overwrite-out"), os.path.join(tmp, "overwrite-export")
    for d, name in ((out, "model_config.json"), (export, "config.json")):
        os.makedirs(d)
        with open(os.path.join(d, name), "w") as f:
            f.write('{"mine": true}')
    said = []
    for cmd, d, name in ((["convert", f"--from_hf={hf_dir}", f"--out={out}"], out,
                          "model_config.json"),
                         (["convert", f"--from_workdir={out}", f"--to_hf={export}"], export,
                          "config.json")):
        status, text = run([*JAXSCALE, *cmd], timeout=COMMAND_TIMEOUT_S)
        assert status == 2, f"exit {status}, want 2: {text[-400:]}"
        said.append(one_paragraph(text))
        assert "--overwrite" in text, text[-400:]
        with open(os.path.join(d, name)) as f:
            assert f.read() == '{"mine": true}', f"{d}/{name} was replaced"
        assert os.listdir(d) == [name], os.listdir(d)
    status, text = run([*JAXSCALE, "convert", f"--from_hf={hf_dir}", f"--out={out}",
                        "--overwrite"], timeout=COMMAND_TIMEOUT_S)
    assert status == 0 and "INVALID_ARGUMENT" not in text, f"exit {status}: {text[-400:]}"
    host = {k: v for k, v in ENV.items() if k != "JAX_PLATFORMS"}  # libtpu must stay quiet
    status, text = run([*JAXSCALE, "convert", f"--from_workdir={out}", f"--to_hf={export}",
                        "--overwrite"], env=host, timeout=COMMAND_TIMEOUT_S)
    assert status == 0 and "INVALID_ARGUMENT" not in text, f"exit {status}: {text[-400:]}"
    return "; ".join(s[:100] for s in said)


def scenario_hostile_hf(results, tmp: str) -> None:
    from bench.chaos_harness import check

    invariant = "exit 2, one paragraph naming the file and the tensor or field, nothing written"
    for i, (what, path, words) in enumerate(hostile_dirs(tmp)):
        check(results, "hostile HF directory", f"convert: {what}", invariant,
              lambda p=path, w=words, i=i: refused_by_cli(p, w, f"{tmp}/hostile-out-{i}"))
    for i, (what, path, words) in enumerate(hostile_dirs(tmp)):
        if "NaN" in what or "shape" in what:
            check(results, "hostile HF directory", f"generate --from_hf: {what}", invariant,
                  lambda p=path, w=words, i=i: refused_by_cli(p, w, f"{tmp}/hostile-gen-{i}",
                                                              generate=True))
    for family in FAMILIES:
        check(results, "hostile HF directory", f"every {family} config.json field set to each "
              f"of {len(BAD_VALUES)} bad values", "read, or one paragraph: no other exception",
              lambda f=family: fuzz_config(tmp, f))
    check(results, "convert overwrites", "--out / --to_hf into a directory with a user's file",
          "exit 2, one paragraph naming --overwrite, the files untouched; --overwrite replaces",
          lambda: overwrite_refused(tmp))


BAD_VALUES = ("x", [], {}, None, -1, 0, 1e30, True, 2.5, float("nan"))


def fuzz_config(tmp: str, family: str) -> str:
    """Every field of a tiny `family` config.json set, in turn, to each of `BAD_VALUES`:
    `hf.load` either reads it or refuses it in one paragraph (a JaxscaleError), never another
    exception."""
    import shutil

    from jaxscale.errors import JaxscaleError
    from jaxscale.interop import hf

    clean = tiny_hf(os.path.join(tmp, f"fuzz-clean-{family}"), family)
    with open(os.path.join(clean, "config.json")) as f:
        keys = sorted(json.load(f))
    crashes, refused = [], 0
    path = os.path.join(tmp, f"fuzz-{family}")
    for key in keys:
        for value in BAD_VALUES:
            shutil.rmtree(path, ignore_errors=True)
            shutil.copytree(clean, path)
            edit_config(path, lambda cfg, k=key, v=value: {**cfg, k: v})
            try:
                hf.load(path)
            except JaxscaleError as e:
                refused += 1
                assert "\n" not in str(e), str(e)
            except Exception as e:  # the finding: any other exception is a traceback
                crashes.append(f"{key}={value!r}: {type(e).__name__}: {str(e)[:80]}")
    assert not crashes, f"{len(crashes)} tracebacks: {crashes[:4]}"
    return f"{len(keys) * len(BAD_VALUES)} edits, {refused} refused in one paragraph"
