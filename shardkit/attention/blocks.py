"""The attention block kernel: what computes softmax(q kᵀ) v for one query block against one key block.

One idea at a little over 400 lines: the choice of block kernel per platform family and the kernels it chooses
between, which the ring, Ulysses, USP and dense attention all call.

Every attention kernel of this package ends in the same work: a block of queries against a block of keys (the ring's
[local block, travelling block] pairs, Ulysses' local heads over the whole sequence, dense attention). The slot
`attention_block` (`--config.kernels=attention_block=<name>`) says which implementation does it:

    xla      the chunked online-softmax scan of ring.py (plain XLA; the CPU kernel, and the reference)
    splash   Pallas's TPU splash attention (Mosaic; `jax.experimental.pallas.ops.tpu.splash_attention`). Inside the
             ring it returns each block's log-sum-exp, blocks merge by it, and the backward runs splash's own
             backward kernel with the *merged* lse and output (ring_fused.py). On a mesh of CPU devices it runs in
             Pallas's interpret mode (parity tests; slow), on GPUs it is refused.
    flash    Pallas's TPU flash attention (Mosaic): dense and Ulysses' local attention only (it returns no lse a
             ring could merge by); plain causal masks and segment ids. CPU: the TPU interpreter, one device.
    pallas_gpu  Pallas's GPU attention (Triton; `jax.experimental.pallas.ops.gpu.attention`), which returns its lse:
             the ring's blocks on GPUs as splash's on TPUs (contiguous and zigzag; striped's strictly causal
             block and packed documents inside the ring are refused: its kernel takes neither), and local attention.
             CPU devices: Pallas's interpret mode.
    cudnn    cuDNN's fused attention through `jax.nn.dot_product_attention` (NVIDIA GPUs, bf16/fp16, no segment
             ids): dense and Ulysses' local attention only.
    auto     (the default) chosen from the mesh's devices (`rules.platform_family`): splash on TPU where the block
             lengths are multiples of 128; on GPU pallas_gpu for the ring (where it can run) and cudnn for local
             attention (bf16, no segment ids); else xla.

An explicit choice that cannot run (a ring block under `flash`, segment ids under `cudnn`, a block of 96 tokens under
`splash`) is refused with the reason; only `auto` falls back, and `explain` names what it chose.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from shardkit import kernels
from shardkit.attention.checks import CHECK_VMA, match_kv_heads, spec_entry
from shardkit.errors import ShardkitError
from shardkit.rules import platform_family
from shardkit.strategies import BoundStrategy, Strategy
from shardkit.strategies import strategy as get_strategy

BLOCK_KERNELS = ("auto", "xla", "splash", "flash", "pallas_gpu", "cudnn")
#: the kernels that return a block's log-sum-exp (a ring can merge their blocks)
MERGEABLE = ("xla", "splash", "pallas_gpu")
#: the Pallas kernels written for TPUs (Mosaic) and for GPUs (Triton)
TPU_KERNELS, GPU_KERNELS = ("splash", "flash"), ("pallas_gpu",)
#: Mosaic's lane width: splash's key block (and so every block length it takes) is a multiple of it
LANES = 128
#: the largest splash block (MaxText's `sa_block_q` = `sa_block_kv` = 512)
SPLASH_BLOCK = 512
CUDNN_DTYPES = ("bfloat16", "float16")


def _fits_splash(lengths: tuple[int, ...]) -> bool:
    return all(n % LANES == 0 for n in lengths)


def ring_blocks(c: int, layout: str, n: int) -> tuple[tuple[int, ...], bool]:
    """(the block lengths a ring of `n` ranks holding `c` tokens each gives its kernel, whether a pair needs a
    strictly causal mask): a zigzag pair may be half a block (ring_fused.plans); a striped block from a later rank
    keeps k < q."""
    lengths = (c, c // 2) if layout == "zigzag" and n > 1 else (c,)
    return lengths, layout == "striped" and n > 1


def dense_keeps_xla(rules: Any, mesh: Any) -> bool:
    """Whether `auto` leaves dense attention to GSPMD: the sequence is sharded (a fused kernel needs it whole), or a
    mesh axis (`mesh`: {axis: size}) shards neither batch nor heads, over which the fused kernel's `shard_map` would
    all-reduce dq, dk, dv in its backward (tp3d's `col`: +96 MiB a step, 14% of its collectives, measured)."""
    if any(mesh.get(a, 1) > 1 for a in rules.get("seq") or ()):
        return True
    used = {a for name in ("batch", "heads") for a in (rules.get(name) or ())}
    return any(n > 1 and a not in used for a, n in mesh.items())


@functools.cache
def cudnn_loadable() -> bool:
    """Whether cuDNN's library loads in this process: JAX reads its version while it traces a cuDNN attention call, so
    a host without it (a GPU target compiled with the small CUDA set, docs/targets.md) cannot trace one; `auto` then
    leaves local attention to XLA."""
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        return check_cudnn_version() > 0
    except Exception:  # no CUDA plugin, no libcudnn, or another jax's private layout
        return False


def resolve(
    name: str | None, platform: str, *, lengths: tuple[int, ...], ring: bool, dtype: Any, segment_ids: bool,
    what: str, devices: int = 1, strict: bool = False,
) -> str:  # fmt: skip
    """The block kernel that runs: `name` checked (ShardkitError naming why it cannot), or `auto`'s choice.

    `lengths`: the query/key block lengths the kernel sees; `ring`: blocks are merged by their lse (a ring of more
    than one rank); `dtype`: the inputs'; `segment_ids`: packed documents are given; `devices`: in the mesh;
    `strict`: a block needs a strictly causal mask (the striped ring)."""
    name = name or "auto"
    if name not in BLOCK_KERNELS:
        raise ShardkitError(f"{what}: attention_block={name!r} is not one of {', '.join(BLOCK_KERNELS)}")
    gpu = platform == "gpu"
    if inside_shard_map():
        if name in ("auto", "xla"):
            return "xla"
        raise ShardkitError(
            f"{what}: attention_block={name} inside a step that is already a shard_map (a pipeline's stages, sdp, "
            "hetero): a fused kernel there loses the stage's varying axes in its backward; use attention_block=xla"
        )
    if name == "auto":
        if platform == "tpu" and _fits_splash(lengths):
            return "splash"
        if gpu and ring and _fits_splash(lengths) and not segment_ids and not strict:
            return "pallas_gpu"
        if gpu and not ring and jnp.dtype(dtype).name in CUDNN_DTYPES and not segment_ids and cudnn_loadable():
            return "cudnn"
        return "xla"
    if ring and name not in MERGEABLE:
        raise ShardkitError(
            f"{what}: attention_block={name} returns no log-sum-exp, which the ring merges its blocks by; use "
            f"attention_block=splash (TPU) or xla for ring attention (cp_ring, cp_zigzag, cp_striped, cp_usp)"
        )
    if name in GPU_KERNELS:
        if platform == "tpu":
            raise ShardkitError(f"{what}: attention_block={name} is a Triton GPU kernel; on TPUs use splash or xla")
        if ring and (segment_ids or strict):
            cannot = ("packed documents: its kernel takes one segment-id array for queries and keys, and a ring "
                      "block's keys come from another rank") if segment_ids else (
                      "the striped layout's strictly causal block (k < q)")  # fmt: skip
            raise ShardkitError(
                f"{what}: attention_block={name} inside a ring cannot take {cannot}; use attention_block=xla there "
                "(or cp_zigzag, whose blocks it takes)"
            )
    if name in TPU_KERNELS and gpu:
        raise ShardkitError(
            f"{what}: attention_block={name} is a Mosaic TPU kernel and this program is compiled for {platform!r} "
            "devices; use attention_block=cudnn (dense, ulysses) or xla"
        )
    if name in TPU_KERNELS + GPU_KERNELS and not _fits_splash(lengths):
        raise ShardkitError(
            f"{what}: attention_block={name} takes blocks whose lengths are multiples of {LANES} (the kernels' tile); "
            f"these are {lengths} tokens: use a sequence whose per-rank blocks are multiples of {LANES} (zigzag: "
            "each half), or attention_block=xla"
        )
    if name == "flash" and interpreting(platform) and devices > 1:
        raise ShardkitError(
            f"{what}: attention_block=flash on {platform!r} devices runs in Pallas's TPU interpreter, which does not "
            f"return inside a shard_map over {devices} CPU devices (it simulates the chips' synchronisation); run it "
            "on one device, or use attention_block=splash (interpret mode) or xla"
        )
    if name == "cudnn":
        if not gpu:
            raise ShardkitError(f"{what}: attention_block=cudnn runs on NVIDIA GPUs; this program is for {platform!r}")
        if not cudnn_loadable():
            raise ShardkitError(
                f"{what}: attention_block=cudnn is traced through cuDNN's library (jax checks its version), which this "
                "host lacks: pip install nvidia-cudnn-cu12 (jax[cuda12] brings it), or use attention_block=xla"
            )
        if jnp.dtype(dtype).name not in CUDNN_DTYPES or segment_ids:
            raise ShardkitError(
                f"{what}: attention_block=cudnn takes bf16/fp16 inputs without segment ids (got {jnp.dtype(dtype).name}"
                f"{', segment ids' if segment_ids else ''}); use attention_block=xla"
            )
    return name


def inside_shard_map() -> bool:
    """Whether the code being traced is inside a `shard_map` (manual mesh axes): a pipeline's stage, sdp, hetero."""
    axis_types = getattr(jax.sharding.get_abstract_mesh(), "axis_types", ()) or ()
    return any(t == jax.sharding.AxisType.Manual for t in axis_types)


def planned(strategy: str | Strategy | BoundStrategy, mesh: Any, seq_len: int, platform: str) -> str:
    """The block kernel `strategy`'s attention runs on `platform` devices for sequences of `seq_len` tokens on a mesh
    of shape `mesh` ({axis: size}), resolved as the kernels resolve it when traced: what `explain` names and the
    cost models assume (packed documents and the inputs' dtype aside: they change only cudnn's choice on GPUs)."""
    st = get_strategy(strategy)  # a Strategy or BoundStrategy as it is (a name is looked up)
    name, attention = st.kernels.get("attention_block", "auto"), st.kernels.get("attention", "dense")
    if st.kernels.get("layers", "scan") != "scan" or st.step != "gspmd":
        return "xla" if name == "auto" else name  # the layers run inside a shard_map (`inside_shard_map`)
    ring, lengths, strict = False, (seq_len,), False
    kind, _, option = attention.partition(":")
    if kind in ("ring", "usp"):
        n = mesh.get("seq" if kind == "ring" else "seq_r", 1)
        ring, (lengths, strict) = n > 1, ring_blocks(seq_len // max(n, 1), option.partition(":")[0] or "contiguous", n)
    elif kind == "dense" and name == "auto":
        rules = {k: tuple(a for a in (v or ()) if a in mesh) for k, v in st.compute_rules.items()}
        if dense_keeps_xla(rules, mesh):
            return "xla"
    try:
        return resolve(name, platform, lengths=lengths, ring=ring, dtype=jnp.float32, segment_ids=False, what="",
                       strict=strict)  # fmt: skip
    except ShardkitError:
        return name  # an explicit kernel that cannot run here: the step itself refuses it, with the reason


def named() -> str:
    """The block kernel the active train step's strategy names (`auto` outside a step or when it names none)."""
    return kernels.active("attention_block")[1]


def interpreting(platform: str, kernel: str = "splash") -> bool:
    """Whether a Pallas kernel runs in Pallas's interpreter: it is compiled for devices it was not written for (a
    Mosaic kernel off TPU, a Triton kernel off GPU)."""
    return platform != "gpu" if kernel in GPU_KERNELS else platform != "tpu"


def block_size(length: int) -> int:
    """The Pallas kernels' tile along a block of `length` tokens: the largest multiple of 128 dividing it, <= 512."""
    return max(b for b in range(LANES, min(SPLASH_BLOCK, length) + 1, LANES) if length % b == 0)


# ---- splash: one [g query heads, Lq] x [Lk] block per (batch, kv head), MQA form (GQA: vmapped over kv heads) ----

MASKS = ("full", "causal", "strict")  # keys visible: all; k <= q; k < q (local indices of the block pair)


@functools.lru_cache(maxsize=64)
def splash_kernel(mask: str, heads: int, lq: int, lk: int, interpret: bool, residuals: bool) -> Any:
    """A splash MQA kernel for `heads` query heads over one kv head, [lq] x [lk] under `mask` (cached per shape)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sa
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm

    offset = 0 if mask == "causal" else -1  # strict: k < q
    one = sm.FullMask((lq, lk)) if mask == "full" else sm.CausalMask((lq, lk), offset=offset)
    bq, bk = block_size(lq), block_size(lk)
    sizes = sa.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                          block_kv_dkv_compute=bk, use_fused_bwd_kernel=True)  # fmt: skip
    with jax.ensure_compile_time_eval():  # its mask tables are constants, never tracers of the step being traced
        return sa.make_splash_mqa(sm.MultiHeadMask([one] * heads), block_sizes=sizes, save_residuals=residuals,
                                  head_shards=1, q_seq_shards=1, interpret=interpret)  # fmt: skip


def _segments(qseg: Any, kseg: Any) -> Any:
    if qseg is None:
        return None
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sa

    return sa.SegmentIds(q=qseg.astype(jnp.int32), kv=kseg.astype(jnp.int32))


def _per_kv_head(fn: Any, q: jax.Array, k: jax.Array, v: jax.Array, qseg: Any, kseg: Any, *rest: jax.Array) -> Any:
    """fn(q [g, lq, d], k, v [lk, d], segments, *rest per (b, kv)) over q [b, kv, g, lq, d], k, v [b, kv, lk, d]."""
    per_b = lambda q, k, v, qs, ks, *r: jax.vmap(lambda q, k, v, *r: fn(q, k, v, _segments(qs, ks), *r))(q, k, v, *r)
    seg_axis = None if qseg is None else 0
    return jax.vmap(per_b, in_axes=(0, 0, 0, seg_axis, seg_axis, *([0] * len(rest))))(q, k, v, qseg, kseg, *rest)


def splash_forward(mask: str, q: jax.Array, k: jax.Array, v: jax.Array, qseg: Any, kseg: Any, interpret: bool) -> tuple:
    """(o fp32 [b, kv, g, lq, d], lse fp32 [b, kv, g, lq]) of one block pair; q already scaled by 1/sqrt(d).

    A query row that sees no key of this block gets lse = the mask value (about -2.4e38): its weight in the merge
    is exp(that - merged lse) = 0."""
    kernel = splash_kernel(mask, q.shape[2], q.shape[3], k.shape[2], interpret, True)
    o, (lse,) = _per_kv_head(lambda q, k, v, s: kernel(q, k, v, segment_ids=s), q, k, v, qseg, kseg)
    return o.astype(jnp.float32), lse.astype(jnp.float32)


def splash_backward(mask: str, q, k, v, qseg, kseg, o, lse, do, interpret: bool) -> tuple:
    """(dq, dk, dv) of one block pair given the *merged* output and lse of the rows: splash's own backward kernel,
    which recomputes P = exp(S - lse) and dS = P (dP - rowsum(dO O)), so each block contributes its exact share."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sa

    kernel = splash_kernel(mask, q.shape[2], q.shape[3], k.shape[2], interpret, False)
    kw = kernel.kwargs

    def one(q, k, v, segments, o, lse, do):
        # the residuals splash's forward saves (q, k, v, segments, sinks, out, lse, dq / dkv mask info), with the
        # merged output and lse in place of this block's: jax 0.10-0.12 share this private signature (tested)
        res = (q, k, v, segments, None, o.astype(q.dtype), lse, kernel.dq_mask_info, kernel.dkv_mask_info)
        static = [kw[n] for n in ("save_residuals", "mask_value", "is_mqa", "block_sizes", "residual_checkpoint_name",
                                  "mask_function", "attn_logits_soft_cap", "interpret")]  # fmt: skip
        grads = sa._splash_attention_bwd(*static, res, do.astype(q.dtype))
        return grads[3:6]

    return _per_kv_head(one, q, k, v, qseg, kseg, o, lse, do)


# ---- pallas_gpu: the same block pair by Pallas's GPU (Triton) kernel, [b, l, heads, d] with kv heads repeated ----


def _gpu_sizes(lq: int, lk: int) -> Any:
    """Forward tiles of 128; the fused backward needs as many query tiles (dq) as key tiles (dk, dv): n = min / 32."""
    from jax.experimental.pallas.ops.gpu import attention as ga

    n = max(1, min(lq, lk) // 32)
    return ga.BlockSizes(block_q=min(128, lq), block_k=min(128, lk), block_q_dkv=min(32, lq), block_kv_dkv=lk // n,
                         block_q_dq=lq // n, block_kv_dq=min(32, lk))  # fmt: skip


def _to_gpu(q: jax.Array, k: jax.Array) -> tuple[jax.Array, Any]:
    """q [b, kv, g, l, d] -> [b, l, kv g, d]; k [b, kv, l, d] -> [b, l, kv g, d] (each kv head repeated g times)."""
    b, kv, g, lq, d = q.shape
    rep = lambda x: jnp.moveaxis(jnp.repeat(x, g, axis=1), 1, 2)
    return jnp.moveaxis(q.reshape(b, kv * g, lq, d), 1, 2), rep


def gpu_forward(mask: str, q: jax.Array, k: jax.Array, v: jax.Array, interpret: bool) -> tuple:
    """`splash_forward`'s contract by Pallas's GPU kernel (no segment ids, no strict mask: `resolve` refused them)."""
    from jax.experimental.pallas.ops.gpu import attention as ga

    b, kv, g, lq, d = q.shape
    qg, rep = _to_gpu(q, k)
    o, lse2 = ga.mha(qg, rep(k), rep(v), None, sm_scale=1.0, causal=mask == "causal", interpret=interpret,
                     block_sizes=_gpu_sizes(lq, k.shape[2]), return_residuals=True)  # fmt: skip
    o = jnp.moveaxis(o, 1, 2).reshape(b, kv, g, lq, d)
    return o.astype(jnp.float32), (lse2 * np.log(2.0)).reshape(b, kv, g, lq).astype(jnp.float32)  # base 2 -> e


def gpu_backward(mask: str, q, k, v, o, lse, do, interpret: bool) -> tuple:
    """`splash_backward`'s contract by Pallas's GPU backward kernel, given the merged output and lse."""
    from jax.experimental.pallas.ops.gpu import attention as ga

    b, kv, g, lq, d = q.shape
    qg, rep = _to_gpu(q, k)
    og, dog = (_to_gpu(x.astype(q.dtype), k)[0] for x in (o, do))
    lse2 = (lse / np.log(2.0)).reshape(b, kv * g, lq)
    res = (qg, rep(k), rep(v), None, og, lse2)
    dq, dk, dv, _ = ga._mha_backward(1.0, mask == "causal", _gpu_sizes(lq, k.shape[2]), "triton", None, 2, None,
                                     interpret, False, False, res, dog)  # fmt: skip
    back = lambda x: jnp.moveaxis(x, 1, 2).reshape(b, kv, g, *x.shape[1:2], d)  # [b, l, kv g, d] -> [b, kv, g, l, d]
    return back(dq), back(dk).sum(2), back(dv).sum(2)


def block_forward(kernel: str, mask: str, q, k, v, qseg, kseg, interpret: bool) -> tuple:
    """(o fp32 [b, kv, g, lq, d], lse fp32 [b, kv, g, lq]) of one block pair by `kernel` (q already scaled)."""
    if kernel in GPU_KERNELS:
        return gpu_forward(mask, q, k, v, interpret)
    return splash_forward(mask, q, k, v, qseg, kseg, interpret)


def block_backward(kernel: str, mask: str, q, k, v, qseg, kseg, o, lse, do, interpret: bool) -> tuple:
    """(dq, dk, dv) of one block pair by `kernel`, given the merged output and lse."""
    if kernel in GPU_KERNELS:
        return gpu_backward(mask, q, k, v, o, lse, do, interpret)
    return splash_backward(mask, q, k, v, qseg, kseg, o, lse, do, interpret)


# ---- local attention (no merge): dense attention and Ulysses' heads, each kernel with its own backward ----


@contextlib.contextmanager
def _tpu_interpreter(interpret: bool):
    """flash's kernel takes no `interpret=`: on non-TPU devices it runs under Pallas's TPU interpreter."""
    if not interpret:
        yield
        return
    from jax.experimental.pallas import tpu as pltpu

    with pltpu.force_tpu_interpret_mode():
        yield


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _interpreted(kernel: Any, interpret: bool, q: jax.Array, k: jax.Array, v: jax.Array, segments: Any) -> jax.Array:
    """kernel(q, k, v, segment_ids=segments), its forward and backward kernels both traced under the TPU interpreter
    when `interpret` (the interpreter is chosen when a kernel is traced, and a backward is traced after the forward's
    context has closed)."""
    with _tpu_interpreter(interpret):
        return kernel(q, k, v, segment_ids=segments)


def _interpreted_fwd(kernel: Any, interpret: bool, q, k, v, segments) -> tuple:
    with _tpu_interpreter(interpret):
        o, vjp = jax.vjp(lambda q, k, v: kernel(q, k, v, segment_ids=segments), q, k, v)
    return o, (vjp, segments)


def _interpreted_bwd(kernel: Any, interpret: bool, res: tuple, do: jax.Array) -> tuple:
    vjp, segments = res
    with _tpu_interpreter(interpret):
        return (*vjp(do), None if segments is None else jax.tree.map(lambda _: None, segments))


_interpreted.defvjp(_interpreted_fwd, _interpreted_bwd)


def local_attention(name: str, q: jax.Array, k: jax.Array, v: jax.Array, seg: Any, causal: bool,
                    platform: str) -> jax.Array:  # fmt: skip
    """[b, s, heads, d] x 2 x [b, s, kv_heads, d] -> [b, s, heads, d], one device's whole sequence, by `name`
    (splash, flash or cudnn; differentiated by the kernel's own backward). q is not scaled."""
    b, s, h, d = q.shape
    kv = k.shape[2]
    interpret = interpreting(platform, name)
    if name == "cudnn":
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn").astype(q.dtype)
    qs = q * jnp.asarray(1.0 / np.sqrt(d), q.dtype)
    if name == "splash":
        kernel = splash_kernel("causal" if causal else "full", h // kv, s, s, interpret, False)
        qh = jnp.moveaxis(qs.reshape(b, s, kv, h // kv, d), 1, 3)  # [b, kv, g, s, d]
        kh, vh = (jnp.moveaxis(x, 1, 2) for x in (k, v))  # [b, kv, s, d]
        o = _per_kv_head(lambda q, k, v, sg: kernel(q, k, v, segment_ids=sg), qh, kh, vh, seg, seg)
        return jnp.moveaxis(o, 3, 1).reshape(b, s, h, d).astype(q.dtype)
    if name == "pallas_gpu":
        from jax.experimental.pallas.ops.gpu import attention as ga

        kg, vg = (jnp.repeat(x, h // kv, axis=2) for x in (k, v))
        return ga.mha(qs, kg, vg, seg, sm_scale=1.0, causal=causal, interpret=interpret,
                      block_sizes=_gpu_sizes(s, s)).astype(q.dtype)  # fmt: skip
    if name == "flash":
        from jax.experimental.pallas.ops.tpu import flash_attention as fa

        g = h // kv
        kh, vh = (jnp.moveaxis(jnp.repeat(x, g, axis=2), 1, 2) for x in (k, v))  # MHA only: kv heads repeated
        t = block_size(s)
        sizes = fa.BlockSizes(block_q=t, block_k_major=t, block_k=t, block_b=1, block_q_major_dkv=t,
                              block_k_major_dkv=t, block_k_dkv=t, block_q_dkv=t, block_k_major_dq=t, block_k_dq=t,
                              block_q_dq=t)  # fmt: skip
        flash = functools.partial(fa.flash_attention, causal=causal, block_sizes=sizes)
        segments = None if seg is None else fa.SegmentIds(q=seg.astype(jnp.int32), kv=seg.astype(jnp.int32))
        o = _interpreted(flash, interpret, jnp.moveaxis(qs, 1, 2), kh, vh, segments)
        return jnp.moveaxis(o, 2, 1).astype(q.dtype)
    raise ShardkitError(f"local_attention: {name!r} is not a fused block kernel")


def sharded_local(name: str, q: jax.Array, k: jax.Array, v: jax.Array, seg: Any, causal: bool, context: Any) -> Any:
    """`local_attention` inside a `shard_map` over the strategy's batch and head axes (the sequence whole)."""
    k, v = match_kv_heads(k, v, q.shape[2], context)
    batch, heads = spec_entry(context.rules.get("batch")), spec_entry(context.rules.get("heads"))
    spec, seg_spec = PartitionSpec(batch, None, heads), PartitionSpec(batch, None)
    body = functools.partial(local_attention, name, causal=causal, platform=platform_family(context.mesh))
    fn = lambda q, k, v, s: body(q, k, v, s)
    return jax.shard_map(fn, mesh=context.mesh, in_specs=(spec, spec, spec, None if seg is None else seg_spec),
                         out_specs=spec, check_vma=CHECK_VMA)(q, k, v, seg)  # fmt: skip


for _name, _what in (
    ("auto", "chosen from the mesh's devices: splash on TPU, cudnn on GPU (local attention), else xla"),
    ("xla", "the chunked online-softmax scan (ring.py), plain XLA"),
    ("splash", "Pallas TPU splash attention (Mosaic), merged by its lse inside the ring"),
    ("flash", "Pallas TPU flash attention (Mosaic): dense / Ulysses local attention only"),
    ("pallas_gpu", "Pallas GPU attention (Triton), merged by its lse inside the ring (contiguous, zigzag)"),
    ("cudnn", "cuDNN fused attention (NVIDIA GPUs, bf16): dense / Ulysses local attention only"),
):
    kernels.register("attention_block", _name, functools.partial(local_attention, _name), description=_what)
kernels.DEFAULTS["attention_block"] = "auto"
