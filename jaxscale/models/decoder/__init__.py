"""The decoder-only LM every decoder family of the model table builds (Llama, Mistral, Qwen,
Gemma, Mixtral, Qwen3-MoE).

`config.py` (`LlamaConfig` and its checks), `block.py` (the transformer block and its scanned
stack), `llama.py` (the model: embedding, layers, head, KV-cache decoding), `lm_task.py` (its
language-model task), `flops.py` (its FLOP counts) and the families' config classes (`qwen.py`,
`gemma.py`). Composes `nn/`, `attention/` and `moe/`.
"""
