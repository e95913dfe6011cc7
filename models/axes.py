"""Logical axis names the models use. A strategy (shardkit/strategies.py) maps each to mesh axes.

BATCH     examples in a batch
SEQ       sequence positions inside attention and the MLP (Megatron-SP keeps these whole)
RES_SEQ   sequence positions in the residual stream and norms (Megatron-SP shards these over tensor)
EMBED     model width d_model
HEADS     query heads; KV_HEADS key/value heads (grouped-query attention); HEAD_DIM their width
MLP       hidden width of the feed-forward block
VOCAB     token vocabulary
LAYERS    the stacked-blocks dimension (scanned over; the pipeline splits it into stages)
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
