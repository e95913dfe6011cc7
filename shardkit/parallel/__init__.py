"""The explicit parallelisms, one module each (each cites its paper); the GSPMD ones are rules tables.

    pipeline   GPipe / 1F1B / circular schedules over the `stage` axis (Huang et al.; Narayanan et al.)
    tensor3d   AxoNN's 3D tensor-parallel linear (Singh et al., 2305.13525)

Context parallelism (ring, Ulysses, USP) lives in `shardkit.attention` (its public name); the next ones
(spatial halo convolutions, subnetwork data parallelism, mixture-of-experts dispatch, uneven per-device
work) join this folder. `sk.pipeline` and `sk.tensor3d` stay the public names.
"""

from shardkit.parallel import pipeline, tensor3d

__all__ = ["pipeline", "tensor3d"]
