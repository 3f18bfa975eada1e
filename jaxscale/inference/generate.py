"""Autoregressive generation with the model's cache, behind `jaxscale generate`.

The cache belongs to the model: `model.init_cache(batch, max_len)` makes an empty cache stacked
over the layers, in the layout of the model's attention component (`models/attention/kinds.py`;
grouped-query: keys and values of (layers, batch, max_len, kv, head_dim)), and
`model(tokens, cache=..., cache_index=...)` runs the model's own attention (the one used for
training) over it, returning the logits and the updated cache. Nothing here opens the cache.
It carries logical names, so the same rules that shard the parameters shard it (`batch` over
data/fsdp, `kv` over tensor). Prompts of different lengths share a batch left-padded, with their
lengths: padding gets segment id 0 and each row's positions start at its first real token, so
every row decodes as its prompt would alone. `make_generate` is one jitted call running the
prefill and a `lax.scan` over the new tokens (greedy or temperature); `generate_from_config`,
the command's path, runs the rollout sampler (`jaxscale/inference/sampling.py`: top-k / top-p, n samples,
stop ids, log-probs), kept per config so repeated calls do not compile again.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxscale.errors import paragraph
from jaxscale.inference.sampling import (
    GenerateError,
    Sampler,
    Sampling,
    forward_cached,
    left_padded_rows,
)
from jaxscale.models import ModelDef, entry_of
from jaxscale.rules import AxisRules, use_rules


def sample(logits_BV: jax.Array, rng: jax.Array, temperature: float) -> jax.Array:
    """Greedy (temperature 0) or softmax sampling at `temperature`."""
    logits_BV = logits_BV.astype(jnp.float32)
    if temperature == 0.0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    return jax.random.categorical(rng, logits_BV / temperature, axis=-1).astype(jnp.int32)


def make_generate(model_def: ModelDef, steps: int, temperature: float = 0.0,
                  rules: AxisRules | None = None, mesh: Mesh | None = None):
    """A jitted `fn(params, prompt_BT, rng, lengths_B=None) -> tokens (B, T + steps)` (prompt
    included). With `lengths_B`, the prompts are left-padded to T (see `left_padded_rows`)."""
    check_request(1, steps, temperature, max_len=0)

    def generate(params: Mapping, prompt_BT: jax.Array, rng: jax.Array,
                 lengths_B: jax.Array | None = None) -> jax.Array:
        model = model_def.module(params)
        b, t = prompt_BT.shape
        cache = model.init_cache(b, t + steps)
        ragged = lengths_B is not None
        prefill = left_padded_rows(lengths_B, t) if ragged else {}
        logits_BTV, cache = forward_cached(model, prompt_BT, jnp.int32(0), cache, **prefill)
        rngs = jax.random.split(rng, steps)
        first = sample(logits_BTV[:, -1], rngs[0], temperature)

        def step(carry, xs):
            token_B, cache = carry
            pos, key = xs
            rows = dict(positions_BT=(pos - t + lengths_B)[:, None],
                        segments_BT=jnp.ones((b, 1), jnp.int32)) if ragged else {}
            logits, cache = forward_cached(model, token_B[:, None], pos, cache, **rows)
            nxt = sample(logits[:, -1], key, temperature)
            return (nxt, cache), token_B

        positions = t + jnp.arange(steps - 1, dtype=jnp.int32)
        (last, _), tokens_NB = jax.lax.scan(step, (first, cache), (positions, rngs[1:]))
        new_BN = jnp.concatenate([tokens_NB.T, last[:, None]], axis=1)
        return jnp.concatenate([prompt_BT.astype(jnp.int32), new_BN], axis=1)

    def run(params: Mapping, prompt_BT: jax.Array, rng: jax.Array,
            lengths_B: jax.Array | None = None) -> jax.Array:
        if rules is None or mesh is None:
            return generate(params, prompt_BT, rng, lengths_B)
        with use_rules(rules, mesh):
            return generate(params, prompt_BT, rng, lengths_B)

    return jax.jit(run)


def parse_prompt(text: str, ids: list[str], vocab_size: int, tokenizer: Any = None
                 ) -> list[int]:
    """Prompt token ids from `--prompt` text (encoded by the model's tokenizer, or as bytes for
    a byte-level model without one) or from `--prompt_ids`, checked."""
    if text and ids:
        raise GenerateError(paragraph(
            "Both --prompt and --prompt_ids were given; they are two spellings of the prompt.",
            "Keep --prompt for text (encoded with the model's tokenizer) or --prompt_ids for",
            "token ids, not both.",
        ))
    if ids:
        try:
            tokens = [int(str(i).strip()) for i in ids]
        except ValueError:
            raise GenerateError(paragraph(
                f"--prompt_ids={','.join(map(str, ids))!r} is not a comma-separated list of",
                "integers. Give token ids such as --prompt_ids=1,15043,29892, or text with",
                "--prompt when the model carries its tokenizer.",
            )) from None
        bad = [t for t in tokens if not 0 <= t < vocab_size]
        if bad:
            raise GenerateError(paragraph(
                f"--prompt_ids holds {bad[:5]}, outside the model's vocabulary [0, {vocab_size}).",
                "Use ids from the tokenizer the model was trained with.",
            ))
        return tokens
    if tokenizer is None and vocab_size != 256:
        raise GenerateError(paragraph(
            "--prompt text needs the model's tokenizer (only byte-level models, vocab_size 256,",
            f"read it as bytes), and this model (vocab_size={vocab_size}) carries none: its directory has no tokenizer.json / tokenizer.model and its config",
            "names no data.tokenizer. Copy the tokenizer into the directory, or tokenize the",
            "prompt yourself and pass --prompt_ids=ID,ID,...",
        ))
    if tokenizer is None:
        tokens = list(text.encode())
    else:
        tokens = tokenizer.encode(text)
        if tokenizer.bos_id is not None:
            tokens = [tokenizer.bos_id] + list(tokens)
    if not tokens:
        raise GenerateError("The prompt is empty: give --prompt text or --prompt_ids=ID,ID,...")
    return tokens


def chat_prompt(text: str, config: Any, *dirs: str) -> list[int]:
    """The ids of `text` as one user turn rendered with the model's chat template and its
    generation prompt (`jaxscale generate --chat`): the template of the first of `dirs` that
    carries a tokenizer, else of the training config's `data.tokenizer` (and
    `data.chat_template`)."""
    from jaxscale.data.chat import encoder
    from jaxscale.data.tokenizer import run_tokenizer_dir

    config_dict = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    directory = run_tokenizer_dir(config_dict, *dirs)
    if directory is None:
        raise GenerateError(paragraph(
            "--chat renders the prompt with the model's chat template, and this model carries",
            "no tokenizer (its directory has no tokenizer.json and its config names no",
            "data.tokenizer). Generate from a model trained or converted with a chat",
            "tokenizer, or give the rendered ids with --prompt_ids."))
    own = any(d and os.path.realpath(d) == os.path.realpath(directory) for d in dirs)
    template = "" if own else config_dict.get("data", {}).get("chat_template", "")
    return encoder(directory, template).prompt_ids([{"role": "user", "content": text}]).tolist()


def check_request(prompt_len: int, steps: int, temperature: float, max_len: int) -> None:
    """Rejects a non-positive step count, a negative temperature or an over-long context."""
    if steps < 1:
        raise GenerateError(f"--steps (or --max_new_tokens) = {steps}: generate at least one "
                            "token, e.g. --steps=32.")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise GenerateError(f"--temperature={temperature}: use 0 for greedy decoding or a "
                            "positive value (e.g. 0.8) for sampling.")
    if max_len and prompt_len >= max_len:
        raise GenerateError(paragraph(
            f"The prompt is {prompt_len} tokens, which leaves no position for a new one within",
            f"model.max_len={max_len} (the longest context the model was trained for). Shorten",
            f"the prompt to at most {max_len - 1} tokens.",
        ))
    if max_len and prompt_len + steps > max_len:
        raise GenerateError(paragraph(
            f"The prompt ({prompt_len} tokens) plus {steps} new tokens is {prompt_len + steps}",
            f"positions, more than model.max_len={max_len} (the longest context the model was",
            f"trained for). Generate at most {max_len - prompt_len} tokens or shorten the",
            "prompt.",
        ))


def load_model(workdir: str = "", hf_dir: str = "") -> tuple[Any, dict]:
    """(run config, params) from a training workdir, a launch.convert output or a HF dir,
    read through `weights.sources` (HF leaves stay lazy until placed on the mesh).

    A training workdir brings its own mesh, rules and precision; the other two use the
    defaults of `base_config()` with the model fields they carry.
    """
    from jaxscale.config import base_config
    from jaxscale.interop import convert
    from jaxscale.weights.sources import open_huggingface
    from jaxscale.weights.tree import unflatten

    config = base_config()
    if hf_dir:
        source = open_huggingface(hf_dir)
        config.model.update(source.model_cfg)
        params = unflatten(source.lazy_leaves(np.float32))
    else:
        model_cfg, lora_cfg = convert.read_model_config(workdir, "--workdir")
        params = convert.workdir_params(workdir, lora_cfg)
        if os.path.exists(os.path.join(workdir, "config.json")):
            from jaxscale.inference.evaluate import read_config
            config = read_config(workdir)
        config.model.update(model_cfg)
    if not hasattr(entry_of(config.model).module_cls, "init_cache"):  # no KV cache to decode
        raise GenerateError(f"model.name={config.model.name!r}: generation needs a decoder LM "
                            "(a Llama); image classifiers have nothing to generate.")
    return config, params


def model_on_mesh(config: Any) -> tuple[ModelDef, AxisRules, Mesh, Any, Any]:
    """(model definition, rules, mesh, parameter shardings, parameter dtype) of a run config:
    where every use of trained weights outside training puts them."""
    from jaxscale.mesh import make_mesh
    from jaxscale.precision import get_policy
    from jaxscale.weights.place import named_shardings, param_specs

    mesh, rules = make_mesh(config.mesh), AxisRules.from_config(config)
    model_def = ModelDef.build(config.model, get_policy(config.precision))
    shardings = named_shardings(mesh, param_specs(model_def, rules, mesh))
    return model_def, rules, mesh, shardings, model_def.shapes()["embedding"].dtype


def place_params(params: Mapping, shardings: Any, dtype: Any) -> Mapping:
    """`params` (a nested tree, its leaves lazy or not) put where `shardings` say, in `dtype`."""
    from jaxscale.weights.place import place
    from jaxscale.weights.tree import flatten, unflatten

    return unflatten(place(flatten(params), shardings, dtype))


def placed_model(config: Any, params: Mapping) -> tuple[ModelDef, Mapping, AxisRules, Mesh]:
    """(model definition, `params` placed on the config's mesh by its rules, the rules, the
    mesh)."""
    model_def, rules, mesh, shardings, dtype = model_on_mesh(config)
    return model_def, place_params(params, shardings, dtype), rules, mesh


def generate_from_config(config: Any, params: Mapping, prompt_BT: np.ndarray, steps: int,
                         temperature: float = 0.0, seed: int = 0,
                         sampling: Sampling | None = None) -> np.ndarray:
    """Places `params` on the config's mesh by its rules and generates `steps` tokens after
    each row of `prompt_BT` (prompt included in the result). `sampling`: a
    `sampling.Sampling` (top-k / top-p / n / stop ids; rows after a stop hold its pad_id),
    else greedy or `temperature` sampling. The sampler is kept per config and settings, so a
    second call with the same shapes reuses its compiled program."""
    sampling = sampling or Sampling(temperature=float(temperature))
    check_request(np.shape(prompt_BT)[1], steps, sampling.temperature,
                  config.model.get("max_len", 0))
    sampler, shardings, dtype = _sampler(config, sampling)
    placed = place_params(params, shardings, dtype)
    out = sampler(placed, np.asarray(prompt_BT, np.int32), jax.random.key(seed), steps)
    prompt = np.repeat(np.asarray(prompt_BT, np.int32), sampling.n, axis=0)
    return np.concatenate([prompt, np.asarray(out.tokens)], axis=1)


_SAMPLERS: dict[str, tuple[Sampler, Any, Any]] = {}


def _sampler(config: Any, sampling: Sampling) -> tuple[Sampler, Any, Any]:
    """(Sampler, parameter shardings, parameter dtype) for a config and sampling settings,
    built once per process: `jaxscale generate` and a training loop's rollouts call again."""
    import json

    plain = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    key = json.dumps([plain, repr(sampling)], sort_keys=True, default=str)
    if key not in _SAMPLERS:
        model_def, rules, mesh, shardings, dtype = model_on_mesh(config)
        sampler = Sampler(model_def, sampling, rules, mesh, config.model.get("max_len", 0))
        _SAMPLERS[key] = (sampler, shardings, dtype)
    return _SAMPLERS[key]


