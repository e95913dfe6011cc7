"""One way in: the step a strategy names is looked up in a registry, and cost predictions follow the tables.

No compile here: these check the dispatch and the predictions' inputs, which the parity and explain tests then
exercise end to end.
"""

import ast
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from common import TINY

import shardkit as sk
from models.cosmoflow import CosmoFlowConfig
from models.gpt import GPT, GPTConfig


def test_make_train_step_runs_the_step_the_strategy_names():
    @sk.register_step("toy_registry_check")
    class Toy(sk.TrainStep):
        def step_fn(self, state, batch):  # never traced here
            raise AssertionError

    try:
        mesh = sk.make_mesh("data=8")
        model = sk.abstract_model(lambda rngs: GPT(TINY, rngs=rngs))
        step = sk.make_train_step(model, optax.sgd(0.1), mesh, sk.strategy("dp").replace(step="toy_registry_check"))
        assert type(step) is Toy and step.strategy.step == "toy_registry_check"
        assert type(sk.make_train_step(model, optax.sgd(0.1), mesh, "dp")).__name__ == "GSPMDStep"
        with pytest.raises(sk.ShardkitError, match="not registered"):
            sk.make_train_step(model, optax.sgd(0.1), mesh, sk.strategy("dp").replace(step="nope"))
    finally:
        sk.dispatch.STEPS.pop("toy_registry_check")


def test_configure_applies_the_sections_named_after_the_step_and_kernels():
    pp = sk.configure("pp", {"pipeline": {"schedule": "1f1b", "microbatches": 8, "virtual_stages": 0}}, devices=8)
    assert pp.kernels["layers"] == "pipeline:1f1b:8"
    sdp = sk.configure("sdp", {"sdp": {"coverage": 0.25}}, devices=8)
    assert sdp.step == "sdp" and sdp.options.coverage == 0.25
    assert sk.configure("fsdp", {"sdp": {"coverage": 0.25}}, devices=8) == sk.strategy("fsdp")  # not its step


@pytest.mark.parametrize(
    ("name", "cfg", "mesh", "shapes"),
    [
        ("fsdp_tp", TINY, {"data": 2, "fsdp": 2, "tensor": 2}, {"inputs": (16, 32)}),
        ("tp3d", TINY, {"data": 2, "row": 2, "col": 2}, {"inputs": (16, 32)}),
        ("zero1", TINY, {"data": 8}, {"inputs": (16, 32)}),
        ("spatial_dp_halo", CosmoFlowConfig(size=32, widths=(4, 8, 8, 8, 8), dense=(16,), spatial_blocks=3),
         {"data": 2, "space": 4}, {"volume": (8,)}),
    ],
)  # fmt: skip
def test_a_copy_under_a_new_name_gets_the_originals_prediction(name, cfg, mesh, shapes):
    copy = sk.strategy(name).replace(name=f"my_{name}_copy")
    original = sk.costmodel.for_config(cfg).predict(sk.strategy(name), mesh, shapes, 4, "cpu")
    assert original is not None
    got = sk.costmodel.for_config(cfg).predict(copy, mesh, shapes, 4, "cpu")
    assert got[0] == original[0] and got[1] == original[1]  # comms rows and memory terms equal
    assert sk.Traits.of(copy) == sk.Traits.of(name)


def test_a_copy_of_cp_zigzag_gets_the_originals_explain_prediction():
    # the GPT's formulas do not cover context parallelism: explain predicts its rows from the rules tables, which a
    # copy under a new name shares (one compile each; TINY at 32 tokens over a ring of 4)
    mesh = sk.make_mesh("data=2,seq=4")
    reports = []
    for s in (sk.strategy("cp_zigzag"), sk.strategy("cp_zigzag").replace(name="my_ring_copy")):
        step = sk.make_train_step(sk.abstract_model(lambda rngs: GPT(TINY, rngs=rngs)), optax.sgd(0.1), mesh, s)
        tokens = jax.ShapeDtypeStruct((16, 32), jnp.int32, sharding=step.batch_sharding)
        reports.append(sk.explain(step, step.abstract_state(), {"inputs": tokens, "targets": tokens}))
    original, copy = reports
    assert original.predicted_comms and copy.predicted_comms == original.predicted_comms
    assert copy.predicted_memory == original.predicted_memory and copy.collectives == original.collectives


