"""What an SDP step stores and sends per device, by formula: the CLI's header, `sk.explain`'s prediction.

Subnetwork data parallelism (Singh et al., arXiv 2507.09029; the step: sdp_step.py). Holder averaging of a cyclic
table is a ring of 2(h - 1) (+ r - 1) collective-permutes of a slot set, other tables a masked all-reduce; the
shared gradients, float statistics and metrics one all-reduce. With fsdp / tensor inside each worker
(sdp_compose.py) every array is averaged on its own, each device its shard: bytes divided by the array's degree.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardkit.init import split_params
from shardkit.parallel.sdp.compose import state_bytes
from shardkit.parallel.sdp.subnetworks import ring_of
from shardkit.step import TrainState


def _per_device(x: Any, sharding: Any) -> float:
    """The fraction of array `x` one device holds under `sharding`."""
    return math.prod(sharding.shard_shape(x.shape)) / max(1, math.prod(x.shape))


class SDPCosts:
    """The cost methods of `SDPTrainStep` (a mixin: the step's tables, splits and shardings)."""

    def describe(self, say: Any = print) -> None:
        """Prints the ownership and what a device stores and sends per step (the CLI's header)."""
        c = self.bytes_per_step()
        split, shared = c["split_elements"], c["shared_elements"]
        for g, table in self.tables.items():
            held = ", ".join(f"w{w}:{list(map(int, s))}" for w, s in enumerate(self.slots[g][:4]))
            more = ", ..." if self.workers > 4 else ""
            what = "blocks" if self.cfg.granularity == "block" else "unit groups"
            say(f"  sdp: {g} {what}, {table.sum(axis=0)[0]} holders each; worker: {what} held {held}{more}; holder "
                f"averaging by {self.reduction[g]}")  # fmt: skip
        frac = (shared + split * self.cfg.coverage) / (shared + split) if self.cfg.masking == "forward" else 1.0
        inner = "".join(f" x {a}={n}" for a, n in self.inner.items())
        say(f"  sdp: {split / 1e6:.2f}M split + {shared / 1e6:.2f}M shared parameters; a worker{inner} stores "
            f"{frac:.0%} of them; a device sends {(c['permute_bytes'] + c['ring_all_reduce_bytes']) / 2**20:.2f} "
            f"MiB per step in holder / data averaging")  # fmt: skip
        if self.cfg.masking == "forward":
            say("  sdp: MFU below counts the full network's FLOPs; each device computes only its subnetwork")

    def predict_costs(self, state: TrainState, backend: str) -> tuple[dict, dict[str, float], str]:
        """`sk.explain`'s prediction: {(kind, axis): (count, bytes sent per device)}, memory per device, source.

        Collectives over the workers' axis by `bytes_per_step`'s closed form (fsdp / tensor's own collectives are
        GSPMD's, not predicted here); parameter and gradient memory by `state_bytes` (forward masking) or everything
        (backward); optimizer state from its layout."""
        nbytes = int(np.dtype(jax.tree.leaves(state.params)[0].dtype).itemsize)
        c = self.bytes_per_step(nbytes)
        axis = self.cfg.axis
        comms = {("all-reduce", axis): (c["all_reduces"], c["ring_all_reduce_bytes"])}
        if c["permutes"]:
            comms["collective-permute", axis] = (c["permutes"], float(c["permute_bytes"]))
        forward = self.cfg.masking == "forward"
        params = state_bytes(self) if forward else nbytes * (c["shared_elements"] + c["split_elements"])
        opt = sum(math.prod(sh.shard_shape(x.shape)) * x.dtype.itemsize for x, sh in
                  zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(self.opt_shardings), strict=True))  # fmt: skip
        how = "/".join(sorted(set(self.reduction.values())))
        source = (f"shardkit.parallel.sdp ({self.cfg.granularity}, coverage {self.cfg.coverage:g}, "
                  f"{self.cfg.masking}, {how} holder averaging)")  # fmt: skip
        return comms, {"params": params, "grads": params, "optimizer": opt}, source

    def bytes_per_step(self, dtype_bytes: int = 4) -> dict[str, Any]:
        """Per-device collectives of one step by formula: {"permutes", "permute_bytes", "all_reduces",
        "all_reduce_elements", "ring_all_reduce_bytes", ...}. Counted: gradients, float model state (BatchNorm
        statistics: the split ones ride in the holder averaging, the others in the shared all-reduce) and the loss
        and metrics. `shared_elements` / `split_elements`: the full network's parameters (not per device)."""
        is_leaf = lambda v: v is None or hasattr(v, "groups")
        full = jax.eval_shape(lambda: nnx.to_pure_dict(split_params(self.source_model)[1]))
        rest = jax.eval_shape(self.unwrap_keys, self.initial_model_state)
        floats = [(x, sh) for x, sh in zip(jax.tree.leaves(rest), jax.tree.leaves(self.model_state_shardings),
                                           strict=True) if jnp.issubdtype(x.dtype, jnp.floating)]  # fmt: skip
        state_splits = [s for s, x in zip(jax.tree.leaves(self.state_splits, is_leaf=is_leaf), jax.tree.leaves(rest),
                                          strict=True) if jnp.issubdtype(x.dtype, jnp.floating)]  # fmt: skip
        inner = bool(self.inner)  # array by array, each device its shard; else one packed buffer per table
        shared = split = reduced = 0
        per_group: dict[int, float] = {}
        leaves: dict[int, int] = {}
        pairs = list(zip(jax.tree.leaves(self.splits, is_leaf=is_leaf), jax.tree.leaves(full),
                         jax.tree.leaves(self.param_shardings), strict=True))  # fmt: skip
        pairs += [(s, x, sh) for s, (x, sh) in zip(state_splits, floats, strict=True)]
        for i, (s, x, sh) in enumerate(pairs):
            param = i < len(jax.tree.leaves(full))
            share = _per_device(x, sh) if inner else 1.0
            if s is None:
                shared += x.size if param else 0
                reduced += x.size * share
            else:
                split += x.size if param else 0
                per_group[s.groups] = per_group.get(s.groups, 0) + x.size // s.groups * share
                leaves[s.groups] = leaves.get(s.groups, 0) + 1
        shared_leaves = sum(1 for s, _, _ in pairs if s is None) + self._metrics_count
        out = {"shared_elements": shared, "split_elements": split, "permutes": 0, "permute_bytes": 0,
               "all_reduces": shared_leaves if inner else 1, "all_reduce_elements": reduced + self._metrics_count,
               "ring_all_reduce_bytes": 0}  # fmt: skip
        for g, slot_elems in per_group.items():
            if self.reduction[g] == "ring":
                ring, times = ring_of(self.tables[g]), leaves[g] if inner else 1
                out["permutes"] += ring.permutes() * times
                out["permute_bytes"] += round(ring.permutes() * ring.stride * slot_elems * dtype_bytes)
            else:
                out["all_reduce_elements"] += g * slot_elems
                out["all_reduces"] += leaves[g] - 1 if inner else 0
        out["all_reduce_elements"] = round(out["all_reduce_elements"])
        n = out["all_reduce_elements"] * dtype_bytes
        out["ring_all_reduce_bytes"] = 2 * (self.workers - 1) / self.workers * n
        return out


__all__ = ["SDPCosts"]
