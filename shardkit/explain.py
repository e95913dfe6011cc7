"""What a compiled train step really costs: collectives per mesh axis and memory per device, next to the model.

One idea at about 430 lines: the report (read from the compiled program, set beside the prediction) and its
text, JSON and plot; the reading is hlo.py's, the predictions the cost models'.

    report = sk.explain(step, state, batch)        # state / batch may be ShapeDtypeStructs: nothing is allocated
    print(report.text()); report.to_json(); report.plot("explain.png")

Works for any model and batch: the batch is described by its leaves' shapes and logical names (`batch_axes`).
Collectives come from the partitioned HLO (`shardkit.hlo.collectives`: replica groups mapped back to mesh axes,
loop bodies multiplied by their trip counts, ring bytes sent per device). Memory comes from
`compiled.memory_analysis()`, with parameters and optimizer state split out from the state's shardings.
Predictions: the model's own cost model when it has one (`sk.costmodel.for_config(cfg).predict(strategy, mesh,
batch_shapes, nbytes, backend)`, registered beside the model by config type; the GPT's, models/gpt_cost/, covers dp,
zero1, fsdp, tp, tp_sp, fsdp_tp, dp_fsdp_tp, tp3d), otherwise the parameter traffic and state memory that the
strategy's rules tables imply, for any model and any registered strategy (`shardkit.costmodel_rules`); activation
collectives without a cost model are "not modelled".

A plan for a mesh larger than the machine is explained on a smaller mesh (`explain(..., target_mesh=...)`,
see experiments/explain.py) and its figures scaled: parameters and optimizer state exactly from the shardings'
specs, collectives by the model's target/built ratio per (kind, axis) (the ring factor where the model is
silent), temporaries by the per-device token ratio. Scaled figures are labelled as such everywhere.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import math
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from shardkit import costmodel, costmodel_rules, hlo, kernels, offload, roofline, targets
from shardkit.costmodel.torus import as_compiled as torus_as_compiled
from shardkit.costmodel.torus import torus_slice
from shardkit.remat_figures import POLICIES, PolicyFigures, format_remat_table, remat_figures
from shardkit.rules import MESH_AXES, platform_family
from shardkit.traits import Traits

_BRACKETS = "[]'"  # of a batch leaf's path, "['image']" -> image
_MEM_ROWS = ("parameters", "optimizer_state", "temporaries", "outputs")
_PRED_OF = {"parameters": ("params",), "optimizer_state": ("optimizer",), "temporaries": ("grads", "activations"),
            "outputs": ("params", "optimizer")}  # fmt: skip


def _h(n: float | None) -> str:
    if n is None:
        return "-"
    return next(
        f"{n / 1024**i:.4g} {u}"
        for i, u in ((3, "GiB"), (2, "MiB"), (1, "KiB"), (0, "B"))
        if abs(n) >= 1024**i or i == 0
    )


Prediction = tuple[dict[tuple[str, str], tuple[int, float]], dict[str, float], str]


def predict(
    strategy: Any, cfg: Any, mesh: dict[str, int], batch_shapes: dict[str, tuple[int, ...]], nbytes: int, backend: str,
    torus: tuple[int, ...] = (),
) -> Prediction | None:  # fmt: skip
    """(kind, axis) -> (count, bytes per device), memory per device, and the source, from the model's cost model
    (`costmodel.for_config(cfg)`); None when the model has none or it does not model this strategy. `torus`: the
    sides of the v4 / v5p torus slice the mesh spans, where some reduce-scatters compile as all-reduces
    (shardkit/costmodel/torus.py)."""
    model = costmodel.for_config(cfg)
    if model is None:
        return None
    out = model.predict(strategy, mesh, batch_shapes, nbytes, backend)
    if out is None:
        return None
    comms, memory, source = out
    merged: dict[tuple[str, str], tuple[int, float]] = {}
    for c in torus_as_compiled(comms, torus):
        n, b = merged.get((c.kind, c.axis), (0, 0.0))
        merged[c.kind, c.axis] = (n + c.count, b + c.bytes)
    return merged, {k: v for k, v in memory.items() if k != "total"}, source


def predict_from_rules(step: Any, state: Any, backend: str) -> Prediction:
    """Parameter traffic and state memory from the strategy's rules tables (any model, any strategy)."""
    comms = {(c.kind, c.axis): (c.count, c.bytes) for c in costmodel_rules.state_comms(step, backend)}
    source = (f"rules tables of {step.strategy.name} (shardkit.costmodel_rules, backend {backend}): parameter "
              "traffic and state only; activation collectives and memory not modelled for this model")  # fmt: skip
    return comms, costmodel_rules.state_memory(step, state), source


