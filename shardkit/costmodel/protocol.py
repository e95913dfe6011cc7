"""How a model brings its cost model: a `CostModel` beside the model, registered by the model config's type.

    @sk.costmodel.register(MyConfig)
    class MyCost(sk.costmodel.CostModel):
        def predict(self, strategy, mesh, batch_shapes, nbytes, backend):
            t = sk.Traits.of(strategy)                      # what the strategy is, from its tables, not its name
            if t.axes("heads") not in ((), ("tensor",)):
                return None                                  # not what these formulas describe
            b = sk.costmodel.CommBuilder(mesh, ("tensor", "data"), backend)
            b.add("all-reduce", "data", grad_bytes, 1, "gradients")
            return b.comms(), memory, "my formulas (models/my_cost.py)"

    sk.plan(MyConfig(...), devices=8, hardware="perlmutter", global_batch=64, seq_len=1024)
    sk.costmodel.for_config(cfg)    # the CostModel registered for type(cfg) (or a base), on cfg; None without one

`sk.plan` and `sk.explain` find a config's cost model through `for_config`, so the config holds the model's
hyperparameters only and nothing the cost model needs imports back into the model: the GPT's is models/gpt_cost/,
CosmoFlow's models/cosmoflow_cost.py, the 3D U-Net's models/unet3d_cost.py, each registered when the models
package is imported (models/__init__.py), as shardkit's parallelisms register their strategies.

Until this release a config carried the hooks itself (`cfg.cost_model(...)`, `cfg.indivisible`, `cfg.recompute_flops`,
`cfg.plan_strategies`, `cfg.remat_policy`). Such a config still works for one release: `for_config` wraps it, with
a DeprecationWarning.
"""

from __future__ import annotations

import abc
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from shardkit.costmodel.comms import Comm
from shardkit.errors import ShardkitError
from shardkit.strategies import strategy as resolve

#: (collectives, memory per device, source) of one train step, what `CostModel.predict` returns
Terms = tuple[Sequence[Comm], Mapping[str, float], str]
#: The strategies `sk.plan` tries for a cost model that names none (the dense GPT's formulas cover them).
DEFAULT_STRATEGIES = ("dp", "fsdp", "tp", "tp_sp", "tp3d")


class CostModel(abc.ABC):
    """The model-specific terms `sk.plan` and `sk.explain` ask for, for one model config (`self.cfg`).

    Every method takes the strategy as a Strategy or a registered name; a cost model decides what applies from its
    tables (`sk.Traits.of(strategy)`), never its name. `mesh` is {axis: size}; `batch_shapes` {name: shape} of the
    global batch: `sk.plan` gives `{"inputs": (global_batch, seq_len)}` for a transformer, else
    `{"batch": (global_batch,)}`; `sk.explain` the batch's leaves by path (e.g. "['volume']")."""

    #: The strategies `sk.plan` tries when not told: those the formulas cover.
    plan_strategies: tuple[str, ...] = DEFAULT_STRATEGIES
    #: True: `predict`'s memory follows the strategy's `remat` kernel slot and `recompute_flops` prices what the
    #: backward re-runs, so `sk.plan` tries its remat policies per plan; False: the model is planned under "none".
    models_remat: bool = False

    def __init__(self, cfg: Any):
        self.cfg = cfg

    @abc.abstractmethod
    def predict(
        self, strategy: Any, mesh: dict[str, int], batch_shapes: dict[str, tuple[int, ...]], nbytes: int, backend: str
    ) -> Terms | None:
        """(collectives, memory, source) of one train step, or None for a strategy the formulas do not cover.

        Collectives: `Comm` rows (written with `CommBuilder`), bytes per device per step. Memory: bytes per
        device, with the keys params, grads, optimizer, activations and total (`sk.plan` compares total with the
        device's memory). Source: where the figures come from, as `sk.explain` prints it. `nbytes`: bytes per
        parameter value; `backend`: "cpu", "gpu" or "tpu", the compiler the figures describe."""

    def remat_policy(self, strategy: Any) -> str:
        """The remat policy the formulas assume under `strategy`: its `remat` kernel slot ("none" if unset)."""
        return resolve(strategy).kernels.get("remat") or "none"

    def recompute_flops(self, strategy: Any, mesh: dict[str, int], batch_shapes: dict[str, tuple[int, ...]]) -> float:
        """FLOPs per device per step the backward re-runs under `remat_policy(strategy)` (asked where
        `models_remat`; 0 here)."""
        return 0.0

    def indivisible(self, strategy: Any, mesh: dict[str, int], global_batch: int) -> str:
        """Why the model's shapes do not divide `mesh` under `strategy` ("" if they do); `sk.plan` drops such plans."""
        return ""

    def memory_error(self, backend: str) -> float:
        """How far the predicted memory may be from the compiler's peak, as a fraction of the prediction (its
        measured band on `backend`; 0: not measured). `sk.plan` marks a plan "tight" when the prediction plus this
        fraction passes the memory it may use, so a plan near the limit is never offered without its margin."""
        return 0.0


