"""The strategy x model-family matrix (issue #25 item 5): shared by tests/test_matrix_lm.py and
tests/test_matrix_vision.py, and the generator of README.md's table (`python tests/matrix.py` rewrites it).

A cell trains 2 fp32 SGD steps of one tiny model under one strategy on its mesh (`MESH`) and is compared with
the same model trained on one device ("parity"), or is refused with a `ShardkitError` before XLA compiles
anything (a refusal reason in `EXPECTED`, matched against the error's text). `EXPECTED` is static: the README's
table is rendered from it, so the staleness test needs no compile.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

import shardkit as sk

STEPS = 2
RTOL = 1e-5  # fp32; see the test modules' docstrings

#: One mesh per strategy; a spec on fewer than 8 devices takes the first ones (pipelines of 4 stages x 4 layers).
MESH = {
    "dp": "data=8",
    "zero1": "data=8",
    "fsdp": "data=2,fsdp=4",
    "tp": "data=4,tensor=2",
    "tp_sp": "data=4,tensor=2",
    "fsdp_tp": "fsdp=4,tensor=2",
    "dp_fsdp_tp": "data=2,fsdp=2,tensor=2",
    "tp3d": "depth=2,row=2,col=2",
    "tp_channels": "data=4,tensor=2",
    "cp_ring": "data=2,seq=4",
    "cp_zigzag": "data=2,seq=4",
    "cp_striped": "data=2,seq=4",
    "cp_ulysses": "data=2,seq=4",
    "cp_usp": "data=2,seq_u=2,seq_r=2",
    "fsdp_cp_zigzag": "fsdp=2,seq=4",
    "cp_zigzag_tp": "data=2,seq=2,tensor=2",
    "pp": "stage=4",
    "pp_dp": "stage=2,data=4",
    "pp_fsdp": "stage=2,fsdp=4",
    "pp_tp": "stage=4,tensor=2",
    "ep": "data=2,expert=4",
    "ep_gspmd": "data=2,expert=4",
    "ep_tp": "expert=4,tensor=2",
    "ep_fsdp": "fsdp=2,expert=4",
    "spatial": "space=2,space_h=2,space_w=2",
    "spatial_dp": "data=2,space=2,space_h=2",
    "spatial_halo": "space=2,space_h=2,space_w=2",
    "spatial_dp_halo": "data=2,space=2,space_h=2",
    "sdp": "data=8",
    "hetero_dp": "data=8",
    "dp_split_head": "data=8",
    "annotated": "data=2,fsdp=4",
}
FAMILIES = ("gpt", "moe", "guide", "resnet", "cosmoflow", "unet3d")
LM_FAMILIES, VISION_FAMILIES = FAMILIES[:3], FAMILIES[3:]
BATCH = 16


def strategy_for(name: str) -> Any:
    """The registered strategy, with the options its own tests use: SDP at coverage 1 (every worker holds every
    block: SDP's step, equal to data parallelism, so to one device), hetero_dp with uneven per-device counts."""
    if name == "sdp":
        return sk.sdp.make_strategy(coverage=1.0)
    if name == "hetero_dp":
        return sk.hetero.make_strategy([3, 3, 2, 2, 1, 1, 2, 2], microbatch=1)  # 16 examples, unevenly
    return sk.strategy(name)


def mesh_for(name: str) -> Any:
    n = int(np.prod([int(p.split("=")[1]) for p in MESH[name].split(",")]))
    return sk.make_mesh(MESH[name], jax.devices()[:n])


@dataclasses.dataclass(frozen=True, eq=False)
class Family:
    make: Callable[..., Any]
    batch: Callable[[], dict[str, np.ndarray]]
    loss_fn: Any = None
    batch_axes: Any = None
    tokens: bool = False  # a [batch, seq] token batch that context parallelism lays out


@functools.cache
def family(name: str) -> Family:
    rng = np.random.default_rng(0)
    if name in ("gpt", "moe"):
        from models.gpt import GPT, GPTConfig

        # capacity factor 1: tokens can be dropped (REFUSED: under the reordering context parallelisms)
        moe = dict(num_experts=4, top_k=2, capacity_factor=1.0) if name == "moe" else {}
        cfg = GPTConfig(num_layers=4, d_model=32, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=64,
                        vocab_size=64, max_seq_len=16, **moe)  # fmt: skip

        def tokens() -> dict[str, np.ndarray]:
            t = np.random.default_rng(0).integers(0, 64, (BATCH, 17)).astype(np.int32)
            return {"inputs": t[:, :-1], "targets": t[:, 1:]}

        return Family(lambda rngs: GPT(cfg, rngs=rngs), tokens, tokens=True)
    if name == "guide":
        from test_any_model import SEQ, VOCAB, GuideLM, lm_loss

        batch = {"tokens": rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)}
        return Family(GuideLM, lambda: batch, lm_loss)
    if name == "resnet":
        from models.resnet import BATCH_AXES, ResNet, ResNetConfig, classification_loss

        cfg = ResNetConfig(widths=(8, 16), blocks=(1, 1), num_classes=8, dropout=0.25)
        batch = {"image": rng.normal(size=(BATCH, 8, 8, 1)).astype(np.float32), "label": rng.integers(0, 8, BATCH)}
        return Family(lambda rngs: ResNet(cfg, rngs=rngs), lambda: batch, classification_loss, BATCH_AXES)
    if name == "cosmoflow":
        from models.cosmoflow import CosmoFlow, CosmoFlowConfig

        cfg = CosmoFlowConfig(size=16, widths=(8, 8, 8), dense=(8,), batch_norm=True, spatial_blocks=2)
        batch = {"volume": rng.normal(size=(BATCH, 16, 16, 16, 1)).astype(np.float32),
                 "target": rng.uniform(-1, 1, (BATCH, 4)).astype(np.float32)}  # fmt: skip
        return Family(lambda rngs: CosmoFlow(cfg, rngs=rngs), lambda: batch)
    if name == "unet3d":
        from models.unet3d import UNet3D, UNet3DConfig

        cfg = UNet3DConfig(widths=(8, 8), num_classes=8)
        batch = {"volume": rng.normal(size=(BATCH, 8, 8, 8, 1)).astype(np.float32),
                 "label": rng.integers(0, 8, (BATCH, 8, 8, 8)).astype(np.int32)}  # fmt: skip
        return Family(lambda rngs: UNet3D(cfg, rngs=rngs), lambda: batch)
    raise KeyError(name)


