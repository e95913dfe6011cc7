"""The context-parallel kernels' default chunk (shardkit/parallel/context/chunking.py): chosen per backend and block,
overridable by argument or kernel option, refused when malformed. Choices only: no timing is asserted (the
speed behind the choice is experiments/bench/bench_attention.py's). That the kernels equal dense attention on
the default chunk is test_context_parallel.py's (its `chunk=None` cases)."""

import jax
import pytest

import shardkit as sk
from shardkit.parallel.context import chunking


def test_the_platform_is_read_from_a_concrete_or_an_abstract_mesh():
    """Inside a pipeline stage the kernels see only the abstract mesh (whose `.devices` raises)."""
    from shardkit.rules import platform_family

    mesh = sk.make_mesh({"seq": 8})
    assert platform_family(mesh) == platform_family(mesh.abstract_mesh) == jax.default_backend() == "cpu"


@pytest.mark.parametrize(
    ("c", "layout", "n", "platform", "chunk"),
    [
        (1024, "contiguous", 8, "cpu", 128),  # S = 8k on 8 devices, CPU
        (1024, "contiguous", 8, "gpu", 512),  # the same on an accelerator
        (1024, "zigzag", 8, "tpu", 512),  # zigzag halves of 512: one chunk per half
        (512, "zigzag", 8, "tpu", 256),  # halves of 256: the chunk never straddles them
        (96, "contiguous", 4, "cpu", 96),  # a block shorter than the preferred chunk: one chunk
        (8, "contiguous", 8, "gpu", 8),
        (192, "striped", 8, "cpu", 96),  # the largest divisor <= 128
        (4 * 131, "contiguous", 8, "cpu", 131),  # <= 128 would be 4 (16x the iterations): 131, just above
        (4 * 131, "zigzag", 8, "cpu", 131),  # halves of 262 = 2 x 131
        (4 * 1031, "contiguous", 8, "cpu", 4),  # no divisor in [128, 512]: the small one stays (never > 4x)
        (4 * 131, "contiguous", 8, "gpu", 262),  # the largest divisor <= 512 is over a quarter of it: kept
    ],
)
def test_default_chunk_divides_the_block_and_stays_near_the_preferred_size(c, layout, n, platform, chunk):
    got = chunking.default_chunk(c, layout, n, platform)
    assert got == chunk
    unit = c // 2 if layout == "zigzag" else c
    assert unit % got == 0


def test_an_explicit_chunk_keeps_its_meaning_and_bad_ones_are_refused():
    # explicit: the largest divisor <= it, whatever the backend (as before this module)
    assert chunking.resolve_chunk(256, 1024, "contiguous", 8, "cpu", "ring_attention") == 256
    assert chunking.resolve_chunk(100, 4 * 131, "contiguous", 8, "cpu", "ring_attention") == 4
    assert chunking.resolve_chunk(None, 1024, "contiguous", 8, "cpu", "ring_attention") == 128
    for bad in (0, -4, 2.5, True):
        with pytest.raises(sk.ShardkitError, match=rf"ring_attention: chunk={bad!r} must be a positive int"):
            chunking.resolve_chunk(bad, 1024, "contiguous", 8, "cpu", "ring_attention")


def test_kernel_option_names_the_chunk_and_a_bad_one_is_refused_before_tracing():
    assert chunking.chunk_option("ring:zigzag", "ring:zigzag") is None
    assert chunking.chunk_option("ring:zigzag:256", "ring:zigzag") == 256
    assert chunking.chunk_option("ulysses:64", "ulysses") == 64
    for bad in ("ring:zigzag:0", "ring:zigzag:big", "ring:zigzag:256:1"):
        with pytest.raises(sk.ShardkitError, match=r"options are ring:zigzag or ring:zigzag:<chunk>, a positive int"):
            sk.kernels.check({"attention": bad})  # what a strategy's table goes through
    with pytest.raises(sk.ShardkitError, match=r"options are usp:striped or usp:striped:<chunk>"):
        sk.kernels.check({"attention": "usp:striped:x"})
    sk.kernels.check({"attention": "ring:striped:64"})
    sk.kernels.check({"attention": "ulysses:32"})


@pytest.mark.parametrize(
    ("name", "module", "chunk"),
    [("ring:zigzag:16", "ring", 16), ("ring:zigzag", "ring", None), ("ulysses:8", "ulysses", 8)],
)
def test_the_kernel_option_reaches_the_kernel(monkeypatch, name, module, chunk):
    """attend() under a strategy naming `ring:zigzag:16` calls the kernel with chunk=16 (None: the default)."""
    import importlib

    mod = importlib.import_module(f"shardkit.parallel.context.{module}")
    seen = {}

    def spy(q, k, v, **kw):
        seen.update(kw)
        return q

    monkeypatch.setattr(mod, f"{module}_attention", spy)
    mesh = sk.make_mesh("seq=4", jax.devices()[:4])
    q = jax.numpy.zeros((1, 64, 4, 8))
    with sk.use_rules(mesh, {"seq": ("seq",)}, attention=name):
        sk.attention.attend(q, q, q)
    assert seen["chunk"] == chunk
