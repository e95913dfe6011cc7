"""Which of the GPT's formulas describes a strategy, read from its tables and kernels (`Traits.of`), never its name.

The families (`MODELLED`) are named after the built-in strategies they describe: dp, zero1, fsdp, tp, tp_sp, fsdp_tp,
dp_fsdp_tp and tp3d (`formula`, on every backend); "cp" and "pp:<m>" (`tpu_formula`: context and pipeline
parallelism, verified against the TPU compiler only); block-level, forward-masked, cyclic SDP (`sdp_options`). A
strategy registered under a new name with a built-in's tables gets the built-in's formula; one that looks like a
built-in by name but not by its tables gets None (the rules tables' prediction, shardkit/costmodel_rules.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardkit.parallel.pipeline.schedules import parse
from shardkit.strategies import strategy as resolve
from shardkit.traits import Traits

#: shards of the parameters (and of gradients / optimizer state) per strategy, from (data, fsdp, tensor, 3D grid)
STATE_DEGREE: dict[str, Callable[[int, int, int, int], int]] = {
    "dp": lambda d, f, t, g3: 1,
    "zero1": lambda d, f, t, g3: 1,
    "fsdp": lambda d, f, t, g3: f,
    "tp": lambda d, f, t, g3: t,
    "tp_sp": lambda d, f, t, g3: t,
    "fsdp_tp": lambda d, f, t, g3: f * t,
    "dp_fsdp_tp": lambda d, f, t, g3: f * t,
    "tp3d": lambda d, f, t, g3: g3,
}
#: the formula families of comms.py and memory.py, named after the built-in strategies they describe
MODELLED = tuple(STATE_DEGREE)
TENSOR_NAMES = ("heads", "kv_heads", "kv", "mlp", "vocab")  # Megatron's split names (kv: Flax's heads)
_PLAIN_KERNELS = {"attention": ("dense", "cudnn"), "layers": ("scan", "unrolled")}


def formula(strategy: Any) -> str | None:
    """Which formula describes `strategy` (a Strategy or a registered name), read from its tables and kernels
    (`Traits.of`), never from its name; None when none does (context or pipeline parallelism, a step of
    its own, scoped rules, kernels the formulas do not model)."""
    t = Traits.of(strategy)
    if t.step != "gspmd" or t.scoped or t.sequence or t.stage or t.axes("experts", "depth", "height", "width"):
        return None
    if any(t.kernels.get(slot, ok[0]) not in ok for slot, ok in _PLAIN_KERNELS.items()):
        return None
    if set(t.compute) - {"batch", "res_seq", "embed", *TENSOR_NAMES}:
        return None  # splits names the GPT does not have (a CNN's channels): not what the formulas describe
    tensor, batch = t.axes(*TENSOR_NAMES), set(t.batch)
    if t.axes("embed"):  # AxoNN: embed over col, heads / mlp / vocab over row, weights over depth too
        ok = t.axes("embed") == ("col",) and tensor == ("row",) and t.gathered == ("depth",)
        return "tp3d" if ok and batch <= {"data", "depth"} and "depth" in batch else None
    if tensor not in ((), ("tensor",)) or t.gathered not in ((), ("fsdp",)):
        return None
    fsdp = bool(t.gathered)
    want = ("tensor",) if tensor else ()
    if any(t.params.get(n, ()) != want for n in TENSOR_NAMES) or t.params.get("embed", ()) != (
        ("fsdp",) if fsdp else ()
    ):
        return None  # the formulas assume Megatron's weights split as the activations, ZeRO-3's on embed
    if batch != ({"data", "fsdp"} if fsdp else {"data"}):
        return None
    if t.optimizer_only:
        return "zero1" if t.optimizer_only == ("data",) and not (fsdp or tensor) else None
    if t.residual_sequence:
        return "tp_sp" if t.residual_sequence == ("tensor",) and tensor and not fsdp else None
    return ("fsdp_tp" if tensor else "fsdp") if fsdp else ("tp" if tensor else "dp")


def cp_formula(strategy: Any) -> str | None:
    """Returns "cp" when `strategy` is context parallelism the TPU terms describe (the ring kernel over `seq`, the batch
    over `data`, nothing else split, GSPMD step), else None. Verified on TPU only (model.py asks it
    for backend "tpu"; on CPU such strategies keep the rules tables' prediction)."""
    t = Traits.of(strategy)
    ring = str(t.kernels.get("attention", "")).startswith("ring")
    plain = t.step == "gspmd" and not (t.scoped or t.stage or t.gathered or t.axes(*TENSOR_NAMES, "experts"))
    return "cp" if ring and plain and t.sequence == ("seq",) and set(t.batch) <= {"data"} else None


def tpu_formula(strategy: Any, mesh: dict[str, int]) -> str | None:
    """The TPU-only families (`cp_formula`, `pp_formula`), verified against the TPU compiler only; None if neither."""
    return cp_formula(strategy) or pp_formula(strategy, mesh)


def pp_formula(strategy: Any, mesh: dict[str, int]) -> str | None:
    """Returns "pp:<m>" (m microbatches) for a GPipe pipeline over `stage` with the batch not split, nothing else split
    (the `pp` strategy): the TPU terms (tpu.py) describe it; else None."""
    t = Traits.of(strategy)
    layers = str(t.kernels.get("layers", ""))
    plain = t.step == "gspmd" and not (t.scoped or t.gathered or t.batch or t.sequence)
    if not (plain and t.stage == ("stage",) and layers.startswith("pipeline:")) or "@" in layers:
        return None
    if t.axes(*TENSOR_NAMES, "experts", "embed"):
        return None
    kind, m, _ = parse(layers.partition(":")[2], mesh.get("stage", 1))
    return f"pp:{m}" if kind == "gpipe" else None


def sdp_options(strategy: Any) -> Any:
    """The SDP options `sdp_terms` covers (block-level, forward masking, cyclic ownership over data), else None."""
    s = resolve(strategy)
    wanted = {"granularity": "block", "masking": "forward", "ownership": "cyclic", "axis": "data"}
    ok = all(getattr(s.options, k, None) == v for k, v in wanted.items())
    return s.options if s.step == "sdp" and ok else None


__all__ = ["MODELLED", "STATE_DEGREE", "TENSOR_NAMES", "cp_formula", "formula", "pp_formula", "sdp_options",
           "tpu_formula"]  # fmt: skip