def one_device_model(fam: Family) -> Any:
    """The family's model from seed 0, initialised once on one device: a cell's only compile is its train step
    (sharded_init on the cell's mesh would be a second one; its values are the same, tests/test_parity.py)."""
    if fam not in _MODELS:
        _MODELS[fam] = nnx.split(sk.sharded_init(fam.make, sk.make_mesh("data=1", jax.devices()[:1]), "dp", seed=0))
    graphdef, state = _MODELS[fam]
    return nnx.merge(graphdef, jax.tree.map(_host_copy, state))


def _host_copy(x: Any) -> Any:
    """A copy that lives on no device: init_state places it on the cell's mesh (a device-0 array placed there may be
    aliased and donated by the first step, and SDP's init_state refuses arrays committed to device 0)."""
    if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        return jax.random.wrap_key_data(np.asarray(jax.random.key_data(x)), impl=jax.random.key_impl(x))
    return np.array(x) if isinstance(x, jax.Array) else x


_MODELS: dict[Family, Any] = {}


def train(fam: Family, mesh: Any, strategy: Any) -> dict[str, Any]:
    """STEPS steps of fp32 SGD from seed 0: losses, parameters and model state (BatchNorm statistics) as numpy."""
    batch = fam.batch()
    if fam.tokens:
        batch = sk.attention.layout_batch(batch, *sk.kernels.batch_layout(sk.strategy(strategy), mesh))
    model = one_device_model(fam)  # the same initial values on every mesh; init_state places them on it
    step = sk.make_train_step(model, optax.sgd(0.1, momentum=0.9), mesh, strategy, loss_fn=fam.loss_fn,
                              batch_axes=fam.batch_axes)  # fmt: skip
    state, losses = step.init_state(), []
    for _ in range(STEPS):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    full = step.full_params(state)[0] if hasattr(step, "full_params") else state.params
    as_np = lambda tree: jax.tree.map(np.asarray, tree)
    return {"losses": np.array(losses), "params": as_np(full), "stats": as_np(getattr(state, "model_state", {}))}


def reference(name: str) -> dict[str, Any]:
    return train(family(name), sk.make_mesh("data=1", jax.devices()[:1]), "dp")


def run_cell(strategy: str, fam_name: str) -> tuple[str, Any]:
    """("refused", message) if shardkit raises a ShardkitError, else ("trained", result)."""
    try:
        return "trained", train(family(fam_name), mesh_for(strategy), strategy_for(strategy))
    except sk.ShardkitError as e:
        return "refused", str(e)


def worst_gap(got: dict[str, Any], want: dict[str, Any]) -> float:
    """Max relative difference: losses elementwise, every array relative to its own scale."""
    worst = float(np.max(np.abs(got["losses"] - want["losses"]) / np.abs(want["losses"])))
    for part in ("params", "stats"):
        for a, b in zip(jax.tree.leaves(got[part]), jax.tree.leaves(want[part]), strict=True):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            worst = max(worst, float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12)))
    return worst


# ------------------------------------------------------------------------------------------ expected outcomes
PARITY = "✓"
#: (strategy, family) -> a short refusal reason (README's cell) and a regex its ShardkitError must match;
#: every other cell trains at parity.
REFUSED: dict[tuple[str, str], tuple[str, str]] = {}


def _refuse(strategies: str, families: str, reason: str, pattern: str) -> None:
    REFUSED.update({(s, f): (reason, pattern) for s in strategies.split() for f in families.split()})


