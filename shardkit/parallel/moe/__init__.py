"""Mixture of experts and expert parallelism (GShard, Lepikhin et al. 2006.16668; Switch, Fedus et al. 2101.03961;
MegaBlocks, Gale et al. 2211.15841).

    routing   top-k routing, capacity dispatch (all-to-all / einsum), the `moe` kernels and the ep* strategies
    ragged    dropless grouped matmuls over tokens sorted by expert (`moe=ragged`)

`sk.moe` is this package.
"""

from shardkit.parallel.moe import routing
from shardkit.parallel.moe.routing import *  # noqa: F403  (its public names are this package's)

__all__ = [*routing.__all__, "routing"]
