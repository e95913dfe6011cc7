"""The 3D U-Net's cost model: per-device halo and gradient traffic and activation memory of one train step.

(The U-Net's counterpart of models/cosmoflow_cost.py, which it shares `formula` and the mesh-axis names with;
models/unet3d.py names no mesh axis.) `UNet3DCostModel`, registered for UNet3DConfig (what `sk.explain` and
`sk.plan` ask), calls `comms` and `memory` here for `dp` and the spatial strategies (`spatial`, `spatial_dp`,
`*_halo`). Every layer of the U-Net keeps the volume layout, so every layer is split.

- halos: per 3^3 conv and split axis, the explicit kernels' exchange (shardkit.parallel.spatial.halo_bytes): 2
  collective-permutes forward and their 2 transposes backward, except the first conv (its input is data). Pools
  of 2^3 / stride 2 and the 1^3 head exchange nothing; GSPMD's halos (`spatial_dp`) send more (see CosmoFlow's).
- gradients: one all-reduce (ring) of every weight over every mesh axis of size > 1 (they are replicated).
- memory: parameters + gradients + Adam's two moments, and `activation_bytes` (its docstring: the terms).
"""

from __future__ import annotations

import math
import types
from typing import Any

import shardkit as sk
from models.conv3d import remat_unmodelled
from models.cosmoflow_cost import SPATIAL_AXES, formula
from models.unet3d import UNet3DConfig
from shardkit.costmodel import Comm, CostModel, Terms
from shardkit.parallel import spatial


def _convs(cfg: Any) -> list[tuple[int, int, int, bool, int]]:
    """(level, c_in, c_out, BatchNorm after it, kernel) of every conv, in the forward order."""
    w, out, c = cfg.widths, [], cfg.in_channels
    for level, width in enumerate(w):  # the encoder's pairs, then the bottleneck's
        out += [(level, c, width, True, 3), (level, width, width, True, 3)]
        c = width
    for level in reversed(range(len(w) - 1)):  # up-conv (ReLU, no BatchNorm), then the pair on the concatenation
        out += [(level, w[level + 1], w[level], False, 3), (level, 2 * w[level], w[level], True, 3)]
        out += [(level, w[level], w[level], True, 3)]
    return [*out, (0, w[0], cfg.num_classes, False, 1)]  # the 1^3 head


