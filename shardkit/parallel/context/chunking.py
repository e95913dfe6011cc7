"""The query/key chunk of the ring kernel's inner loop (ring.py): chosen per backend and block when not given.

Inside a device, ring attention (and Ulysses / USP, which run the same loop with a ring of one) scans the local
block of c tokens in chunks of `chunk` queries x `chunk` keys; memory is O(c · chunk) and the time depends on
how well one [chunk, chunk] score tile and its products suit the hardware:

- CPU: 128. Ring fwd + bwd at S = 8k on 8 CPU devices ran 1.3x faster at 128 than at 256 and than at 512
  (experiments/bench/bench_attention.py, `--peer-chunks`): the [heads · chunk, chunk] fp32 score tile and its
  exponentials stay in the core's caches between the two products that use them.
- GPU / TPU: 512. Each chunk pair is one XLA dot of [heads · chunk, d] x [d, chunk]: larger chunks give
  larger matmuls (fuller tensor cores / MXU) and fewer loop iterations, and the pure-JAX peer
  (`ringattention`, its README example) and MaxText's TPU splash attention (`sa_block_q` = `sa_block_kv` =
  512) use 512 too. Not measured here (no accelerator on this host).

The chunk must divide the block (for zigzag, each half of it, so a chunk never straddles the halves). The
default takes the largest divisor <= the preferred size, unless that is under a quarter of it (a block like
4 · 131 would give chunks of 4: 16x the loop iterations); then the smallest divisor in [preferred, 4 · preferred]
if there is one. A chunk given explicitly is honoured as before: the largest divisor <= it.

Overriding: `chunk=` on `ring_attention` / `ulysses_attention` / `usp_attention`, or a kernel option in the
strategy's table: `attention="ring:zigzag:256"`, `"ulysses:256"`, `"usp:zigzag:256"`.
"""

from __future__ import annotations

from shardkit.errors import ShardkitError

#: the chunk preferred per platform of the mesh's devices (`jax.Device.platform`, as `rules.platform_family` reads
#: it: a TPU target compiled from a CPU host gets TPU's) when the caller names none
PREFERRED_CHUNK: dict[str, int] = {"cpu": 128, "gpu": 512, "tpu": 512}
#: any other platform (an accelerator plugin)
ACCELERATOR_CHUNK = 512


def preferred_chunk(platform: str) -> int:
    """The chunk `default_chunk` aims for on `platform` ("cpu", "gpu", "tpu", ...)."""
    return PREFERRED_CHUNK.get(platform, ACCELERATOR_CHUNK)


def _unit(c: int, layout: str, n: int) -> int:
    """What a chunk must divide: the block, or half of it for zigzag on a ring of more than one."""
    return c // 2 if layout == "zigzag" and n > 1 else c


def chunk_size(c: int, want: int, layout: str, n: int) -> int:
    """The largest divisor of the block (of its half for zigzag, so chunks never straddle halves) <= want."""
    unit = _unit(c, layout, n)
    return max(s for s in range(1, min(want, unit) + 1) if unit % s == 0)


def default_chunk(c: int, layout: str, n: int, platform: str) -> int:
    """The chunk for a block of c tokens on `platform` when the caller names none (module docstring)."""
    want, unit = preferred_chunk(platform), _unit(c, layout, n)
    below = chunk_size(c, want, layout, n)
    if 4 * below >= want or unit <= want:
        return below
    above = [s for s in range(want, min(4 * want, unit) + 1) if unit % s == 0]
    return above[0] if above else below


def resolve_chunk(chunk: int | None, c: int, layout: str, n: int, platform: str, what: str) -> int:
    """The chunk a kernel runs: `default_chunk` for None, else the largest divisor of the block <= `chunk`."""
    if chunk is None:
        return default_chunk(c, layout, n, platform)
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ShardkitError(f"{what}: chunk={chunk!r} must be a positive int (or None: chosen per backend)")
    return chunk_size(c, chunk, layout, n)


def chunk_option(name: str, base: str) -> int | None:
    """The chunk a kernel name carries after its `base` (`ring:zigzag:256` -> 256; `ring:zigzag` -> None)."""
    rest = name[len(base) :]
    if not rest:
        return None
    value = rest[1:]
    if rest[0] != ":" or not value.isdigit() or int(value) < 1:
        raise ShardkitError(
            f"attention kernel {name!r}: options are {base} or {base}:<chunk>, a positive int (e.g. {base}:256), "
            "the query/key chunk of the inner loop; without it the chunk is chosen per backend"
        )
    return int(value)
