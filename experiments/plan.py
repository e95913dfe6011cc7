"""Rank every 4D (and dp / fsdp / tp / tp_sp) plan for a GPT on a cluster, before running anything.

    python -m experiments.plan --model gpt_7b --devices 1024 --hardware perlmutter [--top 10] [--plot plans.png]
    python -m experiments.plan --model gpt_7b --devices 64 --hardware frontier --variant axonn --batch 64
    python -m experiments.plan --model gpt_7b --target v5p-128 --batch 256 --compile 3   # + the TPU compiler's word

--model names a GPT config in experiments/configs, or a path to one (its model shape, vocabulary, batch size and
sequence length are used, as experiments.train builds them; --batch / --seq override them). Prints the ranked table
of `sk.plan` (the remat policy each plan needs and its recompute cost, predicted communication and step time, GiB
sent per device, memory per device and what it leaves spare, "tight" where that is within the cost model's known
error) and the plans rejected for memory; --plot draws the top plans. --remat lists the policies tried (default
none, dots, dots_no_batch, full: the config's own remat alias is then ignored); --remat=config keeps the config's.

--target names hardware that need not be present (a TPU slice: shardkit/targets.py): the devices and the chip's
figures are the target's, and the top `--compile` plans that fit (3 by default with a target) are compiled by XLA's
TPU compiler here, their memory and collective bytes read back next to the prediction, and re-ranked by what the
compiler says: fitting the chip's HBM first, then the fewest collective bytes per device (docs/targets.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import sys
import time
from pathlib import Path

import shardkit as sk
from experiments.data import text
from models.gpt import GPTConfig
from shardkit import costmodel
from shardkit.errors import ShardkitError

CONFIGS = Path(__file__).resolve().parent / "configs"


def model_from_config(name: str) -> tuple[GPTConfig, int, int]:
    """(GPTConfig, batch size, seq len) from experiments/configs/<name>.py (or a path to such a file).

    ShardkitError, naming the configs there are, for an unknown name or a config whose task is not the GPT's."""
    stem = Path(name).stem if name.endswith(".py") else name
    names = sorted(p.stem for p in CONFIGS.glob("*.py") if p.stem not in ("__init__", "base"))
    if stem not in names:
        raise ShardkitError(f"--model {name!r}: no such config; choose one of {', '.join(names)}")
    c = importlib.import_module(f"experiments.configs.{stem}").get_config()
    if c.get("task", "lm") != "lm":
        gpts = [n for n in names if importlib.import_module(f"experiments.configs.{n}").get_config().task == "lm"]
        raise ShardkitError(f"--model {name!r} has task {c.task!r}; the planner ranks GPT configs: {', '.join(gpts)}")
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    model = {k: v for k, v in c.model.to_dict().items() if k in fields and v}
    # vocab_size 0: the data's, as experiments.train builds the model (bytes: text.PADDED_VOCAB), so that what is
    # planned is what --compile and the run compile
    model["vocab_size"] = model.get("vocab_size") or text.PADDED_VOCAB
    return GPTConfig(**model), int(c.batch_size), int(c.seq_len)


def plot(plans: list[costmodel.Plan], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 0.35 * len(plans) + 1.5))
    labels = [f"{p.strategy} {p.grid}" for p in plans][::-1]
    kinds = sorted({c.kind + " " + c.axis for p in plans for c in p.comms})
    left = [0.0] * len(plans)
    hw_time = {id(p): p.comm_time_s / max(p.comm_bytes, 1) for p in plans}  # split each bar by bytes share
    for k in kinds:
        ms = [sum(c.bytes for c in p.comms if c.kind + " " + c.axis == k) * hw_time[id(p)] * 1e3 for p in plans]
        ax.barh(labels, ms[::-1], left=left[::-1], label=k)
        left = [a + b for a, b in zip(left, ms, strict=True)]
    ax.set_xlabel("predicted communication per step (ms), split by bytes per collective kind and axis")
    ax.set_title(title)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="gpt_7b", help="a config in experiments/configs")
    ap.add_argument("--devices", type=int, default=1024)
    ap.add_argument("--hardware", default="perlmutter", help="a preset in meshes/")
    ap.add_argument("--batch", type=int, default=0, help="global batch (default: the config's)")
    ap.add_argument("--seq", type=int, default=0, help="sequence length (default: the config's)")
    ap.add_argument("--variant", default="alpha-beta", choices=("alpha-beta", "axonn"))
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--plot", default="", help="write a PNG of the top plans")
    policies = ",".join(costmodel.REMAT_POLICIES)
    ap.add_argument("--remat", default=policies, help="remat policies tried per plan; 'config': the config's own only")
    ap.add_argument("--target", default="", help="a TPU slice (v5e-8, v5p-128, ...): its devices and chip figures")
    ap.add_argument(
        "--compile", type=int, default=-1, help="compile the top N plans that fit (default: 3 with --target)"
    )
    args = ap.parse_args(argv)
    try:
        if args.target:
            tgt = sk.target(args.target)
            args.devices, args.hardware = tgt.num_devices, tgt.preset()
        cfg, batch, seq = model_from_config(args.model)
        batch, seq = args.batch or batch, args.seq or seq
        remat = None if args.remat == "config" else tuple(p for p in args.remat.split(",") if p)
        if remat is not None:  # the planner chooses the policy: the config's own alias would contradict it
            cfg = dataclasses.replace(cfg, remat="none")
        plans = costmodel.plan(cfg, args.devices, args.hardware, batch, seq, variant=args.variant,
                               include_rejected=True, remat=remat)  # fmt: skip
    except ShardkitError as e:  # a wrong name or value: one line, as the other entry points print it
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    fits = [p for p in plans if p.fits]
    hw = getattr(args.hardware, "name", args.hardware)
    title = (f"{args.model} ({cfg.num_params() / 1e9:.2f}B params), {args.devices} x {hw}, "
             f"batch {batch} x {seq}, {args.variant}")  # fmt: skip
    print(title)
    print(costmodel.format_plans(fits[: args.top], efficiency=0.5))
    remat_only = [p for p in fits if p.remat != "none"]
    print(f"{len(fits)} plans fit, {len(remat_only)} of them only with remat (their recompute cost ranked in), "
          f"{len(plans) - len(fits)} rejected for memory, e.g.:")  # fmt: skip
    print(costmodel.format_plans([p for p in plans if not p.fits][:3]))
    if args.plot:
        plot(fits[: args.top], args.plot, title)
        print(f"wrote {args.plot}")
    n_compile = args.compile if args.compile >= 0 else (3 if args.target else 0)
    if n_compile:
        compiled_ranking(args, fits[:n_compile], batch, seq, remat is not None)


