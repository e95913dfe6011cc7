"""unet3d_tiny: a 3-level 3D U-Net segmenting spheres and boxes in noisy 24^3 volumes, spatial + data parallel on
8 CPU devices (data=2 x space=2 x space_h=2).

    python -m experiments.train --config=experiments/configs/unet3d_tiny.py [--config.strategy=spatial_dp_halo]
"""

from __future__ import annotations

import ml_collections

from experiments.configs.cosmoflow_tiny import volume_config


def get_config() -> ml_collections.ConfigDict:
    c = volume_config("volume_segmentation", "unet3d_tiny")
    c.data.size = 24  # 24^3 voxels: 12^3 per device on the default mesh
    c.model = ml_collections.ConfigDict()
    m = c.model  # models.unet3d.UNet3DConfig fields (in_channels, num_classes come from the data)
    m.widths = (8, 16, 32)  # channels per level; 24^3 -> 12^3 -> 6^3 at the bottleneck
    m.bn_momentum = 0.9
    m.dtype = "float32"

    o = c.optimizer
    o.lr = 3e-3
    o.weight_decay = 0.0
    c.batch_size = 8
    c.steps = 200
    c.eval_every = 50
    c.eval_batches = 2
    c.ckpt_every = 100
    c.log_every = 25
    return c
