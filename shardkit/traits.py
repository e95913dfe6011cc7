"""What a strategy is, read from its tables and kernels rather than its name: `Traits.of(strategy)`.

The cost models (models/gpt_cost/classify.py `formula`, models/cosmoflow_cost.py `formula`) and `sk.explain` decide
from these which prediction applies, so a strategy registered under a new name with a built-in's tables gets the
built-in's prediction, and one whose name looks like a built-in's but whose tables differ does not.

Read in one direction: this module imports shardkit/strategies.py, never the other way.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping

from shardkit.rules import MeshAxes
from shardkit.strategies import BoundStrategy, Strategy, strategy


def _axes_of(table: Mapping[str, MeshAxes]) -> dict[str, tuple[str, ...]]:
    return {n: tuple(a) for n, a in table.items() if a}


@dataclasses.dataclass(frozen=True)
class Traits:
    """A strategy as its tables say it is, whatever its name (`Traits.of(s)`): per logical name the mesh axes
    of the compute, parameter and optimizer-state rules (sharded names only), the step and the kernels. A model's
    cost model decides from these which of its formulas applies, so a strategy registered under a new name with
    the tables of a built-in gets the built-in's prediction."""

    step: str
    kernels: Mapping[str, str]
    compute: Mapping[str, tuple[str, ...]]
    params: Mapping[str, tuple[str, ...]]
    optimizer: Mapping[str, tuple[str, ...]]
    scoped: bool  # Whale-style per-module rules (Strategy.scopes) override the tables somewhere

    @classmethod
    def of(cls, s: Strategy | BoundStrategy | str) -> Traits:
        """The traits of `s`, a Strategy or a registered strategy's name (a ShardkitError naming the registered
        ones if it is unknown)."""
        s = strategy(s)
        params = _axes_of(s.param_rules)
        opt = params if s.opt_rules is None else _axes_of(s.opt_rules)
        return cls(s.step, dict(s.kernels), _axes_of(s.compute_rules), params, opt, bool(s.scopes))

    def axes(self, *names: str, table: str = "compute") -> tuple[str, ...]:
        """The mesh axes the logical `names` are split over in `table` (compute, params, optimizer), in order."""
        rules = getattr(self, table)
        return tuple(dict.fromkeys(a for n in names for a in rules.get(n, ())))

    @property
    def batch(self) -> tuple[str, ...]:
        """Mesh axes that carry the batch (data parallelism in all its forms)."""
        return self.axes("batch")

    @property
    def sequence(self) -> tuple[str, ...]:
        """Mesh axes the sequence is split over everywhere (context parallelism: the ring's axes)."""
        return self.axes("seq")

    @property
    def residual_sequence(self) -> tuple[str, ...]:
        """Mesh axes only the residual stream's sequence is split over (Megatron's sequence parallelism)."""
        return tuple(a for a in self.axes("res_seq") if a not in self.sequence)

    @property
    def gathered(self) -> tuple[str, ...]:
        """Mesh axes parameters rest on but the compute gathers them from (ZeRO-3 / FSDP; AxoNN's depth);
        the stacked `layers` dimension's (pipeline stages) excluded."""
        out = [a for n, axes in self.params.items() if n != "layers" for a in axes if a not in self.compute.get(n, ())]
        return tuple(dict.fromkeys(out))

    @property
    def optimizer_only(self) -> tuple[str, ...]:
        """Mesh axes the optimizer state is split over beyond the parameters (ZeRO-1)."""
        out = [a for n, axes in self.optimizer.items() for a in axes if a not in self.params.get(n, ())]
        return tuple(dict.fromkeys(out))

    @property
    def stage(self) -> tuple[str, ...]:
        """Mesh axes the stacked layers rest on (pipeline stages)."""
        return self.axes("layers", table="params")

    @property
    def reduce_scatters(self) -> bool:
        """Whether GSPMD is asked for reduce-scatters (sharded gradients or optimizer state, Megatron-SP's g),
        which XLA:CPU compiles as an all-reduce plus a dynamic-slice."""
        return bool(self.gathered or self.optimizer_only or self.residual_sequence)


def _deprecated_traits(self: Strategy) -> Traits:
    """Deprecated: `Traits.of(strategy)` (shardkit/traits.py). What the cost models and `explain` read about this
    strategy: its tables and kernels, normalised."""
    warnings.warn("Strategy.traits() is deprecated and goes in the next release: use sk.Traits.of(strategy)",
                  DeprecationWarning, stacklevel=2)  # fmt: skip
    return Traits.of(self)


# For one release `Strategy.traits()` still answers, attached from here so that strategies.py imports nothing
# of this module (the arrow runs one way: traits -> strategies). `import shardkit` imports this module.
Strategy.traits = _deprecated_traits  # type: ignore[attr-defined]

__all__ = ["Traits"]
