"""The parallelisms XLA's GSPMD partitioner carries out from the strategy's tables alone.

strategies   the built-in tables: dp, zero1, fsdp, tp, tp_sp, fsdp_tp, dp_fsdp_tp, dp_split_head, tp_channels,
             annotated
step         the GSPMD train step every strategy runs unless it names a step of its own (registered as "gspmd")
"""

from shardkit.parallel.gspmd import step, strategies
from shardkit.parallel.gspmd.step import GSPMDStep

__all__ = ["GSPMDStep", "step", "strategies"]
