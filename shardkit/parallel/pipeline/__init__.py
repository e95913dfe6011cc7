"""Pipeline parallelism over the `stage` mesh axis (GPipe, Huang et al. 1811.06965; 1F1B and circular, Narayanan et
al. 2006.09503, 2104.04473; uneven stages, Whale 2011.09208).

    schedules  the schedules as data and the `layers="pipeline:..."` kernel names
    stack      the layer-stack kernel that runs them inside a `shard_map`, and the pp* strategies

`sk.pipeline` is this package.
"""

from shardkit.parallel.pipeline import stack
from shardkit.parallel.pipeline.stack import *  # noqa: F403  (its public names are this package's)

__all__ = [*stack.__all__, "stack"]
