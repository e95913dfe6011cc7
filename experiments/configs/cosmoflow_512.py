"""cosmoflow_512: CosmoFlow at 512^3 x 4 channels (Oyama et al. 2007.12856 trained it on up to 2K V100s), for
accelerator clusters; on CPU use it with `experiments.explain` / `sk.plan`, not to train.

    python -m experiments.explain --config=experiments/configs/cosmoflow_512.py --config.mesh="data=2,space=2,space_h=2"

The network follows the published CosmoFlow (Mathuriya et al. SC'18; MLPerf HPC: conv3d k=3 + LeakyReLU + 2^3
max-pool blocks doubling 16 -> 256 channels, dense 128 and 64, 4 outputs), with two more 256-channel blocks so
that 512^3 still reaches 4^3 before the dense head (LBANN's practice at 512^3; the exact 512^3 network of the
paper is not reproduced here). The first 5 blocks split spatially, the last two run on the batch layout.
"""

from __future__ import annotations

import ml_collections

from experiments.configs import cosmoflow_tiny


def get_config() -> ml_collections.ConfigDict:
    c = cosmoflow_tiny.get_config()
    c.config_name = "cosmoflow_512"
    c.hardware = "lassen"
    c.mesh = "data=128,space=4,space_h=4"
    c.strategy = "spatial_dp_halo"
    c.data.size = 512
    m = c.model
    m.widths = (16, 32, 64, 128, 256, 256, 256)
    m.dense = (128, 64)
    m.dropout = 0.5
    m.batch_norm = False
    m.spatial_blocks = 5
    m.dtype = "bfloat16"
    c.batch_size = 128
    return c
