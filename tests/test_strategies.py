"""Strategies as data: the PartitionSpec of every parameter and optimizer-state leaf, and the errors."""

import jax
import optax
import pytest
from common import TINY
from jax.sharding import PartitionSpec as P

import shardkit as sk
from models.gpt import GPT, GPTConfig

# parameter -> expected spec per strategy (the leading None of blocks/* is the `layers` dimension)
TP = {
    "embed": P("tensor"),
    "head": P(None, "tensor"),
    "final_norm": P(),
    "blocks/attn_norm": P(),
    "blocks/mlp_norm": P(),
    "blocks/wqkv": P(None, None, "tensor"),
    "blocks/wo": P(None, "tensor"),
    "blocks/w_gate_up": P(None, None, None, "tensor"),
    "blocks/w_down": P(None, "tensor"),
}
FSDP = {
    "embed": P(None, "fsdp"),
    "head": P("fsdp"),
    "final_norm": P("fsdp"),
    "blocks/attn_norm": P(None, "fsdp"),
    "blocks/mlp_norm": P(None, "fsdp"),
    "blocks/wqkv": P(None, "fsdp"),
    "blocks/wo": P(None, None, None, "fsdp"),
    "blocks/w_gate_up": P(None, "fsdp"),
    "blocks/w_down": P(None, None, "fsdp"),
}
FSDP_TP = {
    "embed": P("tensor", "fsdp"),
    "head": P("fsdp", "tensor"),
    "final_norm": P("fsdp"),
    "blocks/attn_norm": P(None, "fsdp"),
    "blocks/mlp_norm": P(None, "fsdp"),
    "blocks/wqkv": P(None, "fsdp", "tensor"),
    "blocks/wo": P(None, "tensor", None, "fsdp"),
    "blocks/w_gate_up": P(None, "fsdp", None, "tensor"),
    "blocks/w_down": P(None, "tensor", "fsdp"),
}
REPLICATED = dict.fromkeys(TP, P())
ZERO1_OPT = {k: P(*["data" if a == "fsdp" else a for a in v]) for k, v in FSDP.items()}

CASES = {
    "dp": ("data=8", REPLICATED, REPLICATED),
    "zero1": ("data=8", REPLICATED, ZERO1_OPT),
    "fsdp": ("data=2,fsdp=4", FSDP, FSDP),
    "tp": ("data=4,tensor=2", TP, TP),
    "tp_sp": ("data=4,tensor=2", TP, TP),
    "fsdp_tp": ("fsdp=4,tensor=2", FSDP_TP, FSDP_TP),
    "dp_fsdp_tp": ("data=2,fsdp=2,tensor=2", FSDP_TP, FSDP_TP),
}


def specs(tree):
    """{'blocks/wqkv': PartitionSpec(...), ...} for a tree of sharded arrays."""
    leaves = jax.tree_util.tree_leaves_with_path(tree)
    return {"/".join(str(getattr(k, "key", k)) for k in path): x.sharding.spec for path, x in leaves}


@pytest.mark.parametrize("name", list(CASES))
def test_parameter_and_optimizer_state_specs(name):
    spec, params_expected, opt_expected = CASES[name]
    mesh = sk.make_mesh(spec)
    model = sk.sharded_init(lambda rngs: GPT(TINY, rngs=rngs), mesh, name)
    step = sk.make_train_step(model, optax.adamw(1e-3), mesh, name)
    state = step.init_state()
    assert specs(state.params) == params_expected
    adam = state.opt_state[0]  # adamw = chain(scale_by_adam, ...): mu and nu follow the optimizer-state rules
    assert specs(adam.mu) == opt_expected and specs(adam.nu) == opt_expected
    assert state.opt_state[0].count.sharding.spec == P()


def test_zero1_stores_one_eighth_of_the_optimizer_state_per_device():
    mesh = sk.make_mesh("data=8")
    model = sk.sharded_init(lambda rngs: GPT(TINY, rngs=rngs), mesh, "zero1")
    state = sk.make_train_step(model, optax.adamw(1e-3), mesh, "zero1").init_state()
    per_device = lambda tree: sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(tree))
    assert per_device(state.params) == 4 * TINY.num_params()
    assert per_device(state.opt_state[0].mu) * 8 == 4 * TINY.num_params()


def test_user_defined_strategy_in_a_few_lines():
    fsdp = sk.strategy("fsdp")
    mine = fsdp.replace(name="fsdp_mlp", param_rules={**fsdp.param_rules, "embed": None, "mlp": "fsdp"})
    mesh = sk.make_mesh("fsdp=8")
    # embed is replicated now, so norms and attention weights are too: the mlp weights carry the sharding
    model = sk.sharded_init(lambda rngs: GPT(TINY, rngs=rngs), mesh, mine)
    assert model.blocks.w_down[...].sharding.spec == P(None, "fsdp")
    assert model.blocks.wqkv[...].sharding.spec == P()


@pytest.mark.parametrize(
    ("spec", "strategy", "cfg", "message"),
    [
        # heads=6 over tensor=4: the path, the shape and the axis are named
        (
            "data=2,tensor=4",
            "tp",
            GPTConfig(num_layers=1, d_model=48, num_heads=6, num_kv_heads=6, head_dim=8, mlp_dim=64, vocab_size=128),
            r"parameter 'blocks/wo' of shape \(1, 6, 8, 48\): dimension 1 \('heads' = 6\) is not divisible "
            r"by mesh axes \('tensor',\) of size 4; .* or a rule 'heads': None to replicate it",
        ),
        ("data=2,fsdp=4", "tp", TINY, r"strategy 'tp' does not use mesh axis 'fsdp' \(size 4\)"),
        ("data=8", "fsdp", TINY, r"this strategy needs mesh axes \['fsdp'\] but the mesh has \{'data': 8\}"),
        ("data=2,fsdp=2,tensor=2", "fsdp_nonexistent", TINY, r"unknown strategy 'fsdp_nonexistent'.*; available: dp"),
    ],
)
def test_bad_plans_raise_before_xla(spec, strategy, cfg, message):
    with pytest.raises(sk.ShardkitError, match=message):
        sk.sharded_init(lambda rngs: GPT(cfg, rngs=rngs), sk.make_mesh(spec), strategy)


def test_logical_name_without_rule_is_an_error_not_a_silent_replication():
    fsdp = sk.strategy("fsdp")
    rules = {k: v for k, v in fsdp.param_rules.items() if k != "mlp"}
    with pytest.raises(sk.ShardkitError, match=r"'blocks/w_down': logical axis 'mlp' has no rule"):
        sk.sharded_init(lambda rngs: GPT(TINY, rngs=rngs), sk.make_mesh("fsdp=8"), fsdp.replace(param_rules=rules))


def test_rule_naming_a_mesh_axis_twice_in_one_array_is_refused():
    mesh = sk.make_mesh("fsdp=8")
    with pytest.raises(sk.ShardkitError, match=r"mesh axis 'fsdp' would shard both 'embed' and 'mlp'"):
        sk.logical_to_spec(("embed", "mlp"), {"embed": ("fsdp",), "mlp": ("fsdp",)}, mesh, (64, 128))


def test_rule_naming_a_mesh_axis_the_mesh_lacks():
    mesh = sk.make_mesh("fsdp=8")
    with pytest.raises(sk.ShardkitError, match=r"maps to mesh axis 'tensor', which the mesh \{'fsdp': 8\} lacks"):
        sk.logical_to_spec(("mlp",), {"mlp": ("tensor",)}, mesh, (128,))
