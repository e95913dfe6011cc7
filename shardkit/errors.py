"""The one exception shardkit raises for bad configuration.

Every message names the offending value and says how to fix it, and is raised before XLA sees the program.
"""

from __future__ import annotations


class ShardkitError(ValueError):
    """A configuration error with an actionable message (what is wrong, the values involved, the fix)."""
