"""What changes a built model without its family knowing: LoRA adapters and int8 training.

`lora.py` (attach, train, merge and save adapters), `lora_matmul.py` (how a projection reads an
adapted weight, LoRA dropout) and `int8.py` (quantized training through qwix). They work on any
module that reads its weights through `nn.layers.project` (`LORA_WEIGHTS`), so they import `nn/`
only; the model table (`models/__init__.py`) applies int8 in `ModelDef.build`.
"""