def check_cache_memory(config: Any, rows: int, positions: int) -> None:
    """Refuses a request whose KV cache alone (`rows` x `positions`, in the model's own cache
    layout, counted once however it is sharded: a lower bound) exceeds the memory free on the
    run's devices (the host's on CPU): the kernel would kill the process without a word
    (SIGKILL) or the device would fail deep in the sampler."""
    model_def, rules, mesh, shardings, _ = model_on_mesh(config)
    from jaxscale.weights.tree import unflatten

    params = unflatten({k: jax.ShapeDtypeStruct(s.shape, s.dtype)
                        for k, s in model_def.shapes().items()})

    def empty_cache(p: Mapping) -> Any:
        with use_rules(rules, mesh):
            return model_def.module(p).init_cache(rows, positions)

    need = sum(math.prod(x.shape) * x.dtype.itemsize
               for x in jax.tree.leaves(jax.eval_shape(empty_cache, params)))
    stats = [d.memory_stats() or {} for d in mesh.devices.flat]
    if all("bytes_limit" in s for s in stats):
        free = sum(s["bytes_limit"] - s.get("bytes_in_use", 0) for s in stats)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need > free:
        raise GenerateError(paragraph(
            f"{rows} sequences of {positions} positions need a KV cache of {need / 2**30:.1f}",
            f"GiB, more than the {free / 2**30:.1f} GiB free on {mesh.devices.size}",
            f"{mesh.devices.flat[0].platform} device(s). Lower --num_samples (or the prompts)",
            "or --steps."))
