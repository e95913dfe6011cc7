"""The strategy x model matrix, vision: every registered strategy on the ResNet (BatchNorm, dropout), CosmoFlow
(3D, BatchNorm) and the 3D U-Net trains 2 steps like one device, or is refused with the ShardkitError that
tests/matrix.py's `REFUSED` names; and README.md's table is the one tests/matrix.py renders.

Tolerances: fp32 SGD (momentum 0.9), 2 steps; asserted 1e-5 relative on each loss and on every parameter and
BatchNorm statistic relative to its array's scale, the bound of tests/test_resnet_digits.py and
tests/test_spatial.py's CosmoFlow (reduction order only: per-shard partial sums, then the all-reduce of weight
gradients and BatchNorm statistics); observed <= 1.8e-6 (ResNet 1.5e-6, CosmoFlow 1.8e-6, U-Net 1.0e-6).
tests/test_spatial.py runs its U-Net in float64 because one BatchNorm shift drifts 1.3e-3 in fp32 after 3 steps
on a 2-dimension halo split; here (2 steps, 8^3 volumes) fp32 holds, so no cell needs float64.
"""

import matrix as mx
from matrix import references  # noqa: F401  (the fixture its cells share)

import shardkit as sk

test_cell = mx.cell_test(mx.VISION_FAMILIES)


def test_the_matrix_covers_every_registered_strategy():
    assert set(mx.MESH) == set(sk.STRATEGIES), "a new strategy needs a mesh in tests/matrix.py's MESH"


def test_readme_shows_the_matrix():
    block = mx.readme_block(mx.README.read_text())
    assert block, f"README.md has no {mx.START} ... {mx.END} block"
    assert block == mx.table(), "README.md's matrix is stale: run `python tests/matrix.py`"
