"""Heterogeneous devices (Whale: Jia et al., USENIX ATC'22, arXiv 2011.09208): uneven per-device work.

    uneven    the batch split by throughput within memory caps, uneven pipeline stages, `make_strategy`
    step      the balanced data-parallel train step (registered as "hetero")

`sk.hetero` is this package.
"""

from shardkit.parallel.hetero import step, uneven
from shardkit.parallel.hetero.uneven import *  # noqa: F403  (its public names are this package's)

__all__ = [*uneven.__all__, "step", "uneven"]
