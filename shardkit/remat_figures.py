"""What each rematerialization policy costs, measured on the compiled step: memory saved against FLOPs recomputed.

    from shardkit.explain import format_remat_table, remat_figures
    rows = remat_figures(step, state, batch)          # policies: none, full, dots, dots_no_batch
    print(format_remat_table(rows))

For each policy the step is rebuilt with the strategy's `remat` kernel set to it (docs/memory.md), lowered for the
same (state, batch) (ShapeDtypeStructs suffice: nothing is allocated) and compiled. Per device:

- `temp_bytes`: `memory_analysis().temp_size_in_bytes`, the buffers live during the step (saved activations,
  gradients, workspaces): what a policy trades away;
- `flops`: XLA's `cost_analysis()["flops"]`, which counts a while loop's body once (a scanned layer stack as one
  layer), so it is reported as XLA gives it;
- `matmul_flops`: the dots' and convolutions' FLOPs with each loop body counted per trip (`shardkit.hlo.matmul_flops`);
- `recomputed_flops = matmul_flops(policy) - matmul_flops(none)`: the matmuls the backward pass runs again
  (recomputed elementwise work, norms and activations, is left out: it is small next to the matmuls and XLA fuses it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from shardkit import hlo
from shardkit.dispatch import make_train_step
from shardkit.layers import REMAT_POLICIES

#: The policies the table measures by default (`names:` / `offload:` need a model's tag names: pass them).
POLICIES = REMAT_POLICIES


@dataclasses.dataclass(frozen=True)
class PolicyFigures:
    """One remat policy's compiled step, per device."""

    policy: str
    temp_bytes: int
    flops: float  # cost_analysis(), loop bodies once
    matmul_flops: int  # loop-aware
    recomputed_flops: int  # matmul_flops - matmul_flops of "none"

    def relative_to(self, base: PolicyFigures) -> dict[str, float]:
        """temp and matmul FLOPs as ratios to `base` (the `none` row)."""
        return {"temp": self.temp_bytes / max(base.temp_bytes, 1),
                "matmul_flops": self.matmul_flops / max(base.matmul_flops, 1)}  # fmt: skip


def compile_policy(step: Any, state: Any, batch: Any, policy: str) -> Any:
    """`step`'s program with the strategy's remat kernel set to `policy`, compiled for (state, batch)."""

    strategy = step.strategy.replace(kernels={"remat": policy})
    other = make_train_step(step.source_model, step.tx, step.mesh, strategy, loss_fn=step.loss_fn,
                            batch_axes=step.batch_axes, microbatches=step.microbatches, donate=step.donate)  # fmt: skip
    return other.compile(state, batch)


def figures(compiled: Any, policy: str, base_matmul_flops: int | None = None) -> PolicyFigures:
    """The figures of one compiled step (`base_matmul_flops`: the `none` step's; None: this is it)."""
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost  # jax < 0.4.30 returned one dict per program
    mm = hlo.matmul_flops(compiled)
    base = mm if base_matmul_flops is None else base_matmul_flops
    temp = int(compiled.memory_analysis().temp_size_in_bytes)
    return PolicyFigures(policy, temp, float((cost or {}).get("flops", 0.0)), mm, mm - base)


def remat_figures(
    step: Any, state: Any, batch: Any, policies: Sequence[str] = POLICIES, compiled: Any = None
) -> list[PolicyFigures]:
    """Per policy, the compiled temporary memory and FLOPs of `step` for (state, batch); `none` is compiled first
    (it is the baseline of `recomputed_flops`) and listed first. `compiled`: `step`'s own program, if compiled
    already, used for its own policy. A model whose layers run under no remat slot (neither `sk.layers` stacks nor
    `sk.layers.checkpoint` / `checkpoint_module`) compiles the same program under every policy."""
    own = step.strategy.kernels.get("remat")  # None: the model's own remat= may decide: compile every policy
    rows: list[PolicyFigures] = []
    for policy in ["none", *[p for p in policies if p != "none"]]:
        program = (
            compiled
            if compiled is not None and own is not None and policy == own
            else compile_policy(step, state, batch, policy)
        )
        rows.append(figures(program, policy, rows[0].matmul_flops if rows else None))
    return rows


def format_remat_table(rows: Sequence[PolicyFigures]) -> str:
    """The rows as text, each relative to the first (`none`)."""
    base = rows[0]
    head = f"{'remat policy':<26} {'temp memory':>12} {'x none':>7} {'matmul FLOPs':>13} {'x none':>7} "
    head += f"{'recomputed':>11}"
    lines = ["remat policies, compiled per device (temp: memory_analysis; FLOPs: dots + convs, loops counted per trip)",
             head, "-" * len(head)]  # fmt: skip
    for r in rows:
        rel = r.relative_to(base)
        lines.append(f"{r.policy:<26} {r.temp_bytes / 2**20:>8.2f} MiB {rel['temp']:>7.2f} "
                     f"{r.matmul_flops / 1e9:>9.3f} GF {rel['matmul_flops']:>7.2f} "
                     f"{r.recomputed_flops / 1e9:>8.3f} GF")  # fmt: skip
    return "\n".join(lines)


__all__ = ["POLICIES", "PolicyFigures", "compile_policy", "figures", "format_remat_table", "remat_figures"]
