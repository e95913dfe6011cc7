"""CosmoFlow's cost model: per-device halo and gradient traffic and memory of one train step, per spatial plan.

(Like models/gpt_cost/, the file in models/ for this model that names mesh axes: the formulas are per strategy
and mesh; models/cosmoflow.py names none.) `CosmoFlowCostModel`, the `sk.costmodel.CostModel` registered for
CosmoFlowConfig (what `sk.explain` and `sk.plan` ask), calls `comms` and `memory` here, for `dp` and the spatial
strategies (`spatial`, `spatial_dp`, `*_halo`):

- halos: the explicit kernels' exchange (shardkit.parallel.spatial.halo_bytes, the same function the kernels
  record while traced, = compiled in tests/test_spatial.py and bench_spatial): per conv of a split block and per
  split axis, 2 collective-permutes forward and their 2 transposes backward, except the first conv (its input is
  data: no input gradient). Pools of 2^3 / stride 2 exchange nothing. GSPMD's halos (`spatial_dp`) send more (it
  re-exchanges the forward halo for the weight gradient: ~1.85x on cosmoflow_tiny, bench_spatial); this models
  the explicit kernels' traffic for both, as the lower bound.
- gradients: one all-reduce (ring, 2(p-1)/p) of the split blocks' conv weights over every mesh axis, and of the
  rest (later blocks, dense head, BatchNorm) over the batch axes (they run replicated over the spatial axes).
- memory: parameters + gradients + Adam's two moments (4 x the parameter bytes) and the activations' peak per
  device (`activation_bytes`: a walk over the blocks, a table of its terms in its docstring). On XLA:CPU
  (backend "cpu") it is the compiled temporaries within 3% for cosmoflow_tiny at spatial degree 1, 2, 4, 8
  (docs/spatial.md; tests/test_spatial_memory.py), 72% of which XLA:CPU's max-pool gradient expansion alone
  allocates (reported as `xla_cpu`); on a GPU it is an estimate of the same terms without that expansion (not
  measured: no GPU here). The previous estimate (each block's input, output and pooled output, twice) was half
  the compiled figure.
"""

from __future__ import annotations

import math
import types
from typing import Any

import shardkit as sk
from models.conv3d import remat_unmodelled
from models.cosmoflow import CosmoFlowConfig
from shardkit.costmodel import Comm, CostModel, Terms
from shardkit.parallel import spatial
from shardkit.traits import Traits

SPATIAL_AXES = ("space", "space_h", "space_w")  # depth, height, width, as the spatial strategies' rules
MODELLED = ("dp", "spatial", "spatial_dp", "spatial_halo", "spatial_dp_halo")  # the built-ins formula() matches


def formula(strategy: Any) -> str | None:
    """ "dp" or "spatial" when `strategy` (a Strategy or registered name) is what these formulas model, read from
    its tables and kernels (never its name): the batch over data at most, depth / height / width over the spatial
    axes, weights replicated; None otherwise."""
    t = Traits.of(strategy)
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