def _unused(axis: str, strategies: str, families: str) -> None:
    """The model names no dimension that `axis` shards (TrainStep's check: each device would repeat the others)."""
    _refuse(strategies, families, f"nothing on `{axis}`", rf"shards mesh axis '{axis}' .* name none of them")


_CP = "cp_ring cp_zigzag cp_striped cp_ulysses fsdp_cp_zigzag cp_zigzag_tp"
_unused("tensor", "tp_channels", "gpt moe guide")
_unused("space", "spatial spatial_dp spatial_halo spatial_dp_halo", "gpt moe guide resnet")
_unused("seq", _CP, "guide resnet cosmoflow unet3d")
_unused("seq_u", "cp_usp", "guide resnet cosmoflow unet3d")
_unused("stage", "pp pp_dp pp_fsdp pp_tp", "guide resnet cosmoflow unet3d")  # ResNet: 1 block a stage, no stack
_unused("tensor", "tp tp_sp fsdp_tp dp_fsdp_tp ep_tp", "resnet cosmoflow unet3d")
_unused("row", "tp3d", "resnet cosmoflow unet3d")
_refuse("pp pp_dp pp_fsdp pp_tp", "moe", "router losses in the stack", r"pipeline kernels pass one activation")
_refuse(
    "cp_zigzag cp_striped cp_usp fsdp_cp_zigzag cp_zigzag_tp",
    "moe",
    "capacity drops in reordered tokens",
    r"which ones depends on their order in the sequence",
)
_refuse("sdp", "guide resnet cosmoflow unet3d", "no `layers` stack", r"no parameter has the logical name 'layers'")


@pytest.fixture(scope="module")
def references() -> dict[str, Any]:
    """One-device runs, filled by the first parity cell of each family (one dict per test file)."""
    return {}


def cell_test(families: tuple[str, ...]) -> Callable[..., None]:
    """The parametrised test of one matrix file (the matrix is split over files so both xdist workers share it):
    every (strategy, family) cell checked once. The file also imports `references`."""

    @pytest.mark.parametrize("family", families)
    @pytest.mark.parametrize("strategy", list(MESH))
    def test_cell(strategy: str, family: str, references: dict[str, Any]) -> None:
        check(strategy, family, references)

    return test_cell


def check(strategy: str, fam_name: str, references: dict[str, Any]) -> None:
    """One cell: the expected refusal (its reason's regex), or 2 steps within RTOL of one device."""
    kind, out = run_cell(strategy, fam_name)
    if (strategy, fam_name) in REFUSED:
        reason, pattern = REFUSED[strategy, fam_name]
        assert kind == "refused", f"{strategy} x {fam_name} trained; README says refused ({reason})"
        assert re.search(pattern, out), f"{strategy} x {fam_name}: refused with {out!r}, not /{pattern}/"
        return
    assert kind == "trained", f"{strategy} x {fam_name} was refused: {out}"
    if fam_name not in references:
        references[fam_name] = reference(fam_name)
    gap = worst_gap(out, references[fam_name])
    assert gap <= RTOL, f"{strategy} x {fam_name}: {gap:.3g} off one device (> {RTOL})"


EXPECTED = {(s, f): REFUSED.get((s, f), (PARITY, ""))[0] for s in MESH for f in FAMILIES}

START, END = "<!-- matrix:start -->", "<!-- matrix:end -->"
TITLES = {"gpt": "GPT", "moe": "MoE GPT", "guide": "Flax-guide LM", "resnet": "ResNet", "cosmoflow": "CosmoFlow",
          "unet3d": "3D U-Net"}  # fmt: skip


def table() -> str:
    """README's block: rows strategies, columns families; ✓ = 2 steps at parity with one device."""
    lines = [START, "", "| strategy | " + " | ".join(TITLES[f] for f in FAMILIES) + " |",
             "|---|" + "---|" * len(FAMILIES)]  # fmt: skip
    lines += [f"| `{s}` | " + " | ".join(EXPECTED[s, f] for f in FAMILIES) + " |" for s in MESH]
    lines += ["", "✓: 2 fp32 SGD steps equal one device (rtol 1e-5). Otherwise refused before compiling, with a",
              "`ShardkitError` saying why. *nothing on `x`*: the model's parameters and batch name no dimension that",
              "mesh axis `x` shards, so its devices would only repeat each other's work. Generated by",
              "`python tests/matrix.py` from its expected outcomes, which tests/test_matrix_lm.py and",
              "tests/test_matrix_vision.py check cell by cell (each on the mesh in tests/matrix.py's `MESH`).",
              "", END]  # fmt: skip
    return "\n".join(lines)


README = Path(__file__).resolve().parent.parent / "README.md"


def readme_block(text: str) -> str:
    m = re.search(re.escape(START) + ".*?" + re.escape(END), text, re.S)
    return m.group(0) if m else ""


if __name__ == "__main__":
    text = README.read_text()
    if not readme_block(text):
        sys.exit(f"{README}: no {START} ... {END} block")
    README.write_text(text.replace(readme_block(text), table()))
    print(f"wrote the {len(MESH)} x {len(FAMILIES)} matrix into {README}")
