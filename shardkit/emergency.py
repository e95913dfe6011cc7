"""Emergency checkpoints: each process saves the shards it holds to its own disk, cheaply and often.

A global checkpoint (shardkit/checkpoint.py) is collective and goes to shared storage, so runs write one every few
hundred steps. When a host dies, everything since then is lost, though every other process still holds its shards.
An emergency checkpoint is the other tier, as MaxText's multi-tier checkpointing and orbax's emergency checkpointer
do it: each process writes the arrays its own devices hold, every few steps, to a local directory, with no
communication. A restart on the same mesh restores from it when it is newer than the last global checkpoint.

    local = LocalCheckpointer("/local/run/emergency", keep=2)
    local.save(state, meta)                             # this process's shards of every array, step = state.step
    found = local.newest_common(target, newer_than=40)  # the newest step that *every* process can restore, or None
    state, meta = local.restore(target, found)

Layout: `<dir>/p<process>/<step>/` holds `shards.bin` (each distinct shard of each array, raw bytes) and
`manifest.json` (the arrays' paths, shapes and dtypes, each shard's index and byte range, the mesh, a CRC-32 of
`shards.bin`). It is written as `<step>.tmp` and renamed, so a kill mid-save leaves no half step. A step is usable
by a process when its manifest reads, its CRC matches, the arrays are the target's, the mesh is the target's and
every shard the target puts on this process's devices is there. `newest_common` gathers each process's usable
steps (a small all-gather of step numbers) and takes the newest step usable everywhere; a process whose shards are
missing or damaged makes it fall back to an older common step, or to the global checkpoint. Both calls are
collective: every process calls them.

Not covered: a restart on another mesh or another number of processes (the global checkpoint reshards; this one
holds each process's own shards only), and a host whose local disk died with it (its steps are missing: the
fallback above).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from shardkit.errors import ShardkitError

MANIFEST, DATA = "manifest.json", "shards.bin"


def _index(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
    """A shard's index as [[start, stop], ...], whole dimensions spelled out."""
    return [[s.start or 0, shape[d] if s.stop is None else s.stop] for d, s in enumerate(index)]


def _mesh_of(tree: Any) -> dict[str, int] | None:
    for leaf in jax.tree.leaves(tree):
        mesh = getattr(getattr(leaf, "sharding", None), "mesh", None)
        if mesh is not None:
            return {str(a): int(n) for a, n in mesh.shape.items()}
    return None