def _local(cfg: Any, strategy: str, mesh: dict[str, int], batch: int, extents: tuple[int, ...]) -> Any:
    """(local voxels per level, halo-padded local voxels per level, the halo transposes' pad buffers per level
    (elements per input channel), spatial axes, batch degree), per device."""
    axes = tuple(a if formula(strategy) == "spatial" and mesh.get(a, 1) > 1 else None for a in SPATIAL_AXES)
    degs, b = [mesh[a] if a else 1 for a in axes], batch // mesh.get("data", 1)
    vox, padded, pads = [], [], []
    for level in range(len(cfg.widths)):
        local = [e // 2**level // d for e, d in zip(extents, degs, strict=True)]
        grown = [e + 2 * (d > 1) for e, d in zip(local, degs, strict=True)]  # k=3: halo (1, 1) per split axis
        vox.append(b * math.prod(local))
        padded.append(b * math.prod(grown))
        # the backward undoes the exchange last axis first: 2 pads per split axis, the earlier axes still grown
        pads.append(sum(2 * b * math.prod(grown[:d] + local[d:]) for d in range(3) if degs[d] > 1))
    return vox, padded, pads, axes, mesh.get("data", 1)


def comms(cfg: Any, strategy: str, mesh: dict[str, int], batch: int, extents: tuple[int, ...],
          nbytes: int) -> list[Comm]:  # fmt: skip
    *_, axes, b_deg = _local(cfg, strategy, mesh, batch, extents)
    fake = types.SimpleNamespace(shape=dict(mesh))  # plan_layer reads the mesh's sizes only
    out: list[Comm] = []
    for i, (level, c_in, _, _, k) in enumerate(_convs(cfg)):
        if k == 1 or not any(axes):
            continue
        shape = (batch, *(e // 2**level for e in extents), c_in)
        plan = spatial.plan_layer(f"conv{i}", shape, (k,) * 3, (1,) * 3, (1,) * 3, "SAME", axes, fake)
        for axis, b in spatial.halo_bytes(plan, shape, b_deg, nbytes):
            n = 2 if i > 0 else 1  # forward + the transposed exchange, except for the data's first conv
            out.append(Comm("collective-permute", axis, mesh[axis], 1, n, n * b))
    every = [a for a in ("data", *SPATIAL_AXES) if mesh.get(a, 1) > 1]
    p = math.prod(mesh[a] for a in every)
    if every:
        out.append(Comm("all-reduce", ",".join(every), p, 1, 1, 2 * (p - 1) / p * cfg.num_params() * nbytes))
    return out


def activation_bytes(cfg: Any, strategy: str, mesh: dict[str, int], batch: int, extents: tuple[int, ...],
                     nbytes: int, backend: str = "gpu") -> dict[str, float]:  # fmt: skip
    """Per-device peak of the step's temporaries (bytes), a walk over the convs in forward order. `V`, `V'`: a
    conv level's local voxels without and with the halos (1 plane per side on each split axis); values of
    `nbytes`, indices int32 (4 bytes):

        term               bytes                     backend   what it is
        conv input         c_in V' x nbytes, a conv  any       the weight gradient's operand (XLA:CPU: transposed)
        conv output        c_out V x nbytes, a conv  any       BatchNorm's input, or the up-conv's ReLU's
        centred            c_out V x nbytes          any       BatchNorm's x - mean, kept for the backward
        pool input         w V x nbytes, a pool      gpu/tpu   select-and-scatter's operand (estimate: no GPU here)
        argmax indices     5 w V / 8 x 4, a pool     XLA:CPU   SelectAndScatterExpander's reduce-window, kept
        label indices      2 x 5 V0 x 4              any       the cross-entropy's label gather and its transpose
        loss scratch       V0 x 4                    any       the per-voxel loss (the logits: the head's output)
        working set        w0 V0 x nbytes            any       the last ReLU's output, the head's input
        conv backward      (c_in V' + c_out V) x nb  any       a conv's input and output gradients
        halo pads          2 c_in x input, an axis   XLA:CPU   the exchange's transpose (slices' pads), unfused

    The peak is the larger of the end of the forward pass (every saved term, the loss, the working set) and each
    conv's backward (the saved terms of the convs before it: XLA:CPU has freed its own after its BatchNorm's and
    weight's gradients, and its backward terms). XLA:CPU (measured) peaks at the former on one device and on the
    up-path's first level-0 conv under 2- and 3-axis splits. Measured predicted / compiled (unet3d_tiny, S = 1, 2,
    4, 8): docs/spatial.md.
    """
    vox, padded, pads, _, _ = _local(cfg, strategy, mesh, batch, extents)
    cpu, levels = backend == "cpu", len(cfg.widths) - 1
    saved, xla_cpu, backward = 0.0, 0.0, [(0.0, 0.0)]
    for i, (level, c_in, c_out, norm, k) in enumerate(_convs(cfg)):
        seen = c_in * (padded if k == 3 else vox)[level]
        if i > 0 and k == 3:  # its backward, after its weight gradient: the input's and the output's gradients
            extra = c_in * pads[level] * nbytes * cpu  # XLA:CPU's pads of the halo transposes
            backward.append((saved + (seen + c_out * vox[level]) * nbytes + extra, xla_cpu + extra))
        saved += (seen + c_out * vox[level] * (1 + norm)) * nbytes
        if i < 2 * levels and i % 2:  # the encoder pair's second conv: the pool follows
            pooled = cfg.widths[level] * vox[level] // 8
            xla_cpu += 5 * 4 * pooled * cpu
            saved += 5 * 4 * pooled if cpu else 8 * pooled * nbytes
    end = saved + 2 * 5 * 4 * vox[0] + 4 * vox[0] + cfg.widths[0] * vox[0] * nbytes
    act, part = max([(end, xla_cpu), *backward])
    return dict(activations=act, xla_cpu=part)


def memory(cfg: Any, strategy: str, mesh: dict[str, int], batch: int, extents: tuple[int, ...], nbytes: int,
           backend: str = "gpu") -> dict[str, float]:  # fmt: skip
    """Parameters, gradients, Adam's two moments and the activations' peak, per device (as CosmoFlow's: the
    `xla_cpu` part of `activations` is not added again to `total`)."""
    params = cfg.num_params() * nbytes
    act = activation_bytes(cfg, strategy, mesh, batch, extents, nbytes, backend)
    mem = dict(params=params, grads=params, optimizer=2 * params, activations=act["activations"])
    return {**mem, "total": sum(mem.values()), "xla_cpu": act["xla_cpu"]}


@sk.costmodel.register(UNet3DConfig)
class UNet3DCostModel(CostModel):
    """The U-Net's halos, gradients and memory per step (module docstring); None for a strategy not modelled.
    Needs the volume's shape (`batch_shapes["volume"]`: the config has no size)."""

    cfg: UNet3DConfig

    def predict(
        self, strategy: Any, mesh: dict[str, int], batch_shapes: dict[str, tuple[int, ...]], nbytes: int, backend: str
    ) -> Terms | None:
        family = formula(strategy)  # from the strategy's tables, not its name
        if family is None:
            return None
        volume = next((v for k, v in batch_shapes.items() if k.strip("[]'") == "volume"), None)  # explain: "['volume']"
        if volume is None or len(volume) != 5:
            raise sk.ShardkitError(
                f"UNet3D's cost model needs the volume's shape [batch, D, H, W, C] as batch_shapes['volume'], got "
                f"{batch_shapes}; pass the batch (sk.explain does)"
            )
        batch, extents = volume[0], tuple(volume[1:4])
        comms_ = comms(self.cfg, strategy, mesh, batch, extents, nbytes)
        memory_ = memory(self.cfg, strategy, mesh, batch, extents, nbytes, backend)
        unmodelled = remat_unmodelled(strategy)
        source = f"models/unet3d_cost.py ({family}: explicit halo exchange + gradient all-reduce{unmodelled})"
        return comms_, memory_, source
