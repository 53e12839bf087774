"""The model and what it runs on: loading, the training forward, LoRA, processes, FSDP2, memory.

- `loading`: a local Hugging Face folder -> model, tokenizer (checked before loading).
- `forward`: log-probs of sampled completions (the training pass's forward).
- `lora`: peft adapters; the frozen base doubles as the KL reference.
- `parallel`: torchrun processes: collectives, gradient all-reduce, this rank's share.
- `fsdp`: FSDP2 sharding and full state dicts.
- `allocator`: keeping freed CPU memory mapped between steps.
- `tiny`: the tiny character-level models of the demo and the tests.
"""
