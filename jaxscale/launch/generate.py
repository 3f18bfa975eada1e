"""Generate text with a KV cache from a workdir, a `jaxscale convert` output or a HF directory.

    jaxscale generate --workdir=DIR --prompt="def main(" --steps=64 [--temperature=0.8]
    jaxscale generate --from_hf=HF_DIR --prompt_ids=1,15043 --max_new_tokens=16
    jaxscale generate --workdir=DIR --chat --prompt="hello" --steps=32

`--prompt` text is encoded and the output decoded with the model's tokenizer (a tokenizer file
in its directory, or its training config's `data.tokenizer`; bytes for a byte-level model);
`--prompt_ids` takes token ids and prints ids; `--chat` renders `--prompt` as one user turn with
the model's chat template and its generation prompt. Temperature 0 is greedy; sampling
(`--top_k`, `--top_p`, `--num_samples` lines) is reproducible with `--seed`; `--stop_ids` ends
a sample at EOS / end of turn. It runs the rollout sampler (`jaxscale/inference/sampling.py`). The
parameters and the KV cache are sharded by the run's rules over `--cpu_devices` (or the
accelerators).
"""

from absl import app, flags

from jaxscale import cli
from jaxscale.errors import exit_on_user_error, paragraph
from jaxscale.runtime import distributed
from jaxscale.runtime.peer_failure import together

_WORKDIR = flags.DEFINE_string("workdir", "", "Training workdir or `jaxscale convert` output.")
_FROM_HF = flags.DEFINE_string("from_hf", "", "A Hugging Face model directory (any family `jaxscale convert --from_hf` reads).")
_PROMPT = flags.DEFINE_string("prompt", "", "Prompt text (encoded with the model's tokenizer).")
_PROMPT_IDS = flags.DEFINE_list("prompt_ids", [], "Prompt token ids, comma-separated.")
_STEPS = flags.DEFINE_integer("steps", 64, "Tokens to generate.")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", None, "Alias of --steps (HF's name).")
_TEMPERATURE = flags.DEFINE_float("temperature", 0.0, "0: greedy; >0: sampling temperature.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_TOP_K = flags.DEFINE_integer("top_k", 0, "Sample among the k likeliest tokens (0: off).")
_TOP_P = flags.DEFINE_float("top_p", 1.0, "Sample among the likeliest tokens holding this "
                            "probability mass (1.0: off).")
_N = flags.DEFINE_integer("num_samples", 1, "Samples of the prompt, one line each.")
_STOP_IDS = flags.DEFINE_list("stop_ids", [], "Token ids that end a sample (EOS, end of turn); "
                              "the stop token is printed, nothing after it.")
_CHAT = flags.DEFINE_bool("chat", False, "Render --prompt as one user turn with the model's chat "
                          "template (and its generation prompt).")
distributed.define_flags()


@exit_on_user_error
def main(argv):
    if len(argv) > 1 or not (_WORKDIR.value or _FROM_HF.value):
        raise app.UsageError("Give --workdir or --from_hf (and --prompt or --prompt_ids).")
    distributed.setup()
    with together():  # one process failing stops them all
        _generate()


def _generate() -> None:
    import numpy as np

    from jaxscale.data.tokenizer import model_tokenizer
    from jaxscale.inference.generate import (
        GenerateError,
        chat_prompt,
        check_cache_memory,
        check_request,
        generate_from_config,
        load_model,
        parse_prompt,
    )
    from jaxscale.inference.sampling import Sampling

    steps = _STEPS.value if _MAX_NEW.value is None else _MAX_NEW.value
    check_request(1, steps, _TEMPERATURE.value, max_len=0)  # before loading any weights
    try:
        stop_ids = tuple(int(str(i).strip()) for i in _STOP_IDS.value)
    except ValueError:
        raise GenerateError(f"--stop_ids={','.join(_STOP_IDS.value)!r} is not a comma-separated"
                            " list of token ids; give e.g. --stop_ids=2,151645.") from None
    sampling = Sampling(_TEMPERATURE.value, _TOP_K.value, _TOP_P.value, _N.value, stop_ids)
    sampling.check()
    _check_flags_apply(sampling)
    if _PROMPT.value and _PROMPT_IDS.value:
        parse_prompt(_PROMPT.value, _PROMPT_IDS.value, 0)  # the two-spellings error
    config, params = load_model(_WORKDIR.value, _FROM_HF.value)
    sampling = _fit_vocab(sampling, int(config.model.vocab_size))
    tokenizer = model_tokenizer(config, _WORKDIR.value, _FROM_HF.value)
    if _CHAT.value and _PROMPT.value:
        ids = chat_prompt(_PROMPT.value, config, _WORKDIR.value, _FROM_HF.value)
    else:
        ids = parse_prompt(_PROMPT.value, _PROMPT_IDS.value, config.model.vocab_size, tokenizer)
    check_cache_memory(config, sampling.n, len(ids) + steps)
    rows = generate_from_config(config, params, np.asarray([ids]), steps, seed=_SEED.value,
                                sampling=sampling)
    for out in rows:
        new = [int(t) for t in out[len(ids):]]
        stops = [i for i, t in enumerate(new) if t in stop_ids]
        print_ids(ids + (new[:stops[0] + 1] if stops else new), tokenizer, config)


def _check_flags_apply(sampling) -> None:
    """Flags that would be silently ignored: sampling settings under greedy decoding, and
    --chat without a text prompt to render."""
    from jaxscale.inference.generate import GenerateError
    sampled = [f for f, on in (("--top_k", sampling.top_k), ("--top_p", sampling.top_p < 1.0),
                                ("--num_samples", sampling.n > 1)) if on]
    if sampled and sampling.temperature == 0:
        raise GenerateError(paragraph(
            f"{', '.join(sampled)} {'shape' if sampled[1:] else 'shapes'} sampling, but",
            "--temperature=0 decodes greedily (the one likeliest token each step, the same for",
            "every sample). Set --temperature above 0 (e.g. --temperature=0.8), or drop them."))
    if _CHAT.value and not _PROMPT.value:
        raise GenerateError(paragraph(
            "--chat renders --prompt TEXT as a user turn with the chat template; --prompt_ids",
            "are token ids already and are used as given. Give --chat --prompt=TEXT, or drop",
            "--chat (and render the template into the ids yourself)."))


def _fit_vocab(sampling, vocab: int):
    """--stop_ids inside the model's vocabulary (an id outside never matches: a typo); a
    --top_k past it keeps every token, as transformers' top-k does (clamped)."""
    import dataclasses

    from jaxscale.inference.generate import GenerateError
    bad = [i for i in sampling.stop_ids if not 0 <= i < vocab]
    if bad:
        raise GenerateError(paragraph(
            f"--stop_ids holds {bad[:5]}, outside the model's vocabulary [0, {vocab}): no",
            "generated token could ever match it. Use ids from the model's tokenizer (its EOS or",
            "end-of-turn token)."))
    return dataclasses.replace(sampling, top_k=min(sampling.top_k, vocab))


def print_ids(out: list, tokenizer, config) -> None:
    """The prompt and its continuation: ids for --prompt_ids, else decoded text."""
    if _PROMPT_IDS.value:
        print(",".join(str(int(t)) for t in out))
    elif tokenizer is not None:
        print(tokenizer.decode([int(t) for t in out]))
    elif config.model.vocab_size == 256:
        print(bytes(int(t) for t in out).decode("utf-8", errors="replace"))
    else:
        print(",".join(str(int(t)) for t in out))

if __name__ == "__main__":
    app.run(main, flags_parser=cli.parse_flags)
