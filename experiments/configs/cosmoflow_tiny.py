"""cosmoflow_tiny: CosmoFlow (5 conv3d blocks) regressing 4 generating parameters of 32^3 lognormal density fields,
spatial + data parallel on 8 CPU devices (data=2 x depth over space=2 x height over space_h=2), ~2 min.

    python -m experiments.train --config=experiments/configs/cosmoflow_tiny.py                   # GSPMD halos
    python -m experiments.train --config=experiments/configs/cosmoflow_tiny.py --config.strategy=spatial_dp_halo

The published network (Mathuriya et al. SC'18; Oyama et al. 2007.12856 at 512^3): `cosmoflow_512.py`.
"""

from __future__ import annotations

import ml_collections

from experiments.configs import base


def volume_config(task: str, name: str) -> ml_collections.ConfigDict:
    """base's run machinery with a volume task; the GPT-only fields are removed (setting one is an error)."""
    c = base.get_config()
    c.task, c.config_name = task, name
    c.mesh = "data=2,space=2,space_h=2"  # batch over data, depth over space, height over space_h
    c.strategy = "spatial_dp"  # or spatial_dp_halo (explicit halo exchange), dp, fsdp
    for key in ("seq_len", "pipeline"):
        del c[key]
    c.data = ml_collections.ConfigDict()
    c.data.path = ""  # "" = generated (experiments/data/volumes.py); or a folder of .npy volumes + targets.npy
    c.data.size = 32  # generated volumes: size^3 voxels
    c.data.train_size = 2048  # distinct generated training samples (validation comes from another stream)
    c.data.seed = 0  # the generated data's own seed (`seed` changes init and batch order)
    return c


def get_config() -> ml_collections.ConfigDict:
    c = volume_config("volume_regression", "cosmoflow_tiny")
    c.model = ml_collections.ConfigDict()
    m = c.model  # models.cosmoflow.CosmoFlowConfig fields (size, in_channels, num_outputs come from the data)
    m.widths = (8, 16, 16, 32, 32)  # conv3d k=3 blocks, each followed by LeakyReLU and a 2^3 max pool
    m.dense = (64, 32)
    m.dropout = 0.0
    m.leaky_slope = 0.3
    m.batch_norm = True
    m.spatial_blocks = 3  # blocks 0-2 split spatially (32, 16, 8 voxels); 3-4 (4, 2) on the batch layout
    m.dtype = "float32"

    o = c.optimizer
    o.lr = 2e-3
    o.weight_decay = 0.0
    c.batch_size = 16
    c.steps = 300
    c.eval_every = 50
    c.eval_batches = 4  # 64 validation volumes
    c.ckpt_every = 100
    c.log_every = 25
    return c