_REGISTRY: dict[type, type[CostModel]] = {}
_C = TypeVar("_C", bound=type[CostModel])


def register(config_type: type) -> Callable[[_C], _C]:
    """A class decorator: the decorated CostModel is the cost model of `config_type` (and of its subclasses that
    have none of their own). Registering a type again replaces its cost model."""
    if not isinstance(config_type, type):
        raise ShardkitError(f"costmodel.register({config_type!r}): give the model config's class")

    def add(cls: _C) -> _C:
        if not (isinstance(cls, type) and issubclass(cls, CostModel)):
            raise ShardkitError(f"costmodel.register({config_type.__name__}): {cls!r} is not a sk.costmodel.CostModel "
                                "subclass; derive it from CostModel and define predict(...)")  # fmt: skip
        _REGISTRY[config_type] = cls
        return cls

    return add


def for_config(cfg: Any) -> CostModel | None:
    """The cost model of `cfg`: the CostModel registered for its type (or the nearest base), built on `cfg`; `cfg`
    itself if it is a CostModel; None if there is none. A config that carries the old hooks itself (`cost_model`,
    ...) is wrapped, with a DeprecationWarning (module docstring)."""
    if cfg is None or isinstance(cfg, CostModel):
        return cfg
    for klass in type(cfg).__mro__:
        if klass in _REGISTRY:
            return _REGISTRY[klass](cfg)
    if callable(getattr(cfg, "cost_model", None)):
        warnings.warn(f"{type(cfg).__name__}.cost_model(...): a model config's cost hooks are deprecated and go in "
                      "the next release; register a sk.costmodel.CostModel for the config's type instead "
                      "(@sk.costmodel.register(Config), docs/planner.md)",
                      DeprecationWarning, stacklevel=2)  # fmt: skip
        return _ConfigHooks(cfg)
    return None


class _ConfigHooks(CostModel):
    """Deprecated: the hooks a config carried itself before `CostModel` (for one release)."""

    def __init__(self, cfg: Any):
        super().__init__(cfg)
        self.plan_strategies = tuple(getattr(cfg, "plan_strategies", None) or DEFAULT_STRATEGIES)
        self.models_remat = callable(getattr(cfg, "recompute_flops", None))

    def predict(self, *args: Any) -> Terms | None:
        return self.cfg.cost_model(*args)

    def remat_policy(self, strategy: Any) -> str:
        hook = getattr(self.cfg, "remat_policy", None)
        return hook(strategy) if callable(hook) else super().remat_policy(strategy)

    def recompute_flops(self, *args: Any) -> float:
        return self.cfg.recompute_flops(*args)

    def indivisible(self, *args: Any) -> str:
        hook = getattr(self.cfg, "indivisible", None)
        return hook(*args) if callable(hook) else ""


__all__ = ["DEFAULT_STRATEGIES", "CostModel", "Terms", "for_config", "register"]