def test_a_strategy_the_formulas_do_not_describe_gets_none_whatever_its_name():
    # the GPT's tp formula under the name of a CNN strategy that splits channels: not Megatron, so no formula
    channels, gpt = sk.strategy("tp_channels").replace(name="tp"), sk.costmodel.for_config(TINY)
    assert gpt.predict(channels, {"data": 4, "tensor": 2}, {"inputs": (16, 32)}, 4, "cpu") is None
    assert sk.Traits.of("fsdp").reduce_scatters and not sk.Traits.of("dp").reduce_scatters


def test_a_cost_model_is_found_by_the_configs_type_and_a_config_with_the_old_hooks_still_plans():
    gpt = sk.costmodel.for_config(TINY)  # registered beside the model (models/gpt_cost/model.py)
    assert type(gpt).__name__ == "GPTCostModel" and gpt.cfg is TINY and sk.costmodel.for_config(gpt) is gpt
    assert sk.costmodel.for_config(object()) is None and sk.costmodel.for_config(None) is None

    @dataclasses.dataclass(frozen=True)
    class MyGPTConfig(GPTConfig):  # a subclass without a cost model of its own: its base's
        pass

    assert type(sk.costmodel.for_config(MyGPTConfig(**dataclasses.asdict(TINY)))) is type(gpt)

    class Toy:
        pass

    @sk.costmodel.register(Toy)
    class ToyCost(sk.costmodel.CostModel):
        plan_strategies = ("dp",)

        def predict(self, strategy, mesh, batch_shapes, nbytes, backend):
            b = sk.costmodel.CommBuilder(mesh, ("data",), backend)
            b.add("all-reduce", "data", 1e6, 1, "gradients")
            return b.comms(), {"params": 1.0, "grads": 1.0, "optimizer": 2.0, "activations": 0.0, "total": 4.0}, "toy"

    try:
        (only,) = sk.plan(Toy(), devices=8, hardware="perlmutter", global_batch=8)
        assert (only.strategy, only.mesh, only.remat) == ("dp", {"data": 8}, "none")  # not models_remat: "none" only
        assert only.comm_bytes == pytest.approx(2 * 7 / 8 * 1e6)  # the ring all-reduce of 1 MB over 8
    finally:
        sk.costmodel.protocol._REGISTRY.pop(Toy)
    with pytest.raises(sk.ShardkitError, match=r"not a sk\.costmodel\.CostModel"):
        sk.costmodel.register(Toy)(object)

    class OldHooks:  # the protocol before CostModel: the hooks on the config itself (deprecated, one release)
        cost_model = lambda self, *args: gpt.predict(*args)
        indivisible = lambda self, *args: gpt.indivisible(*args)

    args = dict(devices=8, hardware="perlmutter", global_batch=16, seq_len=32, remat=None, include_rejected=True)
    with pytest.warns(DeprecationWarning, match=r"register a sk\.costmodel\.CostModel"):
        old = sk.plan(OldHooks(), **args)
    assert old == sk.plan(TINY, **args) and len(old) > 5


def test_traits_read_in_one_direction_and_strategy_traits_is_deprecated():
    with pytest.warns(DeprecationWarning, match=r"sk\.Traits\.of\(strategy\)"):
        assert sk.strategy("tp").traits() == sk.Traits.of("tp") == sk.Traits.of(sk.strategy("tp"))
    # a model never imports its cost model (the cost model imports the model; models/__init__.py imports both)
    root = Path(__file__).resolve().parent.parent / "models"
    for path in root.glob("*.py"):
        if path.stem.endswith("_cost") or path.stem == "__init__":
            continue
        names = [n.module or "" for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)]
        names += [a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Import) for a in n.names]
        assert not [n for n in names if "_cost" in n or "costmodel" in n], path


# ------------------------------------------------------------------------------------------------------------
# Enforced layers. The core (every module of shardkit/ outside parallel/ and attention/) never imports a
# parallelism or an attention kernel: those import the core and register themselves (strategies, steps,
# kernels, plan hooks), and only the package's __init__ imports them, so that `import shardkit` registers them.
# No import cycle (lazy imports inside functions included: a lazy import that closes a cycle hides it) and no
# import below code (E402) anywhere in shardkit/.

