"""The explicit parallelisms, one module each (each cites its paper); the GSPMD ones are rules tables.

    pipeline   GPipe / 1F1B / circular schedules over the `stage` axis (Huang et al.; Narayanan et al.)
    tensor3d   AxoNN's 3D tensor-parallel linear (Singh et al., 2305.13525)
    spatial    halo-exchange conv / pool for samples split over depth, height, width (Oyama et al., 2007.12856)
    sdp        subnetwork data parallelism: each device trains a subnetwork (Singh et al., 2507.09029); imported
               by shardkit/__init__.py, after the train step it builds on

Context parallelism (ring, Ulysses, USP) lives in `shardkit.attention` (its public name); the next ones
(mixture-of-experts dispatch, uneven per-device work) join this folder. `sk.pipeline`, `sk.tensor3d`,
`sk.spatial` and `sk.sdp` are the public names.
"""

from shardkit.parallel import pipeline, spatial, tensor3d

__all__ = ["pipeline", "sdp", "spatial", "tensor3d"]