def _shard_bytes(shape: tuple[int, ...], dtype: Any, spec: Any, sizes: dict[str, int]) -> int:
    """Bytes of one device's shard of an array of `shape` partitioned by `spec` over axes of `sizes`."""
    dims = list(shape)
    for i, entry in enumerate(tuple(spec)[: len(dims)]):
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        dims[i] = -(-dims[i] // math.prod(sizes.get(a, 1) for a in axes))
    return math.prod(dims) * np.dtype(dtype).itemsize


def _tree_bytes(tree: Any, shardings: Any, sizes: dict[str, int]) -> int:
    leaves, shs = jax.tree.leaves(tree), jax.tree.leaves(shardings)
    return sum(_shard_bytes(x.shape, x.dtype, s.spec, sizes) for x, s in zip(leaves, shs, strict=True))


@dataclasses.dataclass
class Report:
    """The explanation of one compiled step; `scaled` is set when the plan's mesh was larger than the machine."""

    strategy: str
    mesh: dict[str, int]  # the mesh compiled on
    platform: str
    batch: dict[str, tuple[int, ...]]  # each batch leaf's shape, by its path ("['inputs']")
    collectives: list[hlo.Collective]
    memory: dict[str, int]  # per device, from memory_analysis() and the state shardings
    predicted_comms: dict[tuple[str, str], tuple[int, float]] | None = None
    predicted_memory: dict[str, float] | None = None
    prediction_source: str = "no prediction"
    scaled: dict[str, Any] | None = None  # target_mesh, collectives, memory, predictions on the target
    notes: list[str] = dataclasses.field(default_factory=list)
    #: (path, shape, bytes) of each parameter without logical names: replicated on every device
    unnamed_params: list[tuple[str, tuple[int, ...], int]] = dataclasses.field(default_factory=list)
    #: per remat policy, the compiled temporary memory and FLOPs (`explain(..., remat_policies=...)`), none first
    remat: list[PolicyFigures] | None = None
    #: memory per device of the hardware compiled for (a target's chip, or a preset with the devices' kind); None:
    #: unknown (CPU: host memory, shared by the virtual devices). `fits` compares the peak with it less the margin
    hbm_bytes: float | None = None
    hbm_margin: float = 0.0
    hbm_source: str = ""
    #: the predicted step time and MFU (shardkit/roofline.py): a PREDICTION, None without the chip's figures
    roofline: roofline.Roofline | None = None
    #: the compiled executable (for `jax.experimental.serialize_executable`); not part of to_dict()
    compiled: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def hlo_text(self) -> str:
        """The compiled program's HLO text (after partitioning and the backend's passes: the TPU compiler's own)."""
        return self.compiled.as_text() if self.compiled is not None else ""

    @property
    def fits(self) -> bool | None:
        """Whether the compiled peak per device fits the device's HBM less the margin; None when HBM is unknown."""
        return None if self.hbm_bytes is None else self.memory["peak"] <= self.hbm_bytes * (1 - self.hbm_margin)

    def fits_text(self) -> str:
        """'fits in HBM: yes, by 3.1 GiB (peak 12.1 GiB of 15.2 GiB usable: 16 GiB TPU v5 lite HBM less 5%)'."""
        if self.hbm_bytes is None:
            return f"fits in HBM: unknown (no memory figure for {self.platform} devices; a target or preset gives one)"
        usable = self.hbm_bytes * (1 - self.hbm_margin)
        spare = usable - self.memory["peak"]
        return (f"fits in HBM: {'yes' if spare >= 0 else 'NO'}, by {_h(abs(spare))} "
                f"{'to spare' if spare >= 0 else 'too much'} (peak {_h(self.memory['peak'])} of {_h(usable)} usable: "
                f"{_h(self.hbm_bytes)} {self.hbm_source} less {self.hbm_margin:.0%})")  # fmt: skip

    def rows(self) -> list[dict[str, Any]]:
        """One row per (kind, mesh axes): measured count / bytes, predicted, and scaled figures when present."""
        pred, measured = self.predicted_comms or {}, hlo.summarize(self.collectives)
        keys = list(measured) + [(k, tuple(a.split(","))) for k, a in pred if (k, tuple(a.split(","))) not in measured]
        out = []
        for kind, axes in keys:
            m = measured.get((kind, axes), {"count": 0, "bytes_sent": 0.0})
            p = pred.get((kind, ",".join(axes)))
            row = dict(kind=kind, axes=list(axes), count=m["count"], bytes_sent=m["bytes_sent"])
            row.update(predicted_count=p[0] if p else None, predicted_bytes=p[1] if p else None)
            if self.scaled:
                row.update(self.scaled["collectives"].get(f"{kind}|{','.join(axes)}", {}))
            out.append(row)
        return out

    def memory_rows(self) -> list[dict[str, Any]]:
        pm, out = self.predicted_memory, []
        for name in (*_MEM_ROWS, "peak"):
            known = pm and name in _PRED_OF and all(k in pm for k in _PRED_OF[name])
            pred = sum(pm[k] for k in _PRED_OF[name]) if known else None  # None: not modelled
            row = dict(name=name, compiled=self.memory[name], predicted=pred)
            if self.scaled:
                row.update(
                    scaled=self.scaled["memory"].get(name), predicted_target=self.scaled["predicted_memory"].get(name)
                )
            out.append(row)
        return out

    def text(self) -> str:
        grid = ",".join(f"{a}={n}" for a, n in self.mesh.items())
        n_dev = math.prod(self.mesh.values())
        leaves = ", ".join(f"{k.strip(_BRACKETS)} {list(v)}" for k, v in self.batch.items())
        lines = [f"shardkit explain: {self.strategy} on mesh {grid} ({n_dev} x {self.platform}), batch {leaves}"]
        sc = self.scaled
        if sc:
            tgrid = ",".join(f"{a}={n}" for a, n in sc["target_mesh"].items())
            n_target = math.prod(sc["target_mesh"].values())
            lines += [f"SCALED: the plan's mesh {tgrid} ({n_target} devices) is larger than this machine; "
                      f"compiled on {grid} and scaled ({sc['method']})"]  # fmt: skip
        lines += [
            "",
            f"collectives per step, bytes sent per device (ring volume); prediction: {self.prediction_source}",
        ]
        head = f"{'kind':<18} {'axes':<16} {'count':>6} {'sent':>10} {'pred #':>7} {'predicted':>10}"
        head += f" | {'SCALED sent':>11} {'pred target':>11}" if sc else ""
        lines += [head, "-" * len(head)]
        for r in self.rows():
            pc = "-" if r["predicted_count"] is None else str(r["predicted_count"])
            line = f"{r['kind']:<18} {','.join(r['axes']) or '-':<16} {r['count']:>6} {_h(r['bytes_sent']):>10} {pc:>7}"
            line += f" {_h(r['predicted_bytes']):>10}"
            if sc:
                line += f" | {_h(r.get('scaled_bytes')):>11} {_h(r.get('predicted_target_bytes')):>11}"
            lines.append(line)
        tot = sum(c.bytes_sent for c in self.collectives)
        ptot = sum(b for _, b in (self.predicted_comms or {}).values()) if self.predicted_comms else None
        line = (
            f"{'total':<18} {'':<16} {sum(c.count for c in self.collectives):>6} {_h(tot):>10} {'':>7} {_h(ptot):>10}"
        )
        if sc:
            line += f" | {_h(sum(r.get('scaled_bytes') or 0 for r in self.rows())):>11} {_h(sc['predicted_total']):>11}"
        lines += [line, "", "memory per device (compiled: memory_analysis(); parameters / optimizer state: shardings)"]
        head = f"{'':<16} {'compiled':>10} {'predicted':>10}" + (f" | {'SCALED':>10} {'pred target':>11}" if sc else "")
        lines += [head, "-" * len(head)]
        for r in self.memory_rows():
            line = f"{r['name']:<16} {_h(r['compiled']):>10} {_h(r['predicted']):>10}"
            lines.append(line + (f" | {_h(r['scaled']):>10} {_h(r['predicted_target']):>11}" if sc else ""))
        lines += [
            "  (predicted: temporaries = gradients + activations, outputs = new parameters + optimizer state;",
            "   peak = arguments + outputs - aliased + temporaries)",
        ]
        lines += [self.fits_text()]
        lines += ["", self.roofline.text()] if self.roofline else []
        lines += [f"note: {n}" for n in self.notes]
        if self.remat:
            lines += ["", format_remat_table(self.remat)]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return dict(
            strategy=self.strategy, mesh=dict(self.mesh), platform=self.platform,
            batch={k: list(v) for k, v in self.batch.items()},
            collectives=self.rows(), collectives_detail=[dataclasses.asdict(c) for c in self.collectives],
            memory=dict(self.memory), memory_rows=self.memory_rows(), predicted_memory=self.predicted_memory,
            prediction_source=self.prediction_source, scaled=self.scaled, notes=list(self.notes),
            unnamed_params=[dict(path=p, shape=list(shape), bytes=b) for p, shape, b in self.unnamed_params],
            remat=[dataclasses.asdict(r) for r in self.remat] if self.remat else None,
            hbm_bytes=self.hbm_bytes, hbm_margin=self.hbm_margin, hbm_source=self.hbm_source, fits=self.fits,
            roofline=self.roofline.to_dict() if self.roofline else None,
        )  # fmt: skip

    def to_json(self, **kw: Any) -> str:
        return json.dumps(self.to_dict(), **{"indent": 2, **kw})

    def plot(self, path: str) -> str:
        """A PNG: bytes sent per (kind, axes) and memory per device, compiled next to predicted (and scaled)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4))
        rows, w = self.rows(), 0.4
        x = np.arange(len(rows))
        a1.bar(x - w / 2, [r["bytes_sent"] / 2**20 for r in rows], w, label="compiled (HLO)")
        a1.bar(x + w / 2, [(r["predicted_bytes"] or 0) / 2**20 for r in rows], w, label="predicted")
        a1.set_xticks(x, [f"{r['kind']}\n{','.join(r['axes']) or '-'}" for r in rows], fontsize=7)
        a1.set_ylabel("MiB sent per device per step")
        a1.set_title(f"collectives: {self.strategy} on {','.join(f'{a}={n}' for a, n in self.mesh.items())}")
        a1.legend(fontsize=8)
        mrows = self.memory_rows()
        x = np.arange(len(mrows))
        a2.bar(x - w / 2, [r["compiled"] / 2**20 for r in mrows], w, label="compiled")
        a2.bar(x + w / 2, [(r["predicted"] or 0) / 2**20 for r in mrows], w, label="predicted")
        a2.set_xticks(x, [r["name"] for r in mrows], fontsize=8)
        a2.set_ylabel("MiB per device")
        a2.set_title("memory per device" + (" (compiled mesh; see text for SCALED)" if self.scaled else ""))
        a2.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
        plt.close(fig)
        return path


def _idle_mesh_axis_names(step: Any, params: Any) -> tuple[list[str], int, int] | None:
    """(mesh axis names used as logical names that the strategy's parameter rules replicate, how many parameters
    carry one, their bytes) — None if there are none."""
    bound, names = getattr(step, "bound", None), getattr(step, "param_names", None)
    if bound is None or names is None:
        return None
    idle_axes = {a for a in MESH_AXES if a in bound.param_rules and bound.param_rules[a] is None}
    found, count, nbytes = set(), 0, 0
    for leaf_names, sds in zip(jax.tree.leaves(names, is_leaf=lambda x: isinstance(x, tuple)), jax.tree.leaves(params),
                               strict=False):  # fmt: skip
        hit = idle_axes.intersection(n for n in leaf_names if isinstance(n, str))
        if hit:
            found |= hit
            count += 1
            nbytes += int(np.prod(sds.shape)) * np.dtype(sds.dtype).itemsize
    return (sorted(found), count, nbytes) if found else None


def explain(
    step: Any, state: Any, batch: Any, *, model_cfg: Any = None, target_mesh: dict[str, int] | None = None,
    remat_policies: Sequence[str] = (), hardware: Any = None,
) -> Report:  # fmt: skip
    """Compiles `step` for (state, batch) — concrete arrays or ShapeDtypeStructs — and explains it.

    `model_cfg`: the model config whose registered cost model predicts (`sk.costmodel.register`), or a CostModel
    (default: the step's model's `cfg`); without one, the prediction is what the strategy's rules tables imply for
    the parameters.
    `target_mesh`: the plan's mesh when `step.mesh` is a scaled-down stand-in; adds SCALED figures.
    `remat_policies`: also compile the step under each of these remat policies (`none` is always added) and report
    each one's temporary memory and recomputed FLOPs (`remat_figures`, docs/memory.md).
    `hardware`: what `report.fits` compares the peak with: an `sk.target(...)` (its HBM less its margin) or a
    HardwarePreset; default: the chip of the mesh's devices (shardkit.targets.chip_of), none on CPU.
    """
    # kernels that issue their own collectives report them while traced
    with kernels.recording() as traced:
        compiled = step.compile(state, batch)
    # a step traced before (jax's trace cache: this lowering ran no Python) kept its kernels' reports itself
    traced = traced or (step.kernel_calls(batch) if hasattr(step, "kernel_calls") else [])
    mesh = step.mesh
    sizes = dict(mesh.shape)
    platform = platform_family(mesh)
    colls = hlo.collectives(compiled, mesh)
    ma = compiled.memory_analysis()
    get = lambda k: int(getattr(ma, k, 0) or 0)
    params = _tree_bytes(state.params, step.state_shardings.params, sizes)  # SDP: its [workers, k, ...] layout
    opt = _tree_bytes(state.opt_state, step.opt_shardings, sizes)
    args, outs, alias, temp = (get(f"{k}_size_in_bytes") for k in ("argument", "output", "alias", "temp"))
    memory = dict(parameters=params, optimizer_state=opt, temporaries=temp, outputs=outs, arguments=args,
                  aliased=alias, peak=args + outs - alias + temp)  # fmt: skip
    shapes = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in jax.tree_util.tree_leaves_with_path(batch)}
    cfg = model_cfg if model_cfg is not None else getattr(getattr(step, "source_model", None), "cfg", None)
    nbytes = int(np.dtype(jax.tree.leaves(state.params)[0].dtype).itemsize)
    backend = platform
    notes = []
    if platform == "cpu" and Traits.of(step.strategy).reduce_scatters:
        notes.append("XLA:CPU compiles GSPMD reduce-scatters as all-reduce + dynamic-slice ; "
                     "the cost model's CPU backend predicts the same")  # fmt: skip
    if getattr(step, "microbatches", 1) > 1:
        notes.append(f"{step.microbatches} microbatches: predictions assume none (one gradient reduction per step)")
    fused = collections.Counter()
    for name, n in hlo.kernel_calls(compiled, "gpu" if platform == "gpu" else "tpu_custom_call"):
        fused[name] += n
    if fused:
        kind = "Triton / cuDNN kernels" if platform == "gpu" else "Mosaic kernels"
        example = "pallas_gpu, cudnn" if platform == "gpu" else "splash"
        notes.append(f"{kind} per step (Pallas, e.g. attention_block={example}): "
                     + ", ".join(f"{k} x{n}" for k, n in sorted(fused.items()))
                     + "; their FLOPs are inside the kernels, not among the HLO's dots")  # fmt: skip
    own = getattr(step, "predict_costs", None)  # a step that knows its own collectives (SDP's holder averaging)
    torus = torus_slice(mesh) if platform == "tpu" else ()
    pred = own(state, backend) if own else predict(step.strategy, cfg, sizes, shapes, nbytes, backend, torus)
    if pred is None:
        pred = predict_from_rules(step, state, backend)
        notes.append(f"no cost model of {type(getattr(step, 'source_model', None)).__name__}'s activations for "
                     f"{step.strategy.name}: rows predicted '-' are not modelled")  # fmt: skip
    unpredicted = [t for t in traced if not any(k == t.collective for k, _ in pred[0])]
    if unpredicted:
        # collectives the kernels issue themselves (spatial halos, ...) that the model's hook does not predict:
        # each forward collective and, where the kernel's input is differentiated, its transpose
        comms = dict(pred[0])
        for t in unpredicted:
            for axis, b in t.sends:
                n, total = comms.get((t.collective, axis), (0, 0.0))
                comms[t.collective, axis] = (n + 1 + t.backward, total + (1 + t.backward) * b)
        sources = ", ".join(sorted({t.source for t in unpredicted}))
        pred = (comms, pred[1], f"{pred[2]}; {len(unpredicted)} kernel calls' own collectives, as traced ({sources})")
    unnamed = list(getattr(step, "unnamed_params", []))
    splits = dict(getattr(step, "unnamed_splits", {}))
    whole = [u for u in unnamed if u[0] not in splits]
    if splits:
        shown = ", ".join(f"{p} {list(shape)} on dim {splits[p][0]} over {','.join(splits[p][1])}"
                          for p, shape, _ in unnamed if p in splits)  # fmt: skip
        notes.append(f"{len(splits)} parameters have no logical names and are split as FSDP splits them (their "
                     f"largest dimension divisible by the degree): {shown}")  # fmt: skip
    if whole:
        shown = ", ".join(f"{p} {list(shape)}" for p, shape, _ in whole[:6]) + (", ..." if len(whole) > 6 else "")
        notes.append(f"{len(whole)} parameters have no logical names and are replicated on every device "
                     f"({sum(b for *_, b in whole) / 2**20:.2f} MiB each): {shown}; name them "
                     "(nnx.with_partitioning) to shard them, or strict_names=True to refuse them")  # fmt: skip
    idle = _idle_mesh_axis_names(step, state.params)
    if idle:
        notes.append(f"{idle[1]} parameters ({idle[2] / 2**20:.2f} MiB) are annotated with mesh axis names this "
                     f"strategy does not shard parameters over ({', '.join(idle[0])}): replicated along those "
                     "dimensions; strategy 'annotated' places them as annotated")  # fmt: skip
    if getattr(step, "offload", ()):  # Strategy.offload: the state that rests in host memory (shardkit/offload.py)
        memory["host"] = offload.host_bytes(compiled)["host_arguments"]
        notes.append(f"offload={','.join(step.offload)}: {_h(memory['host'])} per device rest in host memory "
                     "(pinned_host: the compiled entry layout's S(5) arguments), copied to the devices for the step; "
                     "on XLA:CPU memory_analysis() counts them among the arguments")  # fmt: skip
    report = Report(step.strategy.name, sizes, platform, shapes, colls, memory, notes=notes, unnamed_params=unnamed)
    report.compiled = compiled
    chip = hardware if hardware is not None else targets.chip_of(mesh)
    if chip is not None:
        report.hbm_bytes, report.hbm_margin = (
            float(chip.hbm_bytes),
            float(getattr(chip, "hbm_margin", targets.HBM_MARGIN)),
        )
        report.hbm_source = f"{getattr(chip, 'device_kind', '')} HBM".strip()
        if roofline.has_figures(chip):  # the predicted step time: peak FLOP/s, HBM bandwidth and links known
            flops = roofline.model_flops_per_device(cfg, shapes, math.prod(sizes.values()))
            report.roofline = roofline.roofline(compiled, mesh, chip, collectives=colls, model_flops=flops,
                                                platform=platform)  # fmt: skip
    report.predicted_comms, report.predicted_memory, report.prediction_source = pred
    if remat_policies:
        report.remat = remat_figures(step, state, batch, remat_policies, compiled=compiled)
    if target_mesh:
        report.scaled = _scale(report, step, state, batch, dict(target_mesh), cfg, nbytes, backend)
    return report


def _scale(
    r: Report, step: Any, state: Any, batch: Any, target: dict[str, int], cfg: Any, nbytes: int, backend: str
) -> dict:
    """The SCALED figures for `target` (see the module docstring for the method of each)."""
    pt = predict(step.strategy, cfg, target, r.batch, nbytes, backend)
    p_comms, p_mem = (pt[0], pt[1]) if pt else ({}, {})
    small = r.predicted_comms or {}
    colls = {}
    for kind, axes in hlo.summarize(r.collectives):
        m = hlo.summarize(r.collectives)[kind, axes]["bytes_sent"]
        key = (kind, ",".join(axes))
        if key and key in small and key in p_comms and small[key][1] > 0:
            factor, how = p_comms[key][1] / small[key][1], "cost model ratio"
        else:
            p0, p1 = (math.prod(s.get(a, 1) for a in axes) for s in (r.mesh, target))
            f0 = costmodel.ring_factor(kind, p0)
            factor, how = (costmodel.ring_factor(kind, p1) / f0 if f0 else 1.0), "ring factor only"
        colls[f"{kind}|{','.join(axes)}"] = dict(
            scaled_bytes=m * factor, scale_method=how,
            predicted_target_bytes=p_comms[key][1] if key and key in p_comms else None,
        )  # fmt: skip
    batch_deg = lambda sz: math.prod(sz.get(a, 1) for a in _batch_axes(step, batch))
    token_ratio = batch_deg(r.mesh) / batch_deg(target)
    params = _tree_bytes(state.params, step.param_shardings, target)
    opt = _tree_bytes(state.opt_state, step.opt_shardings, target)
    state_ratio = (params + opt) / max(r.memory["parameters"] + r.memory["optimizer_state"], 1)
    mem = dict(parameters=params, optimizer_state=opt, temporaries=int(r.memory["temporaries"] * token_ratio),
               outputs=int(r.memory["outputs"] * state_ratio))  # fmt: skip
    m = r.memory
    args = m["arguments"] - m["parameters"] - m["optimizer_state"] + params + opt
    mem["peak"] = int(args + mem["outputs"] - m["aliased"] * state_ratio + mem["temporaries"])
    pmem = {n: sum(p_mem.get(k, 0.0) for k in _PRED_OF[n]) for n in _PRED_OF} if p_mem else {}
    return dict(
        target_mesh=target, collectives=colls, memory=mem, predicted_memory=pmem,
        predicted_total=sum(b for _, b in p_comms.values()) if p_comms else None,
        method="parameters / optimizer state exact from the specs; collectives by cost-model ratio per (kind, axis), "
        "else ring factor; temporaries by per-device tokens; same global batch",
    )  # fmt: skip


def _batch_axes(step: Any, batch: Any) -> tuple[str, ...]:
    """Mesh axes the batch's leaves are split over (batch and, for sequences, seq): the per-device work degree."""
    specs = [sh.spec for sh in jax.tree.leaves(step.batch_shardings(batch))]
    return tuple(sorted({a for spec in specs for a in costmodel_rules.spec_axes(spec)}))


__all__ = ["POLICIES", "PolicyFigures", "Report", "explain", "format_remat_table", "predict", "remat_figures"]
