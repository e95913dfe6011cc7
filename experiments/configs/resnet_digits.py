"""resnet_digits: 77K-param ResNet (BatchNorm, dropout) on scikit-learn's 8x8 digits, dp on 8 CPU devices, ~1 min."""

from __future__ import annotations

import ml_collections

from experiments.configs import base


def get_config() -> ml_collections.ConfigDict:
    """base's run machinery (hardware, optimizer, checkpoints, logging) with an image task, model and data.

    The GPT-only fields (seq_len, pipeline, the GPT's model and token data fields) are removed, so setting one is
    an error rather than silently ignored. Validation is the whole held-out split (320 images) in `eval_batches`
    equal batches, in eval mode (running BatchNorm statistics, no dropout).
    """
    c = base.get_config()
    c.task = "image_classification"
    c.config_name = "resnet_digits"
    c.mesh = "auto"  # dp: data=8; also --config.strategy=fsdp (data=2,fsdp=4) | tp_channels (data=2,tensor=4)
    c.strategy = "dp"
    for key in ("seq_len", "pipeline"):
        del c[key]

    # --- model: models.resnet.ResNetConfig fields (in_channels comes from the data)
    c.model = ml_collections.ConfigDict()
    m = c.model
    m.widths = (32, 64)  # channels per stage (divisible by 4: fsdp / tensor degrees); stage 2 halves 8x8 to 4x4
    m.blocks = (1, 1)  # basic residual blocks per stage
    m.num_classes = 0  # 0 = the data's (10)
    m.dropout = 0.1  # on the pooled features, before the classifier
    m.bn_momentum = 0.9
    m.dtype = "float32"

    # --- data (experiments/data/images.py): bundled with scikit-learn, nothing downloaded
    c.data = ml_collections.ConfigDict()
    c.data.name = "digits"  # sklearn.datasets.load_digits: 1797 images 8x8x1, 10 classes
    c.data.val_size = 320  # held out by a fixed permutation (split_seed), the rest (1477) is train
    c.data.split_seed = 0  # the split's own seed: `seed` changes init and batch order, not the validation images

    o = c.optimizer
    o.lr = 3e-3
    o.b2 = 0.99
    o.weight_decay = 0.05

    c.batch_size = 64  # images per step (about 23 steps per epoch of the 1477 train images)
    c.steps = 400
    c.eval_every = 50
    c.eval_batches = 1  # the 320 validation images in 1 batch (40 per device on data=8)
    c.ckpt_every = 200
    c.log_every = 50
    return c