def _local(cfg: Any, strategy: str, mesh: dict[str, int], batch: int, size: int) -> list[tuple[int, int, int]]:
    """Per conv block, elements per device of (the conv's input as the backward pass keeps it: halo-padded by 1
    plane per side on each split axis, its output, the pooled output)."""
    axes, _, b_deg = _degrees(strategy, mesh)
    degs = [mesh[a] if a else 1 for a in axes]
    out = []
    for s, c_in, c_out, split in _blocks(cfg, size):
        local = [s // d if split else s for d in degs]
        padded = [e + 2 if split and d > 1 else e for e, d in zip(local, degs, strict=True)]  # k=3: halo (1, 1)
        vox = batch // b_deg * math.prod(local)
        out.append((batch // b_deg * math.prod(padded) * c_in, vox * c_out, vox * c_out // 8))
    return out


def activation_bytes(
    cfg: Any, strategy: str, mesh: dict[str, int], batch: int, size: int, nbytes: int, backend: str = "gpu"
) -> dict[str, float]:
    """Per-device peak of the step's temporaries (bytes), a walk over the conv blocks. Per block, elements per
    device of the conv's input (`in`, halo-padded: extent + 2 per split axis), output (`out`) and pooled output
    (`pooled`); values of `nbytes`, indices int32 (4 bytes):

        term               bytes per block      backend   what it is
        conv input         in x nbytes          any       the weight gradient's operand (XLA:CPU: a transposed copy)
        conv output        out x nbytes         any       BatchNorm's input (LeakyReLU's without BatchNorm)
        centred            out x nbytes         any       BatchNorm's x - mean, kept for the backward
        pool input         out x nbytes         gpu/tpu   select-and-scatter's operand (estimate: no GPU here)
        pool iotas         5 out x 4            XLA:CPU   SelectAndScatterExpander: one iota per dimension of the
                                                          pool input, every pool's, from the step's start to its pool
        scatter operand    out x nbytes         XLA:CPU   the expander's zeros of the pool input's shape, every
                                                          pool's, from the forward pass to the pool's gradient
        argmax indices     5 pooled x 4         XLA:CPU   the expander's reduce-window result, kept for the backward
        working set        (out + pooled) x nb  any       the running pool's input and output

    XLA:CPU (measured) peaks at the first pool of the forward pass, every block's iotas and scatter operands live:
    the max over blocks i of the iotas of blocks >= i, every scatter operand, the saved terms (conv input, output,
    centred, argmax) of blocks <= i and block i's working set. Elsewhere (estimated) the saved terms with the pool
    input in place of the expander's, up to the block whose working set or backward (its pool input's and conv
    output's gradients, 2 out x nbytes) is largest. The dense head is small and not counted. Measured predicted /
    compiled (cosmoflow_tiny, S = 1, 2, 4, 8): docs/spatial.md.
    """
    blocks, cpu, conv_terms = _local(cfg, strategy, mesh, batch, size), backend == "cpu", 2 + cfg.batch_norm
    conv = [(i_n + (conv_terms - 1) * o) * nbytes for i_n, o, _ in blocks]  # input, output, BatchNorm centred
    work = [(o + p) * nbytes for _, o, p in blocks]
    if cpu:
        iotas = [5 * 4 * o for _, o, _ in blocks]
        zeros = sum(o * nbytes for _, o, _ in blocks)
        argmax = [5 * 4 * p for _, _, p in blocks]
        only = [sum(iotas[i:]) + zeros + sum(argmax[: i + 1]) for i in range(len(blocks))]  # XLA:CPU's terms
        peaks = [only[i] + sum(conv[: i + 1]) + work[i] for i in range(len(blocks))]
        top = max(range(len(blocks)), key=peaks.__getitem__)
        return dict(activations=peaks[top], xla_cpu=only[top])
    saved = [c + o * nbytes for c, (_, o, _) in zip(conv, blocks, strict=True)]  # + the pool input
    grads = [2 * o * nbytes for _, o, _ in blocks]
    peak = max(max(sum(saved[: i + 1]) + work[i], sum(saved[: i + 1]) + grads[i]) for i in range(len(blocks)))
    return dict(activations=peak, xla_cpu=0.0)


def memory(
    cfg: Any, strategy: str, mesh: dict[str, int], batch: int, size: int, nbytes: int, backend: str = "gpu"
) -> dict[str, float]:
    """Parameters, gradients, Adam's two moments and the activations' peak (`activation_bytes`), per device;
    `xla_cpu` is the part of `activations` that only XLA:CPU allocates (0 elsewhere), not added again to `total`."""
    params = cfg.num_params() * nbytes
    act = activation_bytes(cfg, strategy, mesh, batch, size, nbytes, backend)
    mem = dict(params=params, grads=params, optimizer=2 * params, activations=act["activations"])
    return {**mem, "total": sum(mem.values()), "xla_cpu": act["xla_cpu"]}


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


@sk.costmodel.register(CosmoFlowConfig)
class CosmoFlowCostModel(CostModel):
    """CosmoFlow's halos, gradients and memory per step (module docstring); None for a strategy not modelled."""

    cfg: CosmoFlowConfig
    #: What `sk.plan` tries by default: the batch over data, and the volume split with explicit halos (the
    #: formulas model no other exchange; `spatial_halo`'s meshes include data x space).
    plan_strategies = ("dp", "spatial_halo")

    def predict(
        self, strategy: Any, mesh: dict[str, int], batch_shapes: dict[str, tuple[int, ...]], nbytes: int, backend: str
    ) -> Terms | None:
        family = formula(strategy)  # from the strategy's tables, not its name
        if family is None:
            return None
        batch = next(iter(batch_shapes.values()))[0]
        comms_ = comms(self.cfg, strategy, mesh, batch, self.cfg.size, nbytes)
        memory_ = memory(self.cfg, strategy, mesh, batch, self.cfg.size, nbytes, backend)
        unmodelled = remat_unmodelled(strategy)
        source = f"models/cosmoflow_cost.py ({family}: explicit halo exchange + gradient all-reduces{unmodelled})"
        return comms_, memory_, source

    def indivisible(self, strategy: Any, mesh: dict[str, int], global_batch: int) -> str:
        """Why the volume or batch does not split over `mesh` ("" if they do)."""
        return divisibility(self.cfg, strategy, mesh, global_batch, self.cfg.size)
