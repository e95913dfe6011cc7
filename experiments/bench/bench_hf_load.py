"""Peak host memory while loading a Hugging Face checkpoint under fsdp, against the bytes the devices then hold.

    python -m experiments.bench.bench_hf_load [--layers 8] [--dir /tmp/hf_bench]
        [--out experiments/bench/results/bench_hf_load.json]

A random Llama-shaped fp32 checkpoint (width 1024, 16 heads over 8 KV heads, mlp 2816, vocabulary 32,000, untied
head; 8 layers = 641 MB) is written in files of at most 200 MB with an index, by a child process. A second, fresh
process measures: its resident memory after `import jax`, the mesh (fsdp=8 on 8 CPU devices) and the abstract model
(the baseline), then `models.hf.from_pretrained` under fsdp, and the process's peak resident memory
(`ru_maxrss`) after it. On CPU the devices' buffers are host memory, so peak - baseline counts them: the goal is
below 1.5x the bytes the process's devices hold (a loader that read the whole model into the host first would need
2x or more). Not a test: one run, a few seconds of reading.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "bench_hf_load.json"
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8, vocab_size=32000)


def _rss() -> int:
    """Resident bytes now (VmRSS)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def generate(folder: Path, layers: int) -> None:
    """The checkpoint, written one file (<= 200 MB) at a time."""
    import numpy as np
    from safetensors.numpy import save_file

    from models.hf import config as hf_config
    from models.hf import layout

    cfg = hf_config.to_gpt(dict(model_type="llama", num_hidden_layers=layers, max_position_embeddings=4096, **SHAPE))
    folder.mkdir(parents=True, exist_ok=True)
    rng, files, pending, size, index = np.random.default_rng(0), [], {}, 0, {}
    shapes = layout.hf_shapes(cfg)
    for i, (name, shape) in enumerate(shapes.items()):
        pending[name] = rng.standard_normal(shape, dtype=np.float32) * 0.02
        size += pending[name].nbytes
        if size > 200e6 or i + 1 == len(shapes):
            files.append(f"model-{len(files) + 1:05d}.safetensors")
            save_file(pending, str(folder / files[-1]), metadata={"format": "pt"})
            index.update(dict.fromkeys(pending, files[-1]))
            pending, size = {}, 0
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    (folder / "config.json").write_text(json.dumps(hf_config.to_hf(cfg)))


def measure(folder: Path) -> dict:
    """In this (fresh) process: baseline, load under fsdp over 8 devices, peak."""
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    import jax

    import shardkit as sk
    from models import hf
    from models.gpt import GPT

    mesh = sk.make_mesh("fsdp=8")
    cfg = hf.read_config(folder)
    sk.abstract_model(lambda rngs: GPT(cfg, rngs=rngs))
    jax.numpy.zeros(8).block_until_ready()  # the runtime started
    baseline, peak_before = _rss(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t = time.perf_counter()
    model, _ = hf.from_pretrained(folder, mesh, "fsdp")
    leaves = jax.tree.leaves(sk.init.split_params(model)[1])
    jax.block_until_ready(leaves)
    seconds = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    held = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
    files = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    return dict(
        model="llama-shaped, fp32, " + ", ".join(f"{k} {v}" for k, v in SHAPE.items()) + f", {cfg.num_layers} layers",
        checkpoint_bytes=files, params=cfg.num_params(), devices=8, strategy="fsdp", mesh="fsdp=8",
        device_bytes=held, baseline_rss=baseline, peak_rss_before_load=peak_before, peak_rss=peak,
        rss_after=_rss(), load_s=round(seconds, 2),
        peak_over_baseline_per_device_byte=round((peak - baseline) / held, 3),
        goal="(peak_rss - baseline_rss) / device_bytes < 1.5",
    )  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dir", type=Path, default=Path("/tmp/hf_bench"))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--generate", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.generate:
        generate(a.dir, a.layers)
        return 0
    if a.measure:
        print(json.dumps(measure(a.dir)))
        return 0
    me = [sys.executable, "-m", "experiments.bench.bench_hf_load", "--dir", str(a.dir), "--layers", str(a.layers)]
    if not (a.dir / "config.json").is_file():
        subprocess.run([*me, "--generate"], check=True)
    out = json.loads(subprocess.run([*me, "--measure"], check=True, capture_output=True, text=True).stdout)
    out["jax"] = __import__("jax").__version__
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
