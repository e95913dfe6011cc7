"""shardkit's PREDICTED step time and MFU (shardkit/roofline.py) beside an MFU MaxText publishes, for the same model
and slice. Nothing runs on a chip: the step is compiled for the target by XLA's TPU compiler on this host.

    python -m experiments.bench.roofline_maxtext                        # Llama2-70B on v5p-128 (MaxText: 65% MFU)
    python -m experiments.bench.roofline_maxtext --remat dots --json out.json

The published figure: MaxText's getting_started/Run_Llama2.md ("Model Flop utilization for training on v5e and v5p
and v4 TPUs with MaxText": Llama2-70b, v5p-128, bf16: 65%), whose run is MaxText's benchmarks/
maxtext_v5p_model_configs.py `llama2_70b_v5p_128` (ici_fsdp_parallelism=-1, per_device_batch_size=4,
max_target_length=4096, remat_policy=save_dot_except_mlpwi). The published step time follows from it: model FLOPs
per device / (MFU x peak). MaxText's model FLOPs (maxtext_utils.calculate_tflops_training_per_device of that time:
6N + 12 L H dh s per token, attention not halved for causality) are shardkit's GPTConfig.flops_per_token.
"""

from __future__ import annotations

import argparse
import json
import time

import experiments.train  # noqa: F401  (sets XLA_FLAGS before jax is imported)
from experiments.compile_only import explain_config
from experiments.configs import gpt_70b

#: (model config, target, mesh, global batch, sequence, published MFU, where it is published)
CASES = {
    "llama2_70b_v5p_128": (gpt_70b, "v5p-128", "fsdp=64", 256, 4096, 0.65,
                           "https://github.com/AI-Hypercomputer/maxtext/blob/main/getting_started/Run_Llama2.md"),
    # the same table's v5e-256 column; MaxText/configs/v5e/llama2_70b.sh: per_device_batch_size=2,
    # remat_policy=qkv_proj_offloaded, max_target_length left at base.yml's 2048
    "llama2_70b_v5e_256": (gpt_70b, "v5e-256", "fsdp=256", 512, 2048, 0.57,
                           "https://github.com/AI-Hypercomputer/maxtext/blob/main/getting_started/Run_Llama2.md"),
}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", default="llama2_70b_v5p_128", choices=sorted(CASES))
    ap.add_argument("--remat", default="", help="shardkit remat policy (default: the config's)")
    ap.add_argument("--json", default="", help="also write the figures as JSON here")
    ap.add_argument("--hlo", default="", help="also write the compiled program's HLO text here")
    args = ap.parse_args()
    module, target, mesh, batch, seq, mfu, source = CASES[args.case]
    c = module.get_config()
    # MaxText's layout (fsdp over every chip, ici_fsdp_parallelism=-1), not the config's own plan (gpt_70b: tp3d)
    c.target, c.mesh, c.strategy, c.batch_size, c.seq_len = target, mesh, "fsdp", batch, seq
    if args.remat:
        c.model.remat = args.remat
    t0 = time.perf_counter()
    report, _ = explain_config(c)
    compile_s = time.perf_counter() - t0
    r = report.roofline
    published_s = r.model_flops / (mfu * r.peak_flops)
    out = dict(case=args.case, target=target, mesh=mesh, batch=batch, seq=seq, remat=c.model.remat,
               compile_s=compile_s, peak_bytes=report.memory["peak"], fits=report.fits, published_mfu=mfu,
               published_step_s=published_s, source=source, roofline=r.to_dict())  # fmt: skip
    print(r.text())
    print(f"\n{args.case} (remat {c.model.remat}, compiled in {compile_s:.0f} s, peak "
          f"{report.memory['peak'] / 2**30:.1f} GiB, fits: {report.fits})")  # fmt: skip
    print(f"  MaxText published: MFU {mfu:.0%} -> step {published_s:.3f} s ({source})")
    print(
        f"  shardkit PREDICTED (not measured): step {r.step_s:.3f} s (no overlap {r.no_overlap_s:.3f}, full "
        f"overlap {r.full_overlap_s:.3f}), MFU {r.mfu:.1%}; predicted / published step {r.step_s / published_s:.2f}"
    )
    if args.hlo:
        with open(args.hlo, "w") as f:
            f.write(report.hlo_text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)


if __name__ == "__main__":
    main()
