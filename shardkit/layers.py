"""How a model's stack of identical layers is applied: one call the strategy can swap (scan, or a pipeline).

Models keep their blocks as one module whose parameters have a leading `layers` dimension and call

    x = sk.layers.apply_stack(block_fn, stacked_state, x, positions, segment_ids, remat="none")

with `block_fn(layer_state, x, *args) -> x`; `args` are per-example arrays ([batch, ...], or None) that travel
with `x`. The default kernel is a `lax.scan` (compile time independent of depth). A strategy whose `layers`
kernel table names another `layers` kernel (e.g. a pipeline schedule) gets the same call instead. Each layer runs
under the strategy's `remat` kernel (`kernels={"remat": "dots"}`: which activations the backward pass keeps and
which it recomputes, docs/memory.md); a model that scans its stacked layers itself wraps its body in `checkpoint`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from shardkit import kernels, offload
from shardkit.batch_layers import (  # noqa: F401  (sk.layers.BatchNorm, ...: layers that read which rows a call sees)
    BatchNorm,
    Dropout,
    LocalBatch,
    current_local_batch,
    lane_sum,
    local_batch,
    norm_groups,
)
from shardkit.errors import ShardkitError
from shardkit.rules import compile_devices, current_context, family, platform_family

BlockFn = Callable[..., jax.Array]
StackKernel = Callable[..., jax.Array]


def register_stack(name: str, fn: StackKernel, configure: Callable[[str, dict], str] | None = None) -> None:
    """A strategy with `kernels={"layers": name}` makes `apply_stack` call
    `fn(block_fn, stacked, x, *args, remat, context)`; a name may carry options after a colon ("pipeline:1f1b").

    `remat` is the name of the remat kernel that runs (resolved by `apply_stack`): wrap the per-layer body with
    `sk.layers.checkpoint(body, remat)`."""
    kernels.register("layers", name, fn, configure=configure)


def scan_stack(
    block_fn: BlockFn, stacked: Any, x: jax.Array, *args: Any, remat: str = "none", context: Any = None
) -> jax.Array:
    """x -> block_fn(stacked[L-1], ... block_fn(stacked[0], x, *args) ..., *args) as one `lax.scan`."""

    def body(x: jax.Array, layer: Any) -> tuple[jax.Array, None]:
        return block_fn(layer, x, *args), None

    return jax.lax.scan(checkpoint(body, remat), _varying_like(x, stacked), stacked)[0]


def _varying_like(carry: Any, stacked: Any) -> Any:
    """Inside shard_map (hetero_dp's per-device loop), the carry's leaves varying over every manual axis that any
    carry leaf or layer varies over: a layer mixes them, and scan needs the carry's type to be the same after it
    (the MoE GPT's (x, zeros(3)) carry: x varies over `data`, the zeros did not)."""

    def vma(a: Any) -> frozenset:
        t = jax.typeof(a)  # jax 0.12: aval.vma; jax 0.10: aval.manual_axis_type.varying
        return frozenset(getattr(t, "vma", None) or getattr(getattr(t, "manual_axis_type", None), "varying", ()))

    axes = frozenset().union(*(vma(a) for a in jax.tree.leaves((carry, stacked))))
    cast = lambda a: jax.lax.pcast(a, tuple(sorted(axes - vma(a))), to="varying") if axes - vma(a) else a
    return jax.tree.map(cast, carry) if axes else carry


register_stack("scan", scan_stack)


def unrolled_stack(
    block_fn: BlockFn, stacked: Any, x: jax.Array, *args: Any, remat: str = "none", context: Any = None
) -> jax.Array:
    """The same as `scan_stack` as L inlined layers: no per-layer dynamic slices of the weights, no stacked
    residuals written and read back by dynamic-update-slice; compile time grows with L."""
    body = checkpoint(lambda layer, x: block_fn(layer, x, *args), remat)
    # one split per weight (its transpose is one concatenation), not L slices (whose transposes are L pads + adds)
    n = jax.tree.leaves(stacked)[0].shape[0]
    pieces = jax.tree.map(lambda a: [p[0] for p in jnp.split(a, n)], stacked)
    for i in range(n):
        x = body(jax.tree.map(lambda a, i=i: a[i], pieces, is_leaf=lambda a: isinstance(a, list)), x)
    return x


register_stack("unrolled", unrolled_stack)


def apply_stack(block_fn: BlockFn, stacked: Any, x: jax.Array, *args: Any, remat: str = "none") -> jax.Array:
    """Applies the L stacked layers to x with the kernel the active strategy chose (default: scan), each layer
    rematerialized by the strategy's `remat` kernel (or the policy the model passes as `remat=`: `combine_remat`)."""
    name = resolve_remat(remat)
    remat_policy(name)  # a bad name or an unsupported offload: ShardkitError before any kernel traces
    kernel, _, ctx = kernels.active("layers")
    return kernel.fn(block_fn, stacked, x, *args, remat=name, context=ctx)


# ------------------------------------------------------------------------------------------------------------
# Rematerialization slot (docs/memory.md). The strategy's `kernels={"remat": policy}` (`--config.kernels=remat=...`)
# names which activations each stacked layer keeps for the backward pass; the rest is recomputed there. Every
# policy is a `jax.checkpoint` policy around one layer's body, applied by the layer-stack kernels above (and by
# any model's own scan through `checkpoint(body)`), so it reaches every model's stacked layers. Values a model
# tags with `sk.layers.tag(x, name)` (jax's `checkpoint_name`) can be saved, or offloaded to host memory, by name.
DEFAULTS = kernels.DEFAULTS
DEFAULTS.setdefault("remat", "none")

#: The remat policies, as they are written (`names:` / `offload:` take a comma-separated list of tagged names).
#: The named policies that take no argument: what the planner, `explain --remat_policies=all` and bench_memory try.
REMAT_POLICIES = ("none", "full", "dots", "dots_no_batch")
REMAT_CHOICES = (*REMAT_POLICIES, "names:<a,b>", "offload:<a,b>")
#: The host memory kind offloaded residuals go to, and what a backend must have for `offload:`.
OFFLOAD_DST = offload.HOST


def _no_options(name: str, base: str) -> None:
    if name != base:
        raise ShardkitError(
            f"remat policy {name!r}: {base!r} takes no options; choose one of {', '.join(REMAT_CHOICES)}"
        )


def remat_names(policy: str) -> tuple[str, ...]:
    """The tagged names a `names:<a,b>` / `offload:<a,b>` policy keeps (saved or offloaded); () for the others."""
    base = policy.partition(":")[0]
    return _names_of(policy, base) if base in ("names", "offload") else ()


def _names_of(name: str, base: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in name.partition(":")[2].split(","))
    if name == base or not all(names):
        raise ShardkitError(
            f"remat policy {name!r}: give the tagged names after a colon, comma-separated, e.g. "
            f"'{base}:attn_qkv,mlp_hidden' (the names the models tag: docs/memory.md)"
        )
    return names


def _host_memory(platform: str) -> str | None:
    """Why `platform`'s devices cannot offload activations to `OFFLOAD_DST` memory ("" if they can).

    The devices asked are those the program is compiled for (`rules.compile_devices`: a TPU target's compile-only
    devices list their memories too), else this host's of that platform. Neither exists for an accelerator known
    only by an abstract mesh (a `shard_map` body of a step that set no concrete mesh, on a target's devices): then
    nothing is refused here: the up-front check of the strategy's table (`kernels.check` under
    `rules.compiling_for(mesh)`) is where the real devices are asked, and GPUs and TPUs have `pinned_host`
    (shardkit/offload.py)."""
    devices = compile_devices() if platform_family() == platform else []
    devices = devices or [d for d in jax.devices() if family(d.platform) == platform]
    why = offload.unsupported(devices) if devices else ""  # the same check as the state offload's (offload.py)
    if not why and platform == "cpu":  # jax 0.10-0.12: tests/test_offload.py checks the compiled program for S(5)
        return ("its device memory is host memory, and XLA:CPU compiles the policy's moves to pinned_host away "
                "(nothing moves; the optimizer state and parameters can rest there: Strategy.offload)")  # fmt: skip
    return why


def _none(name: str, platform: str) -> None:
    _no_options(name, "none")
    return None


def _full(name: str, platform: str) -> Callable[..., Any]:
    _no_options(name, "full")
    return jax.checkpoint_policies.nothing_saveable


def _dots(name: str, platform: str) -> Callable[..., Any]:
    _no_options(name, "dots")
    return jax.checkpoint_policies.dots_saveable


def _dots_no_batch(name: str, platform: str) -> Callable[..., Any]:
    _no_options(name, "dots_no_batch")
    return jax.checkpoint_policies.dots_with_no_batch_dims_saveable


def _names(name: str, platform: str) -> Callable[..., Any]:
    return jax.checkpoint_policies.save_only_these_names(*_names_of(name, "names"))


def _offload(name: str, platform: str) -> Callable[..., Any]:
    names = _names_of(name, "offload")
    why = _host_memory(platform)
    if why:
        raise ShardkitError(
            f"remat policy {name!r}: the {platform!r} backend cannot offload activations to host memory: {why}. "
            f"Keep them on the device instead: 'names:{','.join(names)}' (saved) or 'full' (recomputed)"
        )
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=names, offload_src="device", offload_dst=OFFLOAD_DST
    )


for _name, _fn, _what in [
    ("none", _none, "save every activation (no rematerialization)"),
    ("full", _full, "save only each layer's input, recompute the layer in the backward pass"),
    ("dots", _dots, "save matmul and convolution outputs, recompute the rest"),
    ("dots_no_batch", _dots_no_batch, "save the outputs of matmuls without batch dimensions, recompute the rest"),
    ("names", _names, "save only the values tagged with the given names (checkpoint_name), recompute the rest"),
    ("offload", _offload, f"offload the values tagged with the given names to {OFFLOAD_DST} memory"),
]:
    kernels.register("remat", _name, _fn, description=_what, check=lambda name: remat_policy(name))


def remat_policy(name: str, platform: str | None = None) -> Callable[..., Any] | None:
    """The `jax.checkpoint` policy of remat kernel `name` on `platform` (default: the active mesh's), None for
    "none"; a ShardkitError listing the policies for a bad name, or naming the backend for an impossible offload."""
    if not isinstance(name, str) or name.partition(":")[0] not in kernels.available("remat"):
        raise ShardkitError(f"remat policy {name!r}: choose one of {', '.join(REMAT_CHOICES)} (docs/memory.md)")
    return kernels.lookup("remat", name).fn(name, platform or platform_family())


def combine_remat(slot: str | None, model_remat: str | None = "none") -> str:
    """The remat kernel that runs: the strategy's `remat` slot (None: not set), else the policy the model asks
    for (`apply_stack(..., remat=)`; "none" counts as not set), else "none"; a ShardkitError when both name a
    policy and the policies differ."""
    model = None if model_remat in (None, "none") else model_remat
    if slot is not None and model is not None and slot != model:
        raise ShardkitError(
            f"remat: the strategy's kernels={{'remat': {slot!r}}} and the model's own remat policy {model!r} "
            "disagree; choose one: set the model's remat to 'none' to let the strategy's kernel decide"
        )
    return slot or model or "none"


def resolve_remat(model_remat: str | None = "none") -> str:
    """`combine_remat` of the active strategy's `remat` slot (none outside a train step) and the model's `remat=`."""
    ctx = current_context()
    return combine_remat(ctx.kernels.get("remat") if ctx is not None else None, model_remat)


def checkpoint(fn: Callable[..., Any], remat: str | None = None) -> Callable[..., Any]:
    """`fn` (one layer's body) under `jax.checkpoint` with remat policy `remat` (default: the active strategy's
    remat kernel); `fn` itself for "none". For a model that scans its own stacked layers (models/resnet.py)."""
    name = resolve_remat() if remat is None else remat
    policy = remat_policy(name)
    return fn if policy is None else jax.checkpoint(fn, policy=policy)


def checkpoint_module(fn: Callable[..., Any], remat: str | None = None) -> Callable[..., Any]:
    """`fn(*modules_and_arrays)` (one block of Flax NNX modules, whose state such as BatchNorm's statistics it may
    update) under remat policy `remat` (default: the strategy's remat kernel) through `nnx.remat`; `fn` itself
    for "none". For a model whose blocks differ in shape and so form no stack (models/cosmoflow.py): pass the
    modules as arguments, not through the closure."""
    name = resolve_remat() if remat is None else remat
    policy = remat_policy(name)
    return fn if policy is None else nnx.remat(fn, policy=policy)


def tag(x: Any, name: str) -> Any:
    """`x` tagged `name` for the `names:` / `offload:` remat policies (jax's `checkpoint_name`; an identity)."""
    return checkpoint_name(x, name)


# ------------------------------------------------------------------------------------------------------------
# Convolution and pooling slots (3D CNNs). A model builds Flax's own conv layer with the slot's function,
#
#     nnx.Conv(c_in, c_out, (3, 3, 3), conv_general_dilated=sk.layers.conv_fn(VOLUME, name="block1.conv"), ...)
#     y = sk.layers.pool(x, (2, 2, 2), axes=VOLUME, name="block1.pool")
#
# with `VOLUME = ("batch", "depth", "height", "width", "channels")` the activation's logical names, and the
# strategy's `kernels` table picks the implementation: "xla" (default: one `lax` op, sharded by GSPMD from the
# rules, which inserts the halos itself) or "halo" (explicit ppermute halo exchange). Both kernels live and register
# themselves in shardkit/parallel/spatial/ and check the split against the same constraints first, so a bad split is
# an error naming the layer.
DEFAULTS.setdefault("conv", "xla")
DEFAULTS.setdefault("pool", "xla")


@dataclasses.dataclass(frozen=True)
class ConvFn:
    """A drop-in for `lax.conv_general_dilated` (Flax's `nnx.Conv(conv_general_dilated=...)`) that runs the conv
    slot's kernel; `axes` are the logical names of the input `[batch, *spatial, channels]`, `name` the layer's."""

    axes: tuple[str | None, ...]
    name: str = "conv"

    def __call__(self, lhs: jax.Array, rhs: jax.Array, window_strides: Any, padding: Any, lhs_dilation: Any = None,
                 rhs_dilation: Any = None, dimension_numbers: Any = None, feature_group_count: int = 1,
                 batch_group_count: int = 1, precision: Any = None,
                 preferred_element_type: Any = None, out_sharding: Any = None) -> jax.Array:  # fmt: skip
        if any(d != 1 for d in (lhs_dilation or ())) or batch_group_count != 1:
            raise ShardkitError(f"{self.name}: input dilation / batch groups are not supported by the conv slot")
        if len(self.axes) != lhs.ndim:
            raise ShardkitError(
                f"{self.name}: {len(self.axes)} logical names {self.axes} for an input of shape {lhs.shape}"
            )
        kernel, _, ctx = kernels.active("conv")
        more = {} if preferred_element_type is None else {"preferred_element_type": preferred_element_type}
        if out_sharding is not None:  # Flax's eager-sharding path; the kernels place their outputs themselves
            more["out_sharding"] = out_sharding
        return kernel.fn(lhs, rhs, strides=tuple(window_strides), padding=padding,
                         rhs_dilation=None if rhs_dilation is None else tuple(rhs_dilation),
                         feature_group_count=feature_group_count, precision=precision, axes=self.axes, name=self.name,
                         context=ctx, **more)  # fmt: skip


def conv_fn(axes: Sequence[str | None], name: str = "conv") -> ConvFn:
    """`nnx.Conv(..., conv_general_dilated=conv_fn(axes, name))`: the layer's conv runs the strategy's conv kernel."""
    return ConvFn(tuple(axes), name)


def pool(x: jax.Array, window: Sequence[int], strides: Sequence[int] | None = None, padding: Any = "VALID",
         reduce: str = "max", *, axes: Sequence[str | None], name: str = "pool") -> jax.Array:  # fmt: skip
    """[B, *S, C] -> [B, *S/stride, C] max / mean pooling by the strategy's pool kernel (strides default: window)."""
    if reduce not in ("max", "mean"):
        raise ShardkitError(f"{name}: reduce={reduce!r}; use 'max' or 'mean'")
    if len(axes) != x.ndim:
        raise ShardkitError(f"{name}: {len(axes)} logical names {tuple(axes)} for an input of shape {x.shape}")
    window = tuple(window)
    strides = window if strides is None else tuple(strides)
    kernel, _, ctx = kernels.active("pool")
    return kernel.fn(x, window=window, strides=strides, padding=padding, reduce=reduce, axes=tuple(axes), name=name,
                     context=ctx)  # fmt: skip


# ------------------------------------------------------------------------------------------------------------
# BatchNorm statistics slot. "global" (default): statistics over the whole global batch, the one-device
# computation, whatever the mesh (GSPMD reduces across data and spatial shards). "group": one set per data-parallel
# group, i.e. per shard of the batch over its mesh axes (what unsynchronised data-parallel BatchNorm computes),
# still over each sample's whole volume across spatial shards; "group:G" fixes G (e.g. to emulate it on one device).
DEFAULTS.setdefault("norm", "global")


def _global_groups(batch: int, context: Any, name: str = "global") -> int:
    return 1


def _data_groups(batch: int, context: Any, name: str = "group") -> int:
    if ":" in name:
        groups = int(name.split(":", 1)[1])
    elif context is None:
        groups = 1
    else:
        batch_axes = [a for a in (context.rules.get("batch") or ()) if a in context.mesh.shape]
        groups = math.prod(context.mesh.shape[a] for a in batch_axes)
    if groups < 1 or batch % groups:
        raise ShardkitError(f"BatchNorm statistics per group: batch {batch} does not split into {groups} groups")
    return groups


kernels.register("norm", "global", _global_groups, description="BatchNorm statistics over the global batch")
kernels.register("norm", "group", _data_groups, description="BatchNorm statistics per data-parallel group")
