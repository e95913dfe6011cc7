"""Every parallelism, one folder (or file) each, each citing its paper; a reader finds a paper's system in one place.

    gspmd/      data parallelism, ZeRO, FSDP, Megatron tensor (+ sequence) parallelism: rules tables that XLA's
                GSPMD partitioner carries out, and the GSPMD train step every strategy runs by default
    context/    context parallelism: ring attention (contiguous, zigzag, striped; Liu et al. 2310.01889; Brandon
                et al. 2311.09431), Ulysses (Jacobs et al. 2309.14509), USP (Fang & Zhao 2405.07719), their
                layouts and chunking, and the cp_* strategies
    pipeline/   GPipe / 1F1B / circular schedules over the `stage` axis (Huang et al.; Narayanan et al.), even or
                uneven stages (Whale), and the pp* strategies
    tensor3d    AxoNN's 3D tensor-parallel linear (Singh et al., 2305.13525) and the tp3d strategy
    spatial/    halo-exchange conv / pool for samples split over depth, height, width (Oyama et al., 2007.12856)
                and the spatial* strategies
    sdp/        subnetwork data parallelism: each device trains a subnetwork (Singh et al., 2507.09029), its step
    moe/        mixture-of-experts routing, capacity and dropless dispatch, the ep* strategies
    hetero/     uneven per-device work for devices of different speeds (Whale, Jia et al.), its step

The core (shardkit/*.py) never imports this package: each parallelism registers its strategies, kernels and steps
itself when imported (shardkit/__init__.py imports this package). `sk.pipeline`, `sk.tensor3d`, `sk.spatial`,
`sk.sdp`, `sk.moe` and `sk.hetero` are the public names; context parallelism's functions are `sk.attention`'s.
"""

import shardkit.parallel.gspmd  # noqa: F401  (first: the others build on its tables, and they list first)
from shardkit.parallel import context, hetero, moe, pipeline, sdp, spatial, tensor3d

__all__ = ["context", "gspmd", "hetero", "moe", "pipeline", "sdp", "spatial", "tensor3d"]
