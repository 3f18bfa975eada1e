"""A jaxscale model for EleutherAI's lm-evaluation-harness (`lm_eval`).

`JaxscaleLM` serves the harness's three request types from a training workdir, a
`jaxscale convert` output or a Hugging Face directory, on the mesh and rules of the run's own
config (the weights placed once, as `generate` places them):

- `loglikelihood`: the summed log-probability of each continuation and whether greedy decoding
  would produce it, from one forward pass per row;
- `loglikelihood_rolling`: a whole document's log-likelihood over the harness's rolling windows;
- `generate_until`: greedy or sampled continuations, cut at the request's stop strings.

Rows are batched by length into a few padded buckets (powers of two, `sampling.bucket`), so a
task compiles a handful of programs rather than one per request; generation runs the rollout
sampler (`jaxscale/inference/sampling.py`), which stops each row at EOS. The harness finds the model by name through
the `lm_eval.models` entry point in pyproject.toml where its version reads entry points;
`jaxscale lm-eval` (any `lm_eval` flags) registers it on the versions that do not.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import TemplateLM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from jaxscale.data.tokenizer import ByteTokenizer, model_tokenizer
from jaxscale.errors import ConfigError, paragraph
from jaxscale.inference.generate import load_model, placed_model
from jaxscale.inference.sampling import Sampler, Sampling, bucket
from jaxscale.rules import use_rules
from jaxscale.runtime import jax_platform


def cut_at_stops(text: str, stops: Sequence[str]) -> str:
    """`text` up to the first occurrence of any stop string (all of it if none occurs)."""
    ends = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    return text[:min(ends)] if ends else text


def scorer(model_def: Any, rules: Any, mesh: Any) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """A jitted `fn(params, tokens_BT, mask_BT) -> (summed log-probs (B,), all-greedy (B,))`
    over the targets tokens[:, 1:] where mask[:, 1:] is set (float32 softmax)."""
    def score(params: Any, tokens_BT: jax.Array, mask_BT: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
        with use_rules(rules, mesh):
            logits_BTV = model_def.module(params)(tokens_BT[:, :-1]).astype(jnp.float32)
        targets_BT = tokens_BT[:, 1:]
        logp_BT = jnp.take_along_axis(jax.nn.log_softmax(logits_BTV, axis=-1),
                                      targets_BT[..., None], axis=-1)[..., 0]
        mask_BT = mask_BT[:, 1:]
        greedy_BT = (jnp.argmax(logits_BTV, axis=-1) == targets_BT) | ~mask_BT
        return jnp.where(mask_BT, logp_BT, 0.0).sum(axis=1), greedy_BT.all(axis=1)

    return jax.jit(score)


def check_model_args(workdir: str, from_hf: str, batch_size: int | str, max_length: int | str,
                     max_gen_toks: int | str, unknown: dict) -> int:
    """The batch size, once `--model_args` are known to be valid (a ConfigError naming the bad
    one otherwise). `jaxscale lm-eval` calls it before the harness indexes its tasks (seconds)."""
    if unknown:
        raise ConfigError(paragraph(
            f"lm_eval --model_args for jaxscale: unknown argument(s) {sorted(unknown)}.",
            "Known: workdir, from_hf, batch_size, max_length, max_gen_toks, seed."))
    if bool(workdir) == bool(from_hf):
        raise ConfigError(paragraph(
            "lm_eval --model jaxscale needs exactly one of --model_args workdir=DIR (a",
            "training workdir or a `jaxscale convert` output) or from_hf=DIR (a Hugging",
            "Face model directory)."))
    if str(batch_size).startswith("auto"):
        batch_size = 8  # the harness's automatic search runs torch models; pick a size
    sizes = dict(batch_size=batch_size, max_length=max_length, max_gen_toks=max_gen_toks)
    bad = {k: v for k, v in sizes.items()
           if not str(v).isdigit() or int(v) < (k != "max_length")}
    if bad:
        raise ConfigError(paragraph(
            f"lm_eval --model_args for jaxscale: {bad} must be whole numbers (batch_size and",
            "max_gen_toks at least 1; max_length 0 for the model's own), e.g.",
            "--model_args workdir=DIR,batch_size=8."))
    return int(batch_size)


class JaxscaleLM(TemplateLM):
    """lm_eval's model interface over a jaxscale model (`--model_args workdir=DIR` or
    `from_hf=DIR`; `batch_size`, `max_length` and `max_gen_toks` as the harness's own models
    take them)."""

    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None
                               ) -> JaxscaleLM:
        from lm_eval import utils
        return cls.create_from_arg_obj(utils.simple_parse_args_string(arg_string),
                                       additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None
                            ) -> JaxscaleLM:
        """--model_args over the harness's own flags (its --batch_size default among them):
        the harness's version passes a key given in both twice (a TypeError)."""
        extra = {k: v for k, v in (additional_config or {}).items() if v is not None}
        return cls(**{**extra, **arg_dict})

    @classmethod
    def check_arg_string(cls, arg_string: str) -> None:
        """Raises the ConfigError that `create_from_arg_string` would, without loading."""
        from lm_eval import utils
        args = utils.simple_parse_args_string(arg_string)
        params = inspect.signature(cls.__init__).parameters
        given = {name: args.pop(name, p.default) for name, p in params.items()
                 if p.default is not p.empty}
        check_model_args(given["workdir"], given["from_hf"], given["batch_size"],
                         given["max_length"], given["max_gen_toks"], unknown=args)
        if given["workdir"]:  # a workdir without the model's shape: before the task index too
            from jaxscale.interop.convert import read_model_config
            read_model_config(given["workdir"], "--model_args workdir")

    def __init__(self, workdir: str = "", from_hf: str = "", batch_size: int | str = 8,
                 max_length: int | str = 0, max_gen_toks: int | str = 256, seed: int | str = 0,
                 max_batch_size: Any = None, device: Any = None, **unknown: Any) -> None:
        super().__init__()
        jax_platform.cpu_when_no_accelerator()  # before the first array: no libtpu noise
        batch_size = check_model_args(workdir, from_hf, batch_size, max_length, max_gen_toks,
                                      unknown)
        self.config, params = load_model(workdir, from_hf)
        self.model_def, self.params, self.rules, self.mesh = placed_model(self.config, params)
        self.tokenizer = (model_tokenizer(self.config, workdir, from_hf) or ByteTokenizer())
        devices = self.mesh.devices.size
        self.batch = -(-int(batch_size) // devices) * devices  # rows split over the mesh
        self.max_length = int(max_length) or int(self.config.model.get("max_len", 0) or 2048)
        self.max_gen_toks = int(max_gen_toks)
        self.rng = jax.random.key(int(seed))
        self.score = scorer(self.model_def, self.rules, self.mesh)

    @property
    def eot_token_id(self) -> int:
        eos = self.tokenizer.eos_id
        return int(eos if eos is not None else self.tokenizer.pad_id)

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_id
        return int(bos if bos is not None else self.eot_token_id)

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        return list(self.tokenizer.encode(string))

    def tok_decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids))

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(log-probability, is greedy) of each request's continuation tokens after its
        context, the context cut from the left to fit `max_length` positions."""
        rows = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((whole, min(len(continuation), len(whole) - 1)))
        results: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        for start in range(0, len(order), self.batch):
            chunk = order[start:start + self.batch]
            width = bucket(len(rows[chunk[0]][0]), self.max_length + 1)
            tokens = np.zeros((self.batch, width), np.int32)
            mask = np.zeros((self.batch, width), bool)
            for r, i in enumerate(chunk):
                whole, scored = rows[i]
                tokens[r, :len(whole)] = whole
                mask[r, len(whole) - scored:len(whole)] = True
            logp, greedy = jax.device_get(self.score(self.params, tokens, mask))
            for r, i in enumerate(chunk):
                results[i] = (float(logp[r]), bool(greedy[r]))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], results[i])
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False
                              ) -> list[float]:
        """Each document's log-likelihood, scored in disjoint windows of `max_length` tokens
        (each conditioned on the tokens before it in the window), as the harness defines it."""
        out = []
        for (text,) in (req.args for req in requests):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            scored = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
            total = sum(logp for logp, _ in scored)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or `temperature` > 0 with `do_sample`) continuations of up to
        `max_gen_toks` tokens, stopped at EOS and cut at the request's `until` strings; the
        requests that share settings decode together, `batch` rows at a time."""
        settings = [self._settings(kwargs) for _, kwargs in (req.args for req in requests)]
        out: list[str] = [""] * len(requests)
        groups: dict[tuple[int, float], list[int]] = {}
        for i, (steps, temperature, _) in enumerate(settings):
            groups.setdefault((steps, temperature), []).append(i)
        for (steps, temperature), members in groups.items():
            for start in range(0, len(members), self.batch):
                chunk = members[start:start + self.batch]
                prompts = [self.tok_encode(requests[i].args[0])[-max(self.max_length - steps, 1):]
                           or [self.prefix_token_id] for i in chunk]
                for i, new in zip(chunk, self._generate(prompts, steps, temperature)):
                    out[i] = cut_at_stops(self.tok_decode(new), settings[i][2])
                    self.cache_hook.add_partial("generate_until", requests[i].args, out[i])
        return out

    def _settings(self, gen_kwargs: dict | None) -> tuple[int, float, list[str]]:
        """(new tokens, temperature, stop strings) of a request's generation arguments."""
        kwargs = dict(gen_kwargs or {})
        until = kwargs.get("until") or []
        steps = int(kwargs.get("max_gen_toks", self.max_gen_toks))
        temperature = float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0
        return steps, temperature, [until] if isinstance(until, str) else list(until)

    def _generate(self, prompts: list[list[int]], steps: int, temperature: float
                  ) -> list[list[int]]:
        """The new tokens of each prompt (up to `steps`, its EOS dropped), decoded together by
        the rollout sampler, the rows filled up to `batch` so they split over the mesh."""
        rows = prompts + [[self.prefix_token_id]] * (self.batch - len(prompts))
        self.rng, key = jax.random.split(self.rng)
        out = self._sampler(temperature)(self.params, rows, key, steps)
        tokens, mask = np.asarray(out.tokens), np.asarray(out.mask)
        return [[int(t) for t in tokens[r][mask[r]] if t != self.eot_token_id]
                for r in range(len(prompts))]

    @functools.cache  # noqa: B019 (one sampler per temperature, for the model's lifetime)
    def _sampler(self, temperature: float) -> Sampler:
        sampling = Sampling(temperature=temperature, stop_ids=(self.eot_token_id,))
        return Sampler(self.model_def, sampling, self.rules, self.mesh, self.max_length)


def register() -> None:
    """Puts `jaxscale` in lm_eval's model registry, as its entry point would."""
    import lm_eval.models  # noqa: F401  (the harness's own models, which it adds only to an
    from lm_eval.api.registry import model_registry  # empty registry)

    if "jaxscale" not in model_registry:
        model_registry.register("jaxscale")(JaxscaleLM)