PLUGINS = ("shardkit.parallel", "shardkit.attention")


def _modules(root: Path) -> dict[str, str]:
    """{dotted module name: source} of every .py file of the package at `root`."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return out


def _is_package(name: str, sources: dict[str, str]) -> bool:
    return any(m.startswith(name + ".") for m in sources)


def _imports(name: str, source: str, sources: dict[str, str]) -> list[tuple[str, int, bool]]:
    """(imported shardkit module, line, at module level) for every import in `source`; `from pkg import x` names
    the submodule pkg.x where there is one. Imports under `if TYPE_CHECKING:` do not run and are left out."""
    package = name if _is_package(name, sources) else name.rpartition(".")[0]
    tree = ast.parse(source)
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}  # fmt: skip
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in sources else base for a in node.names]
        else:
            continue
        out += [(t, node.lineno, id(node) in top) for t in targets if t.split(".")[0] == "shardkit"]
    return out


def layering_problems(sources: dict[str, str]) -> list[str]:
    """Every breach of the layers above, one line each (empty: the layers hold)."""
    problems = []
    graph: dict[str, set[str]] = {m: set() for m in sources}
    for name, source in sources.items():
        core = name != "shardkit" and not name.startswith(PLUGINS)
        for target, line, _ in _imports(name, source, sources):
            graph[name].add(target)
            if core and target.startswith(PLUGINS):
                problems.append(f"{name}:{line} (core) imports {target}")
        tree = ast.parse(source)
        code_seen = False
        for node in tree.body:
            is_doc = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and node is tree.body[0]
            if isinstance(node, ast.Import | ast.ImportFrom):
                if code_seen:
                    problems.append(f"{name}:{node.lineno} imports below code (E402)")
            elif not (is_doc or isinstance(node, ast.If | ast.Try)):
                code_seen = True
        if "noqa: E402" in source:
            problems.append(f"{name}: silences E402")
    # cycles: depth-first search over the import graph
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1 and t != m:
                problems.append("import cycle: " + " -> ".join([*path[path.index(t) :], t]))
            elif t in graph and not state.get(t):
                visit(t, [*path, t])
        state[m] = 2

    for m in sorted(graph):
        if not state.get(m):
            visit(m, [m])
    return problems


def test_the_core_imports_no_parallelism_and_nothing_imports_in_a_cycle():
    sources = _modules(Path(sk.__file__).parent)
    assert len(sources) > 30 and "shardkit.parallel.spatial" in sources and "shardkit.step" in sources
    assert layering_problems(sources) == []


def test_the_layering_check_catches_a_bad_import_a_cycle_and_e402():
    sources = _modules(Path(sk.__file__).parent)
    bad = {
        **sources,
        "shardkit.bad": '"""A core module."""\nimport math\n\ndef f():\n    from shardkit.parallel import spatial\n',
        "shardkit.late": '"""Doc."""\nX = 1\nimport shardkit.errors\n',
        "shardkit.cyc_a": "from shardkit import cyc_b\n",
        "shardkit.cyc_b": "def g():\n    from . import cyc_a\n",
    }
    found = layering_problems(bad)
    assert "shardkit.bad:5 (core) imports shardkit.parallel.spatial" in found
    assert "shardkit.late:3 imports below code (E402)" in found
    assert "import cycle: shardkit.cyc_a -> shardkit.cyc_b -> shardkit.cyc_a" in found
    assert len(found) == 3, found


# ------------------------------------------------------------------------------------------------------------
# One resolution: the command line's strategy name is looked up once and bound once; what is below takes the object.


def test_make_train_step_and_the_step_share_one_signature():
    import inspect

    ours = list(inspect.signature(sk.make_train_step).parameters.values())
    step = list(inspect.signature(sk.TrainStep.__init__).parameters.values())[1:]  # without self
    assert [(p.name, p.kind, p.default) for p in ours] == [(p.name, p.kind, p.default) for p in step]


def test_the_cli_looks_the_strategy_up_once_and_binds_it_once(tmp_path, monkeypatch):
    from test_experiments import make_config

    from experiments import train as tr
    from shardkit import strategies

    lookups, binds = [], []
    resolve, bind = strategies._resolve, strategies.Strategy.bind
    monkeypatch.setattr(strategies, "_resolve", lambda s: lookups.append(s) or resolve(s))
    monkeypatch.setattr(strategies.Strategy, "bind", lambda self, mesh: binds.append(self.name) or bind(self, mesh))
    run = tr.build(make_config(tmp_path, "once", strategy="fsdp_tp", mesh="data=2,fsdp=2,tensor=2"))
    assert [s for s in lookups if isinstance(s, str)] == ["fsdp_tp"]  # objects pass through, no second look-up
    assert binds == ["fsdp_tp"] and run.step.bound.mesh is run.mesh

    lookups.clear(), binds.clear()  # a BoundStrategy given to make_train_step / sharded_init is taken as it is
    bound = run.step.bound
    model = sk.abstract_model(lambda rngs: GPT(TINY, rngs=rngs))
    step = sk.make_train_step(model, optax.sgd(0.1), bound.mesh, bound)
    assert step.bound is bound and binds == [] and not [s for s in lookups if isinstance(s, str)]


def test_every_public_name_is_documented_in_api_md():
    text = (Path(__file__).resolve().parent.parent / "docs" / "api.md").read_text()
    missing = [n for n in sk.__all__ if f"sk.{n}" not in text]
    assert missing == [], f"docs/api.md lists no `sk.<name>` line for {missing}"
    # namespaces only: no module listed beside the functions it holds (dispatch, step, targets, train, checkpoint)
    modules = {n for n in sk.__all__ if isinstance(getattr(sk, n), type(sk))}
    namespaces = "attention collectives costmodel embedding hetero hlo kernels layers moe offload pipeline sdp spatial"
    assert modules == {*namespaces.split(), "tensor3d"}


def test_old_names_keep_working_and_say_where_they_went():
    with pytest.warns(DeprecationWarning, match=r"sk.sdp.make_strategy"):
        old = sk.sdp.strategy(coverage=0.25)
    assert old == sk.sdp.make_strategy(coverage=0.25)
    with pytest.warns(DeprecationWarning, match=r"sk.hetero.make_strategy"):
        sk.hetero.strategy([2, 2, 1, 1, 1, 1, 1, 1], 1)
    with pytest.warns(DeprecationWarning, match=r"sk.cross_entropy"):
        assert sk.train.cross_entropy is sk.cross_entropy
    with pytest.warns(DeprecationWarning, match=r"sk.explain"):
        assert sk.inspect.explain is sk.explain
    assert "train" not in sk.__all__ and "dispatch" not in sk.__all__ and "hlo" in sk.__all__


def test_an_unnamed_model_under_tp_is_told_to_name_its_parameters_by_path_and_the_advice_works():
    """A model whose parameters carry no names (a library model: gemma's Linen transformer, here two nnx.Linear)
    under tp: `tensor` would shard nothing. The refusal's remedy is path rules built from the model's own parameter
    paths (batch_axes names batch dimensions, which would not help), and the rules it prints make the step build."""
    import re as regex

    from flax import nnx

    class Plain(nnx.Module):
        def __init__(self, rngs):
            self.up, self.down = nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 16, rngs=rngs)

        def __call__(self, x):
            return self.down(jax.nn.relu(self.up(x)))

    mesh = sk.make_mesh("data=2,tensor=4")
    model = sk.abstract_model(Plain)
    loss = lambda m, b: (m(b["x"]) ** 2).mean()
    with pytest.raises(sk.ShardkitError, match=r"path_rules=\[") as refused:
        sk.make_train_step(model, optax.sgd(0.1), mesh, "tp", loss_fn=loss)
    message = str(refused.value)
    assert "batch_axes" not in message and "up/kernel" in message and "down/kernel" in message
    advice = regex.search(r"(sk\.strategy\(.*?\)\.extend\(path_rules=\[.*?)(, \.\.\.\])", message)
    strategy = eval(advice.group(1) + "])", {"sk": sk})  # the printed rules, as a user would paste them
    step = sk.make_train_step(model, optax.sgd(0.1), mesh, strategy, loss_fn=loss)
    assert step.param_shardings["up"]["kernel"].spec[-1] == "tensor"
