"""Spatial parallelism for 3D CNNs (Oyama et al. 2007.12856): each sample split over depth / height / width.

    exchange  halo-exchange convolution and pooling (`sk.spatial.conv`, `sk.spatial.pool`) and their plans
    kernels   the conv / pool slots' kernels and the spatial* strategies that pick them

`sk.spatial` is this package.
"""

from shardkit.parallel.spatial import exchange, kernels
from shardkit.parallel.spatial.exchange import *  # noqa: F403  (its public names are this package's)

__all__ = [*exchange.__all__, "exchange", "kernels"]
