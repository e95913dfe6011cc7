"""The strategy x model matrix, language models: every registered strategy on the GPT, the MoE GPT and a Flax-guide
token MLP with its own loss (tests/test_any_model.py's GuideLM) trains 2 steps like one device, or is refused with
the ShardkitError that tests/matrix.py's `REFUSED` names (README.md's table is generated from it).

Tolerances: fp32 SGD (momentum 0.9), 2 steps. The sharded and the one-device programs differ only in the order
partial sums are reduced (per shard, then a collective), ~sqrt(n)·u ~ 1e-6 relative for the <= 256-term sums
here (n·u ~ 2e-5 in the worst case), not amplified by SGD (no division by gradient magnitudes). Asserted 1e-5 on
each loss and on every parameter relative to its array's scale (tests/test_parity.py's fp32 bound); observed
<= 4.6e-7 (GPT 4.6e-7, MoE 3.5e-7, guide 3.1e-7). A sharding bug (a missing or doubled reduction, a wrong
layout) is >= 1e-3: the MoE GPT with capacity drops under cp_zigzag was 4e-3 off (other tokens dropped; now
refused, shardkit/parallel/moe/routing.py). No cell needs float64.
"""

import matrix as mx
from matrix import references  # noqa: F401  (the fixture its cells share)

test_cell = mx.cell_test(mx.LM_FAMILIES)