def _is_key(x: Any) -> bool:
    return jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def committed_steps(folder: str | os.PathLike[str]) -> list[int]:
    """The steps one process has committed under `folder` (`<dir>/p<K>`), oldest first; [] if it is missing."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(int(p.name) for p in folder.iterdir() if p.name.isdigit() and (p / MANIFEST).exists())


class LocalCheckpointer:
    """This process's shards of a state, saved to `directory/p<process>/<step>/` (module docstring)."""

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2):
        if keep < 1:
            raise ShardkitError(f"keep={keep}: an emergency checkpointer keeps at least 1 step")
        self.process, self.count = jax.process_index(), jax.process_count()
        self.directory = Path(directory) / f"p{self.process}"
        self.keep = keep

    def steps(self) -> list[int]:
        """The committed steps in this process's directory, oldest first (verified by `usable_steps`, not here)."""
        return committed_steps(self.directory)

    # ---------------------------------------------------------------------------------------------- saving
    def save(self, state: Any, meta: dict[str, Any] | None = None, step: int | None = None) -> Path:
        """Writes this process's distinct shards of every array of `state` (and `meta`, JSON, returned by
        `restore`); returns the step's directory."""
        step = int(jax.device_get(state.step)) if step is None else step
        leaves = []
        tmp = self.directory / f"{step}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        crc, offset = 0, 0
        with open(tmp / DATA, "wb") as f:
            for path, x in jax.tree_util.tree_leaves_with_path(state):
                impl = str(jax.random.key_impl(x)) if _is_key(x) else None
                data = jax.random.key_data(x) if impl else x  # a key array: its key data (one trailing dimension)
                chunks, seen = [], set()
                for shard in data.addressable_shards:
                    where = _index(shard.index, data.shape)
                    if str(where) in seen:  # a replica of a shard already written
                        continue
                    seen.add(str(where))
                    raw = np.ascontiguousarray(np.asarray(shard.data)).tobytes()
                    f.write(raw)
                    crc = zlib.crc32(raw, crc)
                    chunks.append({"index": where, "offset": offset, "nbytes": len(raw)})
                    offset += len(raw)
                leaves.append({"path": jax.tree_util.keystr(path), "shape": list(x.shape), "dtype": str(data.dtype),
                               "data_shape": list(data.shape), "key": impl, "chunks": chunks})  # fmt: skip
            f.flush()
            os.fsync(f.fileno())
        manifest = {"step": step, "process": self.process, "processes": self.count, "mesh": _mesh_of(state),
                    "crc32": crc, "bytes": offset, "leaves": leaves, "meta": meta or {}}  # fmt: skip
        (tmp / MANIFEST).write_text(json.dumps(manifest))
        final = self.directory / str(step)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in self.steps()[: -self.keep]:
            shutil.rmtree(self.directory / str(old), ignore_errors=True)
        return final

    # --------------------------------------------------------------------------------------------- restoring
    def why_unusable(self, target: Any, step: int) -> str | None:
        """None if this process can restore `step` into `target` (ShapeDtypeStructs with shardings), else why not."""
        where = self.directory / str(step)
        try:
            manifest = json.loads((where / MANIFEST).read_text())
            raw = (where / DATA).read_bytes()
        except (OSError, ValueError) as e:
            return f"unreadable ({e})"
        if len(raw) != manifest.get("bytes") or zlib.crc32(raw) != manifest.get("crc32"):
            return "damaged (its CRC-32 does not match)"
        if manifest.get("processes") != self.count or manifest.get("mesh") != _mesh_of(target):
            return f"saved by {manifest.get('processes')} processes on mesh {manifest.get('mesh')}, not this run's"
        saved = {leaf["path"]: leaf for leaf in manifest["leaves"]}
        for path, x in jax.tree_util.tree_leaves_with_path(target):
            leaf = saved.get(jax.tree_util.keystr(path))
            if leaf is None or leaf["shape"] != list(x.shape):
                return f"has no array {jax.tree_util.keystr(path)} of shape {list(x.shape)}"
            have, shape = {str(c["index"]) for c in leaf["chunks"]}, tuple(leaf["data_shape"])
            for index in x.sharding.addressable_devices_indices_map(shape).values():
                if str(_index(index, shape)) not in have:
                    return f"lacks the shard {_index(index, shape)} of {leaf['path']} that this process holds"
        return None

    def usable_steps(self, target: Any, newer_than: int = -1) -> list[int]:
        return [s for s in self.steps() if s > newer_than and self.why_unusable(target, s) is None]

    def newest_common(self, target: Any, newer_than: int = -1) -> int | None:
        """The newest step newer than `newer_than` that every process can restore, or None (collective)."""
        mine = self.usable_steps(target, newer_than)[-self.keep :]
        padded = np.full((self.keep,), -1, np.int64)
        padded[: len(mine)] = mine
        everyone = np.asarray(multihost_utils.process_allgather(padded)).reshape(self.count, self.keep)
        common = set(everyone[0].tolist())
        for row in everyone[1:]:
            common &= set(row.tolist())
        common.discard(-1)
        return max(common) if common else None

    def restore(self, target: Any, step: int) -> tuple[Any, dict[str, Any]]:
        """(`target`'s tree with this process's shards of `step` placed on its devices, the saved meta); every
        process calls it, with a step `newest_common` found."""
        where = self.directory / str(step)
        manifest = json.loads((where / MANIFEST).read_text())
        raw = (where / DATA).read_bytes()
        saved = {leaf["path"]: leaf for leaf in manifest["leaves"]}

        def one(path: Any, x: Any) -> jax.Array:
            leaf = saved[jax.tree_util.keystr(path)]
            chunks, shape = {str(c["index"]): c for c in leaf["chunks"]}, tuple(leaf["data_shape"])
            sharding = x.sharding
            if sharding.memory_kind not in (None, "device"):  # offloaded state: assembled on device, then moved
                sharding = sharding.with_memory_kind("device")
            arrays = []
            for device, index in sharding.addressable_devices_indices_map(shape).items():
                where_ = _index(index, shape)
                c = chunks[str(where_)]
                size = math.prod(b - a for a, b in where_)
                data = np.frombuffer(raw, jnp.dtype(leaf["dtype"]), count=size, offset=c["offset"])
                arrays.append(jax.device_put(data.reshape([b - a for a, b in where_]), device))
            out = jax.make_array_from_single_device_arrays(shape, sharding, arrays)
            out = jax.random.wrap_key_data(out, impl=leaf["key"]) if leaf["key"] else out
            return jax.device_put(out, x.sharding) if out.sharding != x.sharding else out

        return jax.tree_util.tree_map_with_path(one, target), manifest["meta"]


__all__ = ["LocalCheckpointer", "committed_steps"]
