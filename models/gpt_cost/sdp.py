"""The GPT under subnetwork data parallelism (Singh et al. 2507.09029; shardkit/parallel/sdp/): the collectives
and memory of one step with block-level ownership, forward masking and cyclic holders over `data` (the options
`sdp_options` accepts, models/gpt_cost/classify.py), fsdp or tensor inside each worker, and what such a plan's
shapes refuse. tests/test_sdp_compose.py checks the permute bytes and the parameter memory against the compiled
step.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import shardkit as sk
from models.gpt_cost.classify import sdp_options
from models.gpt_cost.memory import activation_bytes, state_bytes
from models.gpt_cost.remat import alias_policy, saved_bytes
from models.gpt_cost.shapes import divisibility, fc_layers, logit_tokens, num_params, shape
from shardkit.costmodel import Comm, CommBuilder
from shardkit.errors import ShardkitError


def sdp_divisibility(strategy: Any, cfg: Any, mesh: dict[str, int], global_batch: int) -> str:
    """What the SDP step would refuse ("" if nothing): fsdp and tensor both inside a worker, no ownership table
    for the data workers, or the worker's shapes not dividing fsdp x tensor."""
    if mesh.get("fsdp", 1) > 1 and mesh.get("tensor", 1) > 1:
        return "sdp spans fsdp or tensor inside a worker, not both (shardkit/parallel/sdp/compose.py)"
    try:
        sk.sdp.ownership(cfg.num_layers, mesh.get("data", 1), sdp_options(strategy).coverage)
    except ShardkitError as err:
        return str(err)
    return divisibility("fsdp_tp", cfg, mesh, global_batch)


def sdp_terms(
    cfg: Any, mesh: dict[str, int], global_batch: int, seq_len: int, coverage: float, nbytes: int = 2,
    backend: str = "gpu", remat: str | None = None,
) -> tuple[list[Comm], dict[str, float]]:  # fmt: skip
    """(collectives, memory per device) of one GPT step under block-level, forward-masked SDP (Singh et al.,
    2507.09029; shardkit/parallel/sdp/) with cyclic ownership over `data`, fsdp / tensor inside each worker.

    A worker holds k = coverage x L blocks: its devices store shared + coverage x blocks parameters, each array
    over its fsdp x tensor degree (sdp_compose.py's formula; the RMSNorm scales over fsdp only), run k blocks'
    activations, and fsdp's gathers and Megatron's 4k + 2 all-reduces over them. Holder averaging: the ring's
    2(h - 1) (+ r - 1) collective-permutes of a slot set (each device its shard of a block per stride), array by
    array when fsdp / tensor split them; coverage 1 (every block everywhere) is one all-reduce. The shared
    parameters' gradients: one all-reduce over data. tests/test_sdp_compose.py checks the permute bytes and the
    parameter memory against the compiled step."""
    c = shape(cfg)
    e, L = c["d_model"], c["num_layers"]
    d, f, t = (mesh.get(a, 1) for a in ("data", "fsdp", "tensor"))
    mats = sum(h1 * h2 for _, h1, h2, _ in fc_layers(cfg))
    block = mats + 2 * e  # one block's parameters (+ its 2 norms)
    shared, k = num_params(cfg) - L * block, round(coverage * L)
    # per device: matrices (and the vocab tables) over fsdp x tensor, RMSNorm scales over fsdp only
    block_dev, shared_dev = (mats / t + 2 * e) / f, ((shared - e) / t + e) / f
    sub = shared_dev + k * block_dev  # sdp_compose.state_bytes's formula, for the GPT
    b = CommBuilder(mesh, ("tensor", "fsdp", "data"), backend)
    tokens = global_batch / (d * f) * seq_len
    if f > 1:  # ZeRO-3 of the worker's subnetwork
        b.add("all-gather", "fsdp", sub * f * nbytes, 1, "subnetwork parameters fwd")
        b.add("all-gather", "fsdp", k * block_dev * f * nbytes, 1, "its blocks again bwd")
        b.add("reduce-scatter", "fsdp", sub * f * nbytes, 1, "gradients", gspmd=True)
    if t > 1:
        n = 4 * k + 2
        b.add("all-reduce", "tensor", tokens * e * nbytes * n, n, "Megatron f / g of the worker's blocks")
    ring = sk.sdp.ring_of(sk.sdp.ownership(L, d, coverage))
    if ring is not None and k < L:
        arrays = len(fc_layers(cfg)) + 2 if f * t > 1 else 1  # array by array, or one packed buffer
        n = ring.permutes() * ring.stride * block_dev * nbytes
        b.add("collective-permute", "data", n, ring.permutes() * arrays, "holder averaging (ring)")
    else:
        b.add("all-reduce", "data", L * block_dev * nbytes, 1, "holder averaging (masked all-reduce)")
    b.add("all-reduce", "data", shared_dev * nbytes, 1, "shared gradients over data")
    remat = remat or alias_policy(cfg)
    worker = dataclasses.replace(cfg, num_layers=k)  # its k blocks (cfg: a GPTConfig)
    block_acts = activation_bytes(cfg, tokens, seq_len, 1, t, nbytes)
    acts = saved_bytes(worker, remat, tokens, seq_len, 1, t, nbytes, block_acts)
    acts += logit_tokens(cfg, tokens, seq_len) * c["vocab_size"] / t * 4 * 2  # fp32 logits and their softmax
    return b.comms(), state_bytes(sub, nbytes, acts)


__all__ = ["sdp_divisibility", "sdp_terms"]
