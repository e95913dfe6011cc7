"""The GPT's shape numbers as its cost formulas read them, and whether they divide a mesh.

The formulas take any object with GPTConfig's fields (models/gpt.py): `shape` reads them, `fc_layers` lists a block's
four projections (AxoNN's FC1 / FC2 alternation), `num_params` counts the parameters, `divisibility` says why a
batch or a projection does not split over a mesh under one of the formula families (models/gpt_cost/classify.py).
"""

from __future__ import annotations

from typing import Any

from models.gpt_loss import auto_head
from shardkit.costmodel import TP3D_ORDER
from shardkit.errors import ShardkitError


def shape(cfg: Any) -> dict[str, int]:
    """The GPT shape numbers the formulas use (models/gpt.py GPTConfig, or any object with those fields)."""
    names = ("d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size")
    try:
        return {n: int(getattr(cfg, n)) for n in names}
    except AttributeError as e:
        raise ShardkitError(f"model config {type(cfg).__name__} lacks {e.name!r}; give a GPTConfig-like object") from e


def fc_layers(cfg: Any) -> list[tuple[str, int, int, bool]]:
    """The four projections of one block as (name, H1 in, H2 out, transposed): AxoNN's FC1/FC2 alternation."""
    c = shape(cfg)
    e, n, k, hd, f = c["d_model"], c["num_heads"], c["num_kv_heads"], c["head_dim"], c["mlp_dim"]
    return [("qkv", e, (n + 2 * k) * hd, False), ("out", n * hd, e, True), ("mlp_in", e, 2 * f, False),
            ("mlp_out", f, e, True)]  # fmt: skip


def blocks_per_layer(cfg: Any) -> int:
    """Elements of one block's four projection matrices."""
    return sum(h1 * h2 for _, h1, h2, _ in fc_layers(cfg))


def num_params(cfg: Any) -> int:
    """Parameters of the GPT: the config's own count when it has one (tied embeddings), else untied."""
    if callable(getattr(cfg, "num_params", None)):
        return int(cfg.num_params())
    c = shape(cfg)
    blocks = sum(h1 * h2 for _, h1, h2, _ in fc_layers(cfg)) + 2 * c["d_model"]
    return c["num_layers"] * blocks + c["d_model"] * (2 * c["vocab_size"] + 1)


def logit_tokens(cfg: Any, tokens: float, seq_len: int, platform: str = "cpu", vocab_split: int = 1) -> float:
    """How many positions' logits live at once: all of a device's `tokens`, or one chunk of each sequence under
    `GPTConfig.loss_chunk` (the chunked loss keeps each chunk's gradients, not its logits); a `loss_chunk` of None
    is chosen as the model chooses it on `platform` (models/gpt_loss.py `auto_head`), for a device's logits
    `tokens` x vocabulary / `vocab_split`."""
    chunk = getattr(cfg, "loss_chunk", 0)
    if chunk is None:
        chunk = auto_head(cfg, platform, seq_len, tokens * int(cfg.vocab_size) / vocab_split)[1]
    return tokens * min(1.0, chunk / seq_len) if chunk else tokens


def divisibility(strategy: str, cfg: Any, mesh: dict[str, int], global_batch: int) -> str:
    """Why `global_batch` or the GPT's shapes do not split over `mesh` under the formula family `strategy` ("" if
    they do): the batch over its axes, tp3d's projections over their grid, Megatron's heads and mlp over tensor."""
    c = shape(cfg)
    if strategy == "tp3d":
        gx, gy, gz, gd = (mesh.get(a, 1) for a in TP3D_ORDER)
        if global_batch % (gd * gz):
            return f"batch {global_batch} not divisible by G_d·G_z = {gd * gz}"
        for name, h1, h2, tr in fc_layers(cfg):
            gin, gout = (gy, gx) if tr else (gx, gy)
            if h1 % gin or h2 % (gout * gz):
                return f"{name} [{h1}, {h2}] not divisible by G_in={gin}, G_out·G_z={gout * gz}"
        return ""
    d, f, t = (mesh.get(a, 1) for a in ("data", "fsdp", "tensor"))
    if global_batch % (d * f):
        return f"batch {global_batch} not divisible by data·fsdp = {d * f}"
    if t > 1 and (c["num_heads"] % t or c["num_kv_heads"] % t or c["mlp_dim"] % t):
        return f"heads {c['num_heads']} / kv_heads {c['num_kv_heads']} / mlp {c['mlp_dim']} not divisible by tensor={t}"
    return ""


__all__ = ["blocks_per_layer", "divisibility", "fc_layers", "logit_tokens", "num_params", "shape"]
