"""Small Hugging Face tokenizer directories with real chat templates, for the chat tests.

One byte-level BPE trained on a tiny corpus carries the special tokens of every family below;
each directory is that tokenizer saved by transformers (`save_pretrained`: tokenizer.json,
tokenizer_config.json and, for transformers 5, chat_template.jinja) with its family's template
and BOS / EOS / pad. The templates are the published ones of Llama 3 (Meta-Llama-3-8B-Instruct),
Qwen2 (ChatML with a default system turn), Gemma (1 and 2, which refuse a system turn) and
Qwen3's, which renders a last assistant turn differently from an earlier one, with and without
`{% generation %}` markers around the assistant turn (as Levanter's and TRL's variants do).
"""

from __future__ import annotations

import functools
import os

WORDS = ("hello world how are you today the quick brown fox jumps over the lazy dog fine "
         "thanks what is two plus two four answer question yes no maybe sure good bad").split()
SPECIAL = ("<|endoftext|>", "<pad>", "<|begin_of_text|>", "<|end_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|im_start|>",
           "<|im_end|>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<think>",
           "</think>")

LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
          "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
          "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
          "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

QWEN2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
         "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
         "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role "
         "not supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == "
         "'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must "
         "alternate user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == "
         "'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
         "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + "
         "'<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}"
         "{{'<start_of_turn>model\n'}}{% endif %}")

# Qwen3's template (its tool branches left out): a namespace, a reversed loop, string methods;
# the last assistant turn after the last user query gets a (possibly empty) <think> block.
_QWEN3 = """{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- set think = loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        GEN_OPEN
        {%- if think %}
            {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {{- '<|im_end|>' }}
        GEN_CLOSE
        {{- '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}"""
QWEN3 = _QWEN3.replace("        GEN_OPEN\n", "").replace("        GEN_CLOSE\n", "")
QWEN3_GENERATION = (_QWEN3.replace("GEN_OPEN", "{%- generation %}")
                    .replace("GEN_CLOSE", "{%- endgeneration %}"))

# family -> (template, bos, eos, pad)
FAMILIES = {
    "llama3": (LLAMA3, "<|begin_of_text|>", "<|eot_id|>", "<pad>"),
    "qwen2": (QWEN2, None, "<|im_end|>", "<|endoftext|>"),
    "gemma": (GEMMA, "<bos>", "<eos>", "<pad>"),
    "qwen3": (QWEN3, None, "<|im_end|>", "<|endoftext|>"),
    "qwen3_generation": (QWEN3_GENERATION, None, "<|im_end|>", "<|endoftext|>"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "hello how are you"},
     {"role": "assistant", "content": "fine thanks"}],
    [{"role": "system", "content": "answer yes or no"},
     {"role": "user", "content": "is two plus two four"},
     {"role": "assistant", "content": " yes  "},
     {"role": "user", "content": "sure"},
     {"role": "assistant", "content": "good answer"}],
    [{"role": "user", "content": "the quick brown fox"},
     {"role": "assistant", "content": "jumps over the lazy dog"},
     {"role": "user", "content": "what is the answer"}],
]


@functools.cache
def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([" ".join(WORDS[i:] + WORDS[:i]) for i in range(len(WORDS))],
                            trainer=trainer)
    return tok


def tokenizer_dir(root: str, family: str) -> str:
    """`root/family`: the trained tokenizer saved by transformers with the family's template."""
    from transformers import PreTrainedTokenizerFast

    path = os.path.join(root, family)
    if os.path.isdir(path):
        return path
    template, bos, eos, pad = FAMILIES[family]
    hf = PreTrainedTokenizerFast(tokenizer_object=_tokenizer(), bos_token=bos, eos_token=eos,
                                 pad_token=pad)
    hf.chat_template = template
    hf.save_pretrained(path)
    return path
