"""The explicit parallelisms, one module each (each cites its paper); the GSPMD ones are rules tables.

    pipeline    GPipe / 1F1B / circular schedules over the `stage` axis (Huang et al.; Narayanan et al.), even or
                uneven stages (Whale), and the pp* strategies; the schedule tables and kernel names:
                pipeline_schedule
    tensor3d    AxoNN's 3D tensor-parallel linear (Singh et al., 2305.13525) and the tp3d strategy
    spatial     halo-exchange conv / pool for samples split over depth, height, width (Oyama et al., 2007.12856);
                the conv / pool slot kernels and the spatial* strategies: spatial_kernels
    sdp         subnetwork data parallelism: each device trains a subnetwork (Singh et al., 2507.09029); its train
                step: sdp_step
    moe         mixture-of-experts routing and dispatch (Shazeer et al.; Lepikhin et al.; Fedus et al.)
    hetero      uneven per-device work for devices of different speeds (Whale, Jia et al.); its step: hetero_step

Context parallelism (ring, Ulysses, USP) lives in `shardkit.attention` (its public name). The core (shardkit/*.py)
never imports this package: each module registers its strategies, kernels and steps itself when imported
(shardkit/__init__.py imports them all). `sk.pipeline`, `sk.tensor3d`, `sk.spatial`, `sk.sdp`, `sk.moe` and
`sk.hetero` are the public names.
"""

from shardkit.parallel import hetero, hetero_step, moe, pipeline, sdp, sdp_step, spatial, spatial_kernels, tensor3d

__all__ = ["hetero", "hetero_step", "moe", "pipeline", "sdp", "sdp_step", "spatial", "spatial_kernels", "tensor3d"]
