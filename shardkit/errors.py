"""The one exception shardkit raises for bad configuration.

Every message names the offending value and says how to fix it, and is raised before XLA sees the program.
"""

from __future__ import annotations

import re
from typing import Any


class ShardkitError(ValueError):
    """A configuration error with an actionable message (what is wrong, the values involved, the fix)."""


def unbound_axis_name(error: NameError, model: Any) -> ShardkitError | None:
    """The ShardkitError for JAX's "unbound axis name" (a collective over an axis name no mesh axis binds, such as
    Flax's pmap-era `BatchNorm(axis_name="batch")`), naming the modules that carry that `axis_name`; None for any
    other NameError. Under shardkit's GSPMD strategies a mean over the batch dimension is already the global batch's
    (the compiler adds the reduction), so such a module computes one device's statistics without its axis_name."""
    found = re.search(r"unbound axis name: (\S+?)\.?(\s|$)", str(error))
    if found is None:
        return None
    name = found.group(1)
    carriers = []
    try:
        from flax import nnx

        for path, node in nnx.iter_graph(model):
            inner = getattr(node, "module", None)  # a Linen module inside nnx.bridge.ToNNX
            for obj in (node, inner):
                if obj is not None and getattr(obj, "axis_name", None) == name:
                    carriers.append(f"{'/'.join(map(str, path)) or '<model>'} ({type(obj).__name__})")
    except Exception:  # the model's graph could not be walked: the message names the axis only
        pass
    where = f" in {', '.join(dict.fromkeys(carriers))}" if carriers else ""
    return ShardkitError(
        f"the model runs a collective over axis name {name!r}{where}, which no mesh axis binds in a shardkit step "
        f"(pmap-era code, e.g. nn.BatchNorm(axis_name={name!r})): under shardkit's strategies a mean over the batch "
        f"dimension is already over the global batch, so drop axis_name={name!r} (the statistics are then one "
        "device's, exactly); for per-group statistics use the `norm` kernel slot (--config.kernels=norm=group)"
    )


def sharding_mode_error(error: Exception, strategy: str, explicit: bool) -> ShardkitError | None:
    """The ShardkitError for a model whose sharding mode is not the step's, raised by JAX while the loss is traced;
    None for any other error.

    - `explicit` (strategy 'annotated' on a mesh with Explicit axes: JAX's explicit sharding mode): JAX's
      ShardingTypeError, an op whose result layout is ambiguous, as in a model written for GSPMD.
    - Otherwise (the step took the mesh's axes as Auto): JAX's refusal of `out_sharding=` / `reshard` over Auto
      axes, as in a model written in explicit mode."""
    text = str(error).split("\n")[0]
    if explicit and type(error).__name__ == "ShardingTypeError":
        return ShardkitError(
            f"strategy {strategy!r} on a mesh with Explicit axes runs the model in JAX's explicit sharding mode, "
            f"where this op's layout is ambiguous: {text}. Give it out_sharding=... (explicit mode), or let GSPMD "
            "choose: the same mesh with Auto axes, sk.make_mesh('data=2,fsdp=4') or jax.make_mesh(..., "
            "axis_types=(jax.sharding.AxisType.Auto,) * n)"
        )
    if not explicit and "of type Auto" in text and ("PartitionSpec" in text or "reshard" in text):
        return ShardkitError(
            f"the model is written in JAX's explicit sharding mode (out_sharding= / jax.sharding.reshard over mesh "
            f"axes), but strategy {strategy!r} runs on Auto axes, where JAX refuses them: {text}. Train it under "
            "strategy 'annotated' on a mesh with Explicit axes (jax.make_mesh's default), or drop the out_sharding= "
            "and reshard calls so that the strategy's rules decide the layouts"
        )
    return None
