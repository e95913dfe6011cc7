"""Tiny random Hugging Face models and their logits, the references `tests/test_hf.py` checks shardkit against.

Run once, in a venv of its own (torch and transformers are never dependencies of shardkit or of its tests):

    python3 -m venv /tmp/venv-ref
    /tmp/venv-ref/bin/pip install torch==2.13.0 transformers==5.25.0 safetensors==0.8.0 numpy   # CPU torch
    /tmp/venv-ref/bin/python experiments/reference/make_hf_assets.py            # -> tests/assets/hf/<family>/

Versions used for the committed assets: torch 2.13.0+cpu, transformers 5.25.0, safetensors 0.8.0, numpy 2.4.6
(written into each folder's `reference.json` too). Each family (Llama 3.1, Mistral, Qwen2, Gemma) gets a folder
transformers itself wrote with `save_pretrained` (config.json, model.safetensors; Mistral's split into several files
with model.safetensors.index.json, to test that path) and `logits.npz`: int32 `tokens` [2, 12] and the fp32 `logits`
[2, 12, vocab] of the eager fp32 forward. Every weight is drawn at a scale where it moves the logits (norm scales 1
+ N(0, 0.1), biases N(0, 0.1), matrices N(0, 0.2)): a wrong transpose or head order cannot hide under near-uniform
logits.

    /tmp/venv-ref/bin/python experiments/reference/make_hf_assets.py --check <exported dir> --family llama

loads a folder `python -m experiments.export` wrote with transformers, runs the family's tokens and prints the
largest difference from the committed logits (docs/models.md keeps that output); with `--logits <npz>` (what
`experiments.export --logits` wrote: a fine-tuned model's shardkit logits) it compares against those instead.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import safetensors
import torch
import transformers

ROOT = Path(__file__).resolve().parents[2] / "tests" / "assets" / "hf"
VOCAB = 264  # >= 257: byte-level tokens and EOT are valid ids (experiments/data/text.py); a multiple of 8
COMMON = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5)  # fmt: skip


def configs() -> dict[str, transformers.PretrainedConfig]:
    """Llama 3.1 (llama3 RoPE scaling, head_dim 16 != hidden / heads), Mistral (sliding window), Qwen2 (q/k/v
    biases, tied embeddings), Gemma (embeddings x sqrt(hidden), (1 + w) norms, GeGLU, tied, head_dim 16)."""
    llama3 = dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    )  # wavelengths 6, 63, 628 ...: all three llama3 bands used
    return {
        "llama": transformers.LlamaConfig(**COMMON, head_dim=16, rope_theta=10_000.0, rope_scaling=llama3),
        "mistral": transformers.MistralConfig(**COMMON, head_dim=8, rope_theta=1_000_000.0, sliding_window=64),
        "qwen2": transformers.Qwen2Config(**COMMON, rope_theta=10_000.0, tie_word_embeddings=True),
        "gemma": transformers.GemmaConfig(**COMMON, head_dim=16, rope_theta=10_000.0),  # (1 + w) norms, GeGLU, tied
    }


def randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(0.2 * noise)


def logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens).long()).logits.float().numpy()


def versions() -> dict[str, str]:
    return dict(torch=torch.__version__, transformers=transformers.__version__, safetensors=safetensors.__version__,
                numpy=np.__version__)  # fmt: skip


def generate(root: Path, only: list[str]) -> None:
    for seed, (family, cfg) in enumerate(configs().items()):
        if only and family not in only:
            continue
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
        randomize(model, seed)
        model.eval()
        out = root / family
        out.mkdir(parents=True, exist_ok=True)
        for old in out.glob("*"):
            old.unlink()
        model.save_pretrained(out, max_shard_size="40KB" if family == "mistral" else "50MB")
        tokens = np.random.default_rng(seed).integers(0, VOCAB, (2, 12)).astype(np.int32)
        np.savez(out / "logits.npz", tokens=tokens, logits=logits(model, tokens))
        (out / "reference.json").write_text(json.dumps({"family": family, **versions()}, indent=2) + "\n")
        size = sum(f.stat().st_size for f in out.iterdir())
        print(f"{family}: {out} ({size / 1024:.0f} KiB, {len(list(out.glob('*.safetensors')))} safetensors file(s))")


def check(exported: Path, family: str, root: Path, against: Path | None = None) -> int:
    ref = np.load(against or root / family / "logits.npz")
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32,
                                                              attn_implementation="eager")  # fmt: skip
    model.eval()
    got = logits(model, ref["tokens"])
    diff = float(np.abs(got - ref["logits"]).max())
    vs = ", ".join(f"{k} {v}" for k, v in versions().items())
    what = f"shardkit's logits ({against.name})" if against else "committed HF logits"
    print(f"{exported.name}: transformers loaded {exported} as {type(model).__name__}; max |logits - {what}| = "
          f"{diff:.2e} over {got.size} logits ({vs})")  # fmt: skip
    return 0 if diff <= 1e-4 else 1


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT, help="where the family folders go")
    p.add_argument("--families", default="", help="generate only these (comma-separated); default all")
    p.add_argument("--check", type=Path, default=None, help="an exported folder to load with transformers")
    p.add_argument("--family", default="llama", help="--check: whose committed tokens and logits to compare")
    p.add_argument("--logits", type=Path, default=None, help="--check: compare with these (experiments.export's)")
    a = p.parse_args()
    if a.check is not None:
        return check(a.check, a.family, a.out, a.logits)
    generate(a.out, [f for f in a.families.split(",") if f])
    return 0


if __name__ == "__main__":
    sys.exit(main())
