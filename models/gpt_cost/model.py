"""The GPT's cost model: `GPTCostModel`, the `sk.costmodel.CostModel` registered for GPTConfig.

Which formulas describe a strategy, read from its tables (classify.py), and their terms:

- a MoE GPT (`num_experts` > 0) under an ep-family strategy (GSPMD step, the `moe` kernel einsum or all_to_all,
  experts split): moe.py;
- subnetwork data parallelism (block-level, forward masking, cyclic ownership): sdp.py;
- a strategy whose tables are one of the dense families (`formula`; on TPU also context and pipeline parallelism,
  `tpu_formula`; on GPU those too with the Pallas GPU ring block / XLA attention and no remat, gpu.py):
  comms.py and memory.py, the attention block kernel and the embedding kernel as the strategy's kernels resolve
  them on this backend (shardkit/attention/blocks.py, shardkit/embedding.py);
- anything else: None (`sk.explain` then predicts the parameter traffic the rules tables imply).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import shardkit as sk
from models.gpt import GPTConfig
from models.gpt_cost import moe
from models.gpt_cost.classify import formula, sdp_options, tpu_formula
from models.gpt_cost.comms import cached_comms
from models.gpt_cost.memory import memory as dense_memory
from models.gpt_cost.remat import recompute_flops as remat_flops
from models.gpt_cost.sdp import sdp_divisibility, sdp_terms
from models.gpt_cost.shapes import divisibility
from models.gpt_cost.tpu import low_precision
from models.gpt_remat import REMAT_ALIASES
from shardkit.costmodel import DEFAULT_STRATEGIES, CostModel, Terms
from shardkit.traits import Traits

#: how far below the TPU compiler's peak the GPT's TPU memory prediction may be (docs/targets.md §6)
TPU_MEMORY_ERROR = 0.10
#: the MoE GPT's (moe.py has none of §6's terms): gpt_moe_8x350m, ep data=4,expert=2, dots_no_batch on a v5p-16,
#: compiled at a 62.4 GiB peak against 30.8 predicted (2.02x)
TPU_MOE_MEMORY_ERROR = 1.1


@sk.costmodel.register(GPTConfig)
class GPTCostModel(CostModel):
    """The GPT's collectives, memory, recompute and divisibility per strategy (module docstring)."""

    cfg: GPTConfig
    models_remat = True  # memory per remat policy and the recompute FLOPs: remat.py

    @property
    def plan_strategies(self) -> tuple[str, ...]:
        """What `sk.plan` tries by default: the strategies these formulas cover (the ep family for a MoE GPT)."""
        return ("ep", "ep_tp", "ep_fsdp") if self.cfg.num_experts else DEFAULT_STRATEGIES

    def predict(
        self, strategy: Any, mesh: dict[str, int], batch_shapes: dict[str, tuple[int, ...]], nbytes: int, backend: str
    ) -> Terms | None:
        """(collectives, memory, source) of one train step from the GPT formulas, activations included; None for
        a strategy they do not cover. With a 16-bit compute dtype on a TPU or GPU the formulas take 2 bytes a value,
        whatever `nbytes` says: `sk.explain` passes the parameters' width (fp32: 4), `sk.plan` 2; the program's
        activations and collectives are at the compute dtype (the 7B's, docs/targets.md §6)."""
        cfg, name = self.cfg, getattr(strategy, "name", strategy)
        nbytes = 2 if backend != "cpu" and low_precision(cfg) else nbytes
        if cfg.num_experts:  # MoE under ep*: moe.py (memory: the remat rules at the experts' width)
            t = Traits.of(strategy)
            if t.step != "gspmd" or t.kernels.get("moe") not in ("all_to_all", "einsum") or not t.axes("experts"):
                return None
            batch, seq = next(iter(batch_shapes.values()))[:2]
            remat = self.remat_policy(strategy)
            comms = moe.comms(cfg, strategy, mesh, batch, seq, nbytes, remat=remat, backend=backend)
            block = sk.attention.blocks.planned(strategy, mesh, seq, backend)
            memory = moe.memory(cfg, strategy, mesh, batch, seq, nbytes, remat=remat, backend=backend,
                                fused_attention=block in ("splash", "flash"), attention=block)  # fmt: skip
            return comms, memory, f"models/gpt_cost/moe.py ({name}, backend {backend}, attention {block})"
        sdp = sdp_options(strategy)
        if sdp is not None:  # subnetwork data parallelism: block-level, forward masking, cyclic (sdp.py)
            batch, seq = next(iter(batch_shapes.values()))[:2]
            comms, memory = sdp_terms(cfg, mesh, batch, seq, sdp.coverage, nbytes, backend,
                                      remat=self.remat_policy(strategy))  # fmt: skip
            return comms, memory, f"models/gpt_cost/sdp.py sdp_terms (coverage {sdp.coverage:g}, backend {backend})"
        family = formula(strategy)  # from the strategy's tables, not its name
        batch, seq = next(iter(batch_shapes.values()))[:2]  # every GPT batch entry is [batch, seq]
        block = sk.attention.blocks.planned(strategy, mesh, seq, backend)  # splash on TPU: no [s, s] scores kept
        if family is None and backend in ("tpu", "gpu"):  # context / pipeline parallelism: tpu.py, gpu.py
            family = tpu_formula(strategy, mesh)
            gpu_terms = {"cp": "pallas_gpu", "pp": "xla"}.get((family or "").partition(":")[0])
            if backend == "gpu" and (block != gpu_terms or self.remat_policy(strategy) != "none"):
                family = None  # on GPU: read from the programs with these blocks and no remat only (gpu.py)
        if family is None:
            return None
        fused = block in ("splash", "flash")
        embed = sk.embedding.planned(strategy, mesh, batch, backend)  # gather, or on TPU / GPU local / vocab
        comms = list(cached_comms(family, cfg, tuple(mesh.items()), batch, seq, nbytes, backend, fused,
                                  embed == "local", self.remat_policy(strategy), embed == "vocab"))  # fmt: skip
        memory = dense_memory(family, cfg, mesh, batch, seq, nbytes, remat=self.remat_policy(strategy),
                              backend=backend, fused_attention=fused, attention=block)  # fmt: skip
        return comms, memory, (f"shardkit.costmodel ({family} formula of the GPT, backend {backend}, attention "
                               f"{block}, embedding {embed})")  # fmt: skip

    def remat_policy(self, strategy: Any) -> str:
        """The remat policy the formulas assume under `strategy`: its `remat` kernel where it sets one (what
        `sk.plan` varies), else the config's alias. (A real run refuses a slot and an alias that disagree.)"""
        slot = sk.strategy(strategy).kernels.get("remat")
        return slot if slot is not None else REMAT_ALIASES[self.cfg.remat]

    def recompute_flops(self, strategy: Any, mesh: dict[str, int], batch_shapes: dict[str, tuple[int, ...]]) -> float:
        """FLOPs per device per step the backward re-runs under the strategy's remat policy (remat.py states the
        convention)."""
        batch, seq = next(iter(batch_shapes.values()))[:2]
        devices, cfg, split = math.prod(mesh.values()), self.cfg, 1
        sdp = sdp_options(strategy)
        if sdp is not None:  # an SDP worker runs only its k = coverage x L blocks (on its batch shard)
            cfg = dataclasses.replace(self.cfg, num_layers=round(sdp.coverage * self.cfg.num_layers))
        if self.cfg.num_experts:  # the tokens over the batch's axes; each expert's mlp split further (ep_tp)
            lay = moe.Layout.of(strategy)
            devices, split = lay.size(mesh, lay.batch), lay.size(mesh, lay.mlp)
        return remat_flops(cfg, self.remat_policy(strategy), batch * seq, seq, devices, split)

    def memory_error(self, backend: str) -> float:
        """The memory prediction's known error where it has been measured against a compiler at scale: TPU, the
        7B / 70B plans of docs/targets.md §6 (and §5's strategies at the bench shape), within `TPU_MEMORY_ERROR`
        of the compiled peak, a MoE GPT's within `TPU_MOE_MEMORY_ERROR`; elsewhere 0 (not measured at scale:
        `sk.plan` marks nothing tight)."""
        if backend != "tpu":
            return 0.0
        return TPU_MOE_MEMORY_ERROR if self.cfg.num_experts else TPU_MEMORY_ERROR

    def indivisible(self, strategy: Any, mesh: dict[str, int], global_batch: int) -> str:
        """Why this GPT's shapes do not divide `mesh` under `strategy` ("" if they do)."""
        if self.cfg.num_experts:
            return moe.divisibility(self.cfg, strategy, mesh, global_batch)
        if sdp_options(strategy) is not None:
            return sdp_divisibility(strategy, self.cfg, mesh, global_batch)
        return divisibility(formula(strategy) or "", self.cfg, mesh, global_batch)


__all__ = ["TPU_MEMORY_ERROR", "TPU_MOE_MEMORY_ERROR", "GPTCostModel"]
