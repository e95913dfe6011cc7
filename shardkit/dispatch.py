"""Which train step runs a strategy, and a run's options applied to it: the registry `make_train_step` reads.

    @sk.register_step("my_step")
    class MyStep(sk.TrainStep): ...                     # shardkit/step.py: the interface
    step = sk.make_train_step(model, tx, mesh, sk.strategy("dp").replace(step="my_step"))
    strategy = sk.configure("sdp", {"sdp": {"coverage": 0.25}}, devices=8)

No module here names a parallelism: the steps register themselves next to their parallelism
(shardkit/parallel/gspmd/step.py, sdp/step.py, hetero/step.py), and kernels bring their own `configure`
(shardkit/kernels.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import optax
from flax import nnx
from jax.sharding import Mesh

from shardkit import kernels
from shardkit.errors import ShardkitError
from shardkit.presets import HardwarePreset
from shardkit.step import TrainStep
from shardkit.strategies import BoundStrategy, Strategy
from shardkit.strategies import strategy as get_strategy

STEPS: dict[str, type[TrainStep]] = {}
_T = TypeVar("_T", bound=type[TrainStep])


def register_step(name: str) -> Callable[[_T], _T]:
    """Class decorator: `Strategy(step=name)` is run by this class (replacing any step of that name)."""

    def register(cls: _T) -> _T:
        if not (isinstance(cls, type) and issubclass(cls, TrainStep)):
            raise ShardkitError(f"register_step({name!r}): {cls!r} is not a subclass of sk.TrainStep")
        STEPS[name] = cls
        cls.step_name = name  # for its messages
        return cls

    return register


def step_class(name: str) -> type[TrainStep]:
    """The step class registered as `name`."""
    if name not in STEPS:
        raise ShardkitError(
            f"strategy names step {name!r}, which is not registered; registered steps: {', '.join(sorted(STEPS))} "
            "(a step registers itself with @sk.register_step(name) when its module is imported)"
        )
    return STEPS[name]


def make_train_step(
    model: nnx.Module,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    strategy: str | Strategy | BoundStrategy,
    **options: Any,
) -> TrainStep:
    """A jitted train step for `model` under `strategy` on `mesh`: `step(state, batch) -> (state, metrics)`.

    The step class is the one the strategy names (`Strategy.step`; "gspmd" by default, shardkit/parallel/gspmd/),
    built with exactly these arguments: the signature is `TrainStep.__init__`'s, one signature for both (help()
    and `inspect.signature` show its keywords). `strategy`: a name, a Strategy, or the run's BoundStrategy (resolved
    once and taken as it is). `loss_fn(model, batch) -> (loss, metrics)`: default the model's own `loss` (a GPT's
    next-token loss); `batch_axes`: the logical names of the batch's dimensions (default the model's, else
    ("batch",)); `microbatches`: gradient accumulation steps per call; `donate`: the state's buffers are reused in
    place."""
    cls = step_class(get_strategy(strategy).step)  # a Strategy or BoundStrategy is not looked up again
    return cls(model, optimizer, mesh, strategy, **options)


def _signature_of_the_step() -> inspect.Signature:
    """`TrainStep.__init__`'s signature without `self`, returning a TrainStep: `make_train_step`'s."""
    sig = inspect.signature(TrainStep.__init__, eval_str=True)
    return sig.replace(parameters=list(sig.parameters.values())[1:], return_annotation=TrainStep)


make_train_step.__signature__ = _signature_of_the_step()  # type: ignore[attr-defined]


def configure(
    strategy: str | Strategy, sections: Mapping[str, Any], *, devices: int, global_batch: int = 0,
    preset: HardwarePreset | None = None,
) -> Strategy:  # fmt: skip
    """The strategy with a run's options applied, looked up by name, no branch per parallelism: the section named
    after the strategy's step (`sections["sdp"]`) goes to that step class's `configure`, the section named after a
    kernel of its table (`sections["pipeline"]` for a `pipeline:...` layer stack) to that kernel's `configure`."""
    strategy = get_strategy(strategy)
    context = dict(devices=devices, global_batch=global_batch, preset=preset)
    strategy = step_class(strategy.step).configure(strategy, dict(sections.get(strategy.step) or {}), **context)
    table = {}
    for slot, name in strategy.kernels.items():
        if slot not in kernels.slots():
            continue
        kernel = kernels.lookup(slot, name)
        if kernel.configure is not None and sections.get(kernel.name):
            table[slot] = kernel.configure(name, dict(sections[kernel.name]))
    return strategy.replace(kernels=table) if table else strategy


__all__ = ["STEPS", "configure", "make_train_step", "register_step", "step_class"]
