"""Logical axis names the models use. A strategy (shardkit/strategies.py) maps each to mesh axes.

BATCH     examples in a batch
SEQ       sequence positions inside attention and the MLP (Megatron-SP keeps these whole)
RES_SEQ   sequence positions in the residual stream and norms (Megatron-SP shards these over tensor)
EMBED     model width d_model
HEADS     query heads; KV_HEADS key/value heads (grouped-query attention); HEAD_DIM their width
MLP       hidden width of the feed-forward block
VOCAB     token vocabulary
LAYERS    the stacked-blocks dimension (scanned over; the pipeline splits it into stages)
EXPERTS   a mixture of experts' experts (their router outputs and stacked MLP weights)

Images and volumes (models/resnet.py, models/cosmoflow.py, models/unet3d.py):
HEIGHT, WIDTH  an image's / a volume's spatial dimensions; DEPTH a volume's third (slowest) one
CHANNELS  feature channels (a conv kernel's output channels); CLASSES a classifier's outputs
"""

BATCH = "batch"
SEQ = "seq"
RES_SEQ = "res_seq"
EMBED = "embed"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
MLP = "mlp"
VOCAB = "vocab"
LAYERS = "layers"
EXPERTS = "experts"

DEPTH = "depth"
HEIGHT = "height"
WIDTH = "width"
CHANNELS = "channels"
CLASSES = "classes"
#: An activation of a 3D CNN: [batch, depth, height, width, channels].
VOLUME = (BATCH, DEPTH, HEIGHT, WIDTH, CHANNELS)
