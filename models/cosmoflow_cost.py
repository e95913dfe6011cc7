"""CosmoFlow's cost model: per-device halo and gradient traffic and memory of one train step, per spatial plan.

(Like models/gpt_cost.py, the file in models/ for this model that names mesh axes: the formulas are per strategy
and mesh; models/cosmoflow.py names none.) `CosmoFlowConfig.cost_model` (what `sk.explain` and `sk.plan` ask)
calls `comms` and `memory` here, for `dp` and the spatial strategies (`spatial`, `spatial_dp`, `*_halo`):

- halos: the explicit kernels' exchange (shardkit.parallel.spatial.halo_bytes, the same function the kernels
  record while traced, = compiled in tests/test_spatial.py and bench_spatial): per conv of a split block and per
  split axis, 2 collective-permutes forward and their 2 transposes backward, except the first conv (its input is
  data: no input gradient). Pools of 2^3 / stride 2 exchange nothing. GSPMD's halos (`spatial_dp`) send more (it
  re-exchanges the forward halo for the weight gradient: ~1.85x on cosmoflow_tiny, bench_spatial); this models
  the explicit kernels' traffic for both, as the lower bound.
- gradients: one all-reduce (ring, 2(p-1)/p) of the split blocks' conv weights over every mesh axis, and of the
  rest (later blocks, dense head, BatchNorm) over the batch axes (they run replicated over the spatial axes).
- memory: parameters + gradients + Adam's two moments (4 x the parameter bytes) and activations: per sample
  and block, the conv's input, its output and the pooled output (extent^3 x (c_in + 2 c_out) x nbytes), twice
  (the backward pass holds each one's gradient next to it), divided by the spatial degree in split blocks and
  by the batch degree. An estimate for planning, not a bound: XLA:CPU's compiled temporaries of the 3-block
  trunk in bench_spatial are 1.8x it (halo-padded copies, fusion buffers); bench_spatial prints both.
"""

from __future__ import annotations

import math
import types
from typing import Any

from shardkit.costmodel import Comm
from shardkit.parallel import spatial

SPATIAL_AXES = ("space", "space_h", "space_w")  # depth, height, width, as the spatial strategies' rules
MODELLED = ("dp", "spatial", "spatial_dp", "spatial_halo", "spatial_dp_halo")  # the built-ins formula() matches


def formula(strategy: Any) -> str | None:
    """ "dp" or "spatial" when `strategy` (a Strategy or registered name) is what these formulas model, read from
    its tables and kernels (never its name): the batch over data at most, depth / height / width over the spatial
    axes, weights replicated; None otherwise."""
    from shardkit.strategies import strategy as named

    t = named(strategy).traits()
    spatial = t.axes("depth", "height", "width")
    other = {n: a for n, a in t.compute.items() if n not in ("batch", "depth", "height", "width")}
    if t.step != "gspmd" or t.scoped or other or t.params or t.optimizer_only or set(t.batch) - {"data"}:
        return None
    dims = zip(("depth", "height", "width"), SPATIAL_AXES, strict=True)
    if any(t.axes(n) not in ((), (a,)) for n, a in dims):
        return None
    return "spatial" if spatial else "dp"


def _blocks(cfg: Any, size: int) -> list[tuple[int, int, int, bool]]:
    """(input extent, c_in, c_out, split) of each conv block."""
    out, c, s = [], cfg.in_channels, size
    for i, w in enumerate(cfg.widths):
        out.append((s, c, w, cfg.split(i)))
        c, s = w, s // 2
    return out


def _degrees(strategy: str, mesh: dict[str, int]) -> tuple[tuple[str | None, ...], int, int]:
    """(spatial axis per dimension, spatial degree, batch degree) of a plan."""
    axes = tuple(a if formula(strategy) == "spatial" and mesh.get(a, 1) > 1 else None for a in SPATIAL_AXES)
    return axes, math.prod(mesh[a] for a in axes if a), mesh.get("data", 1)


def comms(cfg: Any, strategy: str, mesh: dict[str, int], batch: int, size: int, nbytes: int) -> list[Comm]:
    axes, s_deg, b_deg = _degrees(strategy, mesh)
    fake = types.SimpleNamespace(shape=dict(mesh))  # plan_layer reads the mesh's sizes only
    out: list[Comm] = []
    split_w = rest_w = 0
    for i, (s, c_in, c_out, split) in enumerate(_blocks(cfg, size)):
        weights = 27 * c_in * c_out + (0 if cfg.batch_norm else c_out)
        if not split or s_deg == 1:
            rest_w += weights
            continue
        split_w += weights
        shape = (batch, s, s, s, c_in)
        plan = spatial.plan_layer(f"conv{i}", shape, (3,) * 3, (1,) * 3, (1,) * 3, "SAME", axes, fake)
        for axis, b in spatial.halo_bytes(plan, shape, b_deg, nbytes):
            n = 2 if i > 0 else 1  # forward + the transposed exchange, except for the data's first conv
            out.append(Comm("collective-permute", axis, mesh[axis], 1, n, n * b))
    f = cfg.widths[-1] * (size // 2 ** len(cfg.widths)) ** 3
    for h in (*cfg.dense, cfg.num_outputs):
        rest_w, f = rest_w + f * h + h, h
    rest_w += 2 * sum(cfg.widths) if cfg.batch_norm else 0
    ring = lambda p: 2 * (p - 1) / p
    every = [a for a in ("data", *SPATIAL_AXES) if mesh.get(a, 1) > 1]
    p_all = math.prod(mesh[a] for a in every)
    if split_w and p_all > 1:
        out.append(Comm("all-reduce", ",".join(every), p_all, 1, 1, ring(p_all) * split_w * nbytes))
    if rest_w and b_deg > 1:
        out.append(Comm("all-reduce", "data", b_deg, 1, 1, ring(b_deg) * rest_w * nbytes))
    return out


def memory(cfg: Any, strategy: str, mesh: dict[str, int], batch: int, size: int, nbytes: int) -> dict[str, float]:
    _, s_deg, b_deg = _degrees(strategy, mesh)
    params = cfg.num_params() * nbytes
    act = 0.0
    for s, c_in, c_out, split in _blocks(cfg, size):
        act += s**3 * (c_in + 2 * c_out) * nbytes / (s_deg if split else 1)
    act *= 2 * batch / b_deg
    mem = dict(params=params, grads=params, optimizer=2 * params, activations=act)
    return {**mem, "total": sum(mem.values())}


def divisibility(cfg: Any, strategy: str, mesh: dict[str, int], batch: int, size: int) -> str:
    """Why a plan does not fit the shapes ("" if it does): the batch over data, every split block's extent."""
    axes, _, b_deg = _degrees(strategy, mesh)
    if batch % b_deg:
        return f"batch {batch} not divisible by data={b_deg}"
    fake = types.SimpleNamespace(shape=dict(mesh))
    for i, (s, c_in, _, split) in enumerate(_blocks(cfg, size)):
        if split and any(axes):
            try:
                spatial.plan_layer(f"conv{i}", (batch, s, s, s, c_in), (3,) * 3, (1,) * 3, (1,) * 3, "SAME", axes, fake)
                spatial.plan_layer(f"pool{i}", (batch, s, s, s, c_in), (2,) * 3, (2,) * 3, (1,) * 3, "VALID", axes,
                                   fake, op="max pool")  # fmt: skip
            except Exception as e:  # a ShardkitError naming the layer: the reason this plan is dropped
                return str(e).split(";")[0]
    return ""
