"""Spatial parallelism for 3D CNNs (Oyama et al. 2007.12856): each sample split over depth / height / width.

    exchange  halo-exchange convolution and pooling (`sk.spatial.conv`, `sk.spatial.pool`) and their plans
    kernels   the conv / pool slots' kernels and the spatial* strategies that pick them

`sk.spatial` is this package.
"""

from shardkit.parallel.spatial import exchange, kernels
from shardkit.parallel.spatial.exchange import (
    SPATIAL_NAMES,
    Exchange,
    Plan,
    conv,
    halo,
    halo_bytes,
    plan_layer,
    pool,
    recording,
    resolve_padding,
)

__all__ = [
    "SPATIAL_NAMES",
    "Exchange",
    "Plan",
    "conv",
    "exchange",
    "halo",
    "halo_bytes",
    "kernels",
    "plan_layer",
    "pool",
    "recording",
    "resolve_padding",
]