def compiled_ranking(args: argparse.Namespace, plans: list[costmodel.Plan], batch: int, seq: int, chosen: bool) -> None:
    """Compiles each plan (for the target with --target, else on this machine's devices) and prints its compiled
    peak memory and collective bytes next to the prediction, re-ranked: fits first, then fewest collective bytes."""
    from experiments.compile_only import explain_config

    rows = []
    for p in plans:
        config = importlib.import_module(f"experiments.configs.{Path(args.model).stem}").get_config()
        config.update(strategy=p.strategy, mesh=",".join(f"{a}={n}" for a, n in p.mesh.items()), batch_size=batch,
                      seq_len=seq, target=args.target, microbatches=1)  # fmt: skip  # what the planner planned
        if chosen:  # the planner's policy, as experiments.train --config.strategy=auto sets it
            config.model.remat = "none"
            config.kernels = ",".join(filter(None, [config.get("kernels", ""), f"remat={p.remat}"]))
        t0 = time.perf_counter()
        try:
            report, _ = explain_config(config)
        except Exception as e:  # the compiler's refusal (out of HBM) is a verdict on the plan, not an error here
            if not (why := sk.targets.out_of_memory(e)):
                raise
            rows.append((p, None, time.perf_counter() - t0, why[:60]))
            continue
        rows.append((p, report, time.perf_counter() - t0, ""))
    key = lambda r: (not (r[1] and r[1].fits), sum(c.bytes_sent for c in r[1].collectives) if r[1] else 0.0)
    where = f"{sk.target(args.target).compiler} for {args.target}" if args.target else "this machine's compiler"
    print(
        f"\nthe top {len(rows)} plans compiled by {where}, ranked by what it says (fits first, then collective bytes):"
    )
    head = (f"{'strategy':<12} {'mesh':<28} {'remat':<13} {'pred GiB':>9} {'peak GiB':>9} {'peak/pred':>9} "
            f"{'pred comm GiB':>13} {'comm GiB':>9} {'comm/pred':>9} {'fits':>5} {'compile s':>9}")  # fmt: skip
    print(head + "\n" + "-" * len(head))
    for p, r, t, why in sorted(rows, key=key):
        grid = ",".join(f"{a}={n}" for a, n in p.mesh.items() if n > 1)
        peak = f"{r.memory['peak'] / 2**30:>9.2f}" if r else f"{'-':>9}"
        comm = f"{sum(c.bytes_sent for c in r.collectives) / 2**30:>9.2f}" if r else f"{'-':>9}"
        fits = "yes" if r and r.fits else "NO"
        sent = sum(c.bytes_sent for c in r.collectives) if r else 0.0
        mem_ratio = f"{r.memory['peak'] / p.memory['total']:>9.3f}" if r else f"{'-':>9}"
        comm_ratio = f"{sent / p.comm_bytes:>9.3f}" if r and p.comm_bytes else f"{'-':>9}"
        print(
            f"{p.strategy:<12} {grid:<28} {p.remat:<13} {p.memory['total'] / 2**30:>9.2f} {peak} {mem_ratio} "
            f"{p.comm_bytes / 2**30:>13.2f} {comm} {comm_ratio} {fits:>5} {t:>9.1f}" + (f"  ({why})" if why else "")
        )


if __name__ == "__main__":
    main()
