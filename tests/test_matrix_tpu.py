"""The strategy x model matrix on the TPU compiler: one cell of every strategy, and every model family, compiled by
XLA's TPU compiler (libtpu) for a TPU v5e slice of the cell's size, from this CPU-only machine.

What is asserted is read from the program the TPU compiler produced (shardkit.hlo on its HLO, its
memory_analysis): every mesh axis the strategy uses (size > 1) carries at least one collective — the axis is
really partitioned, not replicated — with the collective kinds the strategy's parallelism implies; the memory
report is the chip's (16 GiB per v5e chip) and the step fits. Numerical parity is tests/test_matrix_*.py's, on
CPU: a compiled TPU program cannot run here. The models are tests/matrix.py's tiny ones.
"""

import jax
import matrix as mx
import optax
import pytest

import shardkit as sk
from shardkit import hlo

#: strategy -> (family, kinds of collective that must appear on each of its sharded axes' collectives, as a set
#: of alternatives per axis group). The family is one that trains under the strategy (tests/matrix.py's
#: EXPECTED), chosen so that all six families appear.
CELLS = {
    "dp": "resnet",
    "zero1": "guide",
    "fsdp": "gpt",
    "tp": "gpt",
    "tp_sp": "guide",
    "fsdp_tp": "moe",
    "dp_fsdp_tp": "gpt",
    "tp3d": "guide",
    "tp_channels": "resnet",
    "cp_ring": "moe",
    "cp_zigzag": "gpt",
    "cp_striped": "gpt",
    "cp_ulysses": "moe",
    "cp_usp": "gpt",
    "fsdp_cp_zigzag": "gpt",
    "cp_zigzag_tp": "gpt",
    "pp": "gpt",
    "pp_dp": "gpt",
    "pp_fsdp": "gpt",
    "pp_tp": "gpt",
    "ep": "moe",
    "ep_gspmd": "moe",
    "ep_tp": "moe",
    "ep_fsdp": "moe",
    "spatial": "cosmoflow",
    "spatial_dp": "unet3d",
    "spatial_halo": "cosmoflow",
    "spatial_dp_halo": "cosmoflow",
    "sdp": "gpt",
    "hetero_dp": "gpt",
    "dp_split_head": "guide",
    "annotated": "resnet",
}
#: mesh axis -> the collective kinds one of which must run over it (any kind: "*")
AXIS_KINDS = {
    "seq": {"collective-permute", "all-to-all", "all-gather", "reduce-scatter"},  # ring / Ulysses / gathered k, v
    "seq_r": {"collective-permute"},
    "seq_u": {"all-to-all"},
    "stage": {"collective-permute"},
    "expert": {"all-to-all", "all-gather", "reduce-scatter", "all-reduce"},  # ep: all-to-all; ep_gspmd: GSPMD's
    "space": {"collective-permute", "all-gather", "all-reduce", "reduce-scatter"},  # halos (or GSPMD's gathers)
}


#: strategies whose GPT train step tests/test_hlo_tpu.py compiles for the TPU and reads back against its formulas
#: (a stronger check than the one here): not compiled twice
IN_HLO_TPU = ("fsdp", "tp", "fsdp_tp", "cp_ring", "cp_zigzag", "tp3d", "ep", "pp_dp")


def test_every_strategy_and_family_has_a_cell():
    assert set(CELLS) == set(mx.MESH)
    assert set(IN_HLO_TPU) <= set(CELLS)  # every strategy compiled for TPU here or there
    assert {CELLS[s] for s in CELLS if s not in IN_HLO_TPU} == set(mx.FAMILIES)  # every family compiled here
    refused = [(s, f) for s, f in CELLS.items() if (s, f) in mx.REFUSED]
    assert not refused, f"cells the matrix refuses: {refused}"


def _target_for(spec: str) -> str:
    n = 1
    for part in spec.split(","):
        n *= int(part.split("=")[1])
    return {4: "v5e-4", 8: "v5e-8"}[n]


@pytest.mark.parametrize("strategy", [s for s in CELLS if s not in IN_HLO_TPU])
def test_cell_compiles_for_tpu(strategy: str) -> None:
    fam = mx.family(CELLS[strategy])
    mesh = sk.make_mesh(mx.MESH[strategy], target=_target_for(mx.MESH[strategy]))
    strat = mx.strategy_for(strategy)
    batch = fam.batch()
    if CELLS[strategy] in ("cosmoflow", "unet3d"):  # 8 volumes: the TPU compiler's 3D convolutions take 2-3x as long
        batch = {k: v[:8] for k, v in batch.items()}  # at 16 (CosmoFlow under spatial: 3.0 s vs 8.0 s)
    if fam.tokens:
        batch = sk.attention.layout_batch(batch, *sk.kernels.batch_layout(sk.strategy(strat), mesh))
    step = sk.make_train_step(sk.abstract_model(fam.make), optax.sgd(0.1, momentum=0.9), mesh, strat,
                              loss_fn=fam.loss_fn, batch_axes=fam.batch_axes)  # fmt: skip
    report = sk.explain(step, step.abstract_state(), step.abstract_batch(batch))
    assert report.platform == "tpu" and "HloModule" in report.compiled.as_text()
    assert report.hbm_bytes == 16 * 2**30 and report.fits, report.fits_text()
    by_axis: dict[str, set[str]] = {}
    for c in report.collectives:
        for axis in c.axes:
            by_axis.setdefault(axis, set()).add(c.kind)
    assert "?" not in by_axis, f"collectives whose groups map to no mesh axes:\n{hlo.format_table(report.collectives)}"
    for axis, size in mesh.shape.items():
        if size == 1:
            continue
        kinds = by_axis.get(axis, set())
        assert kinds, f"{strategy}: nothing communicates over {axis}={size}:\n{hlo.format_table(report.collectives)}"
        want = AXIS_KINDS.get(axis)
        assert want is None or kinds & want, f"{strategy}: {axis} carries {kinds}, expected one of {want}"


def test_tpu_compile_is_the_tpu_compilers():
    """The cells above are compiled by libtpu, not XLA:CPU: the same step's program carries TPU's tiled layouts
    (e.g. f32[8,128]{1,0:T(8,128)}), which XLA:CPU never writes."""
    fam = mx.family("gpt")
    texts = {}
    for where, mesh in (("cpu", sk.make_mesh("data=8")), ("tpu", sk.make_mesh("data=8", target="v5e-8"))):
        step = sk.make_train_step(sk.abstract_model(fam.make), optax.sgd(0.1), mesh, "dp")
        report = sk.explain(step, step.abstract_state(), step.abstract_batch(fam.batch()))
        texts[where] = (report.platform, ":T(" in report.hlo_text)
    assert jax.devices()[0].platform == "cpu"
    assert texts == {"cpu": ("cpu", False), "tpu": ("tpu", True)}
