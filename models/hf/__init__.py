"""Hugging Face Llama-family checkpoints (Llama 2 / 3 / 3.1, Mistral, Qwen2 / 2.5, Gemma) in and out of the GPT.

    from models import hf
    model, cfg = hf.from_pretrained("path/to/hf_dir", mesh, strategy)   # each device reads only its shard
    hf.save_pretrained(model, cfg, "out_dir")                            # config.json + safetensors

Local folders only (nothing is downloaded): config.py maps config.json to GPTConfig and back, layout.py places each
HF tensor in the GPT's fused, stacked parameters, load.py reads the shards, save.py writes them. docs/models.md.
"""

from models.hf.config import to_gpt, to_hf
from models.hf.load import Reader, from_pretrained, load_params, read_config
from models.hf.save import save_pretrained

__all__ = ["Reader", "from_pretrained", "load_params", "read_config", "save_pretrained", "to_gpt", "to_hf"]
