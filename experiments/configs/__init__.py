"""Experiment configs for `python -m experiments.train --config=experiments/configs/<name>.py`.

`base.py` holds every field with its meaning (defaults = `gpt_tiny`); each other file starts from it and changes
what differs. Any field can be overridden on the command line: `--config.model.num_layers=8`.

| config | what it is for |
|---|---|
| `gpt_tiny`  | 1.2M params, byte-level Python source, 8 virtual CPU devices, 300 steps in ~2.5 min (default) |
| `gpt_small` | GPT-2 small shape (~85M non-embedding params), bf16, one accelerator host (8 GPUs / TPU v5e-8) |
| `gpt_350m`  | GPT-2 medium shape (~300M), bf16 + remat, a host or a small slice |
| `gpt_1b`    | 1.1B non-embedding (24 x 2048, GQA 16/8), bf16 + remat, FSDP over a TPU v4-32 / 2 GPU nodes and up |
| `gpt_7b`    | LLaMA-2-7B shape (32 x 4096, 6.5B non-embedding), FSDP x tensor parallel across a pod or cluster |
"""
