"""Subnetwork data parallelism (Singh, Khalid, Cagnasso, Oyallon, Belilovsky, arXiv 2507.09029): each device trains
a subnetwork; the holders of a block average it.

    subnetworks   the algorithm: ownership of blocks, masks, the averages over holders, `make_strategy`
    compose       SDP composed with FSDP / Megatron tensor parallelism inside each worker
    costs         what an SDP step stores and sends per device (the CLI's header, explain's prediction)
    step          its train step (registered as "sdp")

`sk.sdp` is this package: `sk.sdp.make_strategy(...)`, `sk.sdp.ownership(...)`, `sk.sdp.SDPConfig`.
"""

from shardkit.parallel.sdp import step, subnetworks
from shardkit.parallel.sdp.subnetworks import *  # noqa: F403  (its public names are this package's)

__all__ = [*subnetworks.__all__, "step", "subnetworks"]
