"""Misuse, corruption and environment faults (issue #15): refused up front with a ShardkitError, or ended with one
`error:` line naming what is safe, instead of a crash, a traceback or silent wrong training."""

import math
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from common import TINY, make_batch
from flax import nnx

import shardkit as sk
from experiments import train as tr
from experiments.configs import base
from models.gpt import GPT
from shardkit.init import split_params


@pytest.fixture(scope="module")
def run():
    mesh = sk.make_mesh("data=2,fsdp=4")
    model = sk.sharded_init(lambda rngs: GPT(TINY, rngs=rngs), mesh, "fsdp")
    return mesh, model, sk.make_train_step(model, optax.sgd(0.1), mesh, "fsdp")


def test_the_state_never_aliases_the_model_and_a_consumed_state_is_an_error(run):
    """A step donates the state it is given. The model's own arrays must survive it, a second init_state must give
    live arrays, and reusing a consumed state must be a ShardkitError — it used to kill the process (exit 139)."""
    _, model, step = run
    before = jax.tree.map(np.asarray, nnx.to_pure_dict(split_params(model)[1]))
    state = step.init_state()
    new, _ = step(state, make_batch())
    after = jax.tree.map(np.asarray, nnx.to_pure_dict(split_params(model)[1]))
    jax.tree.map(np.testing.assert_array_equal, after, before)  # the model is untouched, and readable
    with pytest.raises(sk.ShardkitError, match=r"TrainState holds deleted arrays: a train step donates"):
        step(state, make_batch())
    again = step.init_state()  # a fresh state from the (intact) model
    step(again, make_batch())
    assert not any(x.is_deleted() for x in jax.tree.leaves(new))


def test_a_model_from_one_device_survives_the_steps_on_eight():
    """A model initialised on one device, trained on 8: init_state moves it onto the mesh, and the first step's
    donation used to delete the model's own arrays (device_put(may_alias=False) kept device 0's buffer)."""
    model = sk.sharded_init(lambda rngs: GPT(TINY, rngs=rngs), sk.make_mesh("data=1", jax.devices()[:1]), "dp")
    mesh = sk.make_mesh("data=8")
    step = sk.make_train_step(model, optax.sgd(0.1), mesh, "dp")
    step(step.init_state(), make_batch())
    assert not any(x.is_deleted() for x in jax.tree.leaves(nnx.to_pure_dict(split_params(model)[1])))


def test_a_batch_anywhere_is_placed_on_the_mesh(run):
    """numpy, or an array committed to one device: moved to the rules' layout instead of an XLA error."""
    _, _, step = run
    batch = make_batch()
    on_one = jax.device_put(batch, jax.devices()[3])
    as_numpy = jax.tree.map(np.asarray, batch)
    losses = [float(step(step.init_state(), b)[1]["loss"]) for b in (batch, on_one, as_numpy)]
    assert losses[0] == losses[1] == losses[2]


def test_batch_entries_that_disagree_are_refused(run):
    _, _, step = run
    batch = make_batch()
    batch["targets"] = batch["targets"][:8]  # what the GPT's loss reads: its own check names them
    with pytest.raises(sk.ShardkitError, match=r"GPT: batch entries \['inputs', 'targets'\] must have one shape"):
        step(step.init_state(), batch)
    batch = {**make_batch(), "weights": np.ones((8, 32), np.float32)}  # an entry the loss does not read
    with pytest.raises(sk.ShardkitError, match=r"disagree on the number of examples: batch\['inputs'\] has 16"):
        step(step.init_state(), batch)
    with pytest.raises(sk.ShardkitError, match=r"batch\['extra'\] is int 3: every batch entry must be an array"):
        step(step.init_state(), {**make_batch(), "extra": 3})


def test_a_rule_naming_a_mesh_axis_that_does_not_exist_is_refused():
    tp = sk.strategy("tp")
    typo = tp.replace(name="tp_typo", compute_rules={**tp.compute_rules, "heads": "tensr"})
    with pytest.raises(sk.ShardkitError, match=r"compute_rules\['heads'\] names mesh axis 'tensr'"):
        typo.bind(sk.make_mesh("data=4,tensor=2"))
    tp.bind(sk.make_mesh("tensor=8"))  # a known axis the mesh lacks (data) is still dropped


@pytest.mark.parametrize(
    ("key", "value"),
    [("lr", -3e-3), ("lr", math.nan), ("lr", 0.0), ("grad_clip", -1.0), ("weight_decay", -0.1), ("b2", 1.0)],
)
def test_optimizer_settings_that_would_train_wrong_are_refused(key, value):
    opt = base.get_config().optimizer
    opt[key] = value
    with pytest.raises(sk.ShardkitError, match=rf"optimizer.{key}={value} must be finite"):
        tr.make_optimizer(opt, 100)


def test_the_step_refuses_the_state_of_another_model(run):
    """jit would retrace for the other shapes and silently train a model of another width."""
    mesh, _, step = run
    other = sk.make_train_step(
        sk.sharded_init(lambda rngs: GPT(TINY.__class__(**{**TINY.__dict__, "d_model": 32}), rngs=rngs), mesh, "fsdp"),
        optax.sgd(0.1),
        mesh,
        "fsdp",
    )
    message = r"\['blocks'\]\['attn_norm'\] is \(\(2, 32\), 'float32'\), the step's model has \(\(2, 64\)"
    with pytest.raises(sk.ShardkitError, match=message):
        step(other.init_state(), make_batch())
    assert jnp.isfinite(step(step.init_state(), make_batch())[1]["loss"])


def test_one_trainer_per_run_directory(tmp_path):
    """A second trainer on a live run is refused (naming the holder) before it touches the run's metrics or its
    in-flight checkpoints; a lock file left by a killed run (its flock died with it) is taken over."""
    from test_experiments import make_config

    from experiments.runtime import RunLock

    config = make_config(tmp_path, "locked", steps=2, eval_every=0, ckpt_every=0)
    run_dir = tmp_path / "runs" / "locked"
    (run_dir / "checkpoints" / "7.orbax-checkpoint-tmp").mkdir(parents=True)  # the live run's unfinished save
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {k}, "loss": 1.0}}\n' for k in range(1, 41)))
    with RunLock(run_dir), pytest.raises(sk.ShardkitError, match=r"is being trained by pid \d+ on host .*: one"):
        tr.train(config)
    assert (run_dir / "checkpoints" / "7.orbax-checkpoint-tmp").is_dir()  # untouched
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 40
    (run_dir / "lock").write_text("pid 999999 on host gone\n")  # stale: nobody holds the flock
    assert tr.train(config)["step"] == 2
    assert f"pid {__import__('os').getpid()}" in (run_dir / "lock").read_text()


# ------------------------------------------------------------------------------------------ damaged checkpoints
def _files(step_dir):
    return sorted((p for p in step_dir.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)


@pytest.fixture
def saved(tmp_path, run):
    """Steps 1 and 2 of a tiny GPT under fsdp, checkpointed; returns (directory, step, state 1, state 2)."""
    _, _, step = run
    s1, _ = step(step.init_state(), make_batch())
    s2, _ = step(jax.tree.map(jnp.copy, s1), make_batch())
    with sk.Checkpointer(tmp_path / "ckpt") as ckpt:
        ckpt.save(s1)
        ckpt.save(s2)
    return tmp_path / "ckpt", step, s1, s2


def _flip_a_byte(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


# orbax's reads of a damaged step leave coroutines that fail when collected (its own "Exception ignored in"), at a
# time that depends on which tests shared the process: they are orbax's, not the restore's result, which is asserted
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("damage", ["flip", "truncate", "metadata"])
def test_a_damaged_latest_step_is_set_aside_and_the_previous_one_restored(saved, damage):
    directory, step, s1, _ = saved
    files = _files(directory / "2" / "state")
    if damage == "flip":  # every array file: wherever the flipped bit lands, the checksums or the reader see it
        for f in files:
            if "metadata" not in f.name.lower() and f.stat().st_size > 64:
                _flip_a_byte(f)
    elif damage == "truncate":
        biggest = files[-1]
        biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 3])
    else:
        for f in files:
            if "metadata" in f.name.lower():
                f.write_text("{not json")
    with sk.Checkpointer(directory) as ckpt, pytest.warns(UserWarning, match=r"restored step 1; step 2 is damaged"):
        restored, _ = ckpt.restore(step.abstract_state())
        assert ckpt.steps() == [1]
    assert int(restored.step) == int(s1.step)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, restored.params),
                 jax.tree.map(np.asarray, s1.params))  # fmt: skip
    assert (directory / "damaged" / "2").is_dir(), "the damaged step must be kept, not deleted"


def test_no_intact_step_is_an_error_listing_each_and_an_asked_for_damaged_step_is_refused(saved):
    directory, step, _, _ = saved
    for k in ("1", "2"):
        biggest = _files(directory / k / "state")[-1]
        biggest.write_bytes(b"")
    with sk.Checkpointer(directory) as ckpt, pytest.raises(sk.ShardkitError, match=r"step 1 in .* is damaged: unread"):
        ckpt.restore(step.abstract_state(), step=1)
    with (
        sk.Checkpointer(directory) as ckpt,
        pytest.raises(sk.ShardkitError, match=r"no intact checkpoint in .*step 2 is damaged .*step 1 is damaged"),
    ):
        ckpt.restore(step.abstract_state())


def test_an_empty_step_folder_is_not_a_checkpoint(saved):
    directory, step, _, s2 = saved
    (directory / "3").mkdir()
    with sk.Checkpointer(directory) as ckpt:
        restored, _ = ckpt.restore(step.abstract_state())
    assert int(restored.step) == int(s2.step)


def test_a_run_whose_latest_checkpoint_is_damaged_resumes_from_the_one_before(tmp_path):
    from test_experiments import make_config, metrics

    config = make_config(tmp_path, "damaged", steps=4, eval_every=0, ckpt_every=2, async_checkpointing=False)
    first = tr.train(config)
    want = metrics(first["run_dir"])
    step4 = Path(first["run_dir"]) / "checkpoints" / "4" / "state"
    biggest = _files(step4)[-1]
    biggest.write_bytes(biggest.read_bytes()[:10])
    again = tr.train(config)
    assert (again["start_step"], again["step"]) == (2, 4)
    got = metrics(first["run_dir"])
    np.testing.assert_allclose([got[k]["loss"] for k in (3, 4)], [want[k]["loss"] for k in (3, 4)], rtol=1e-6)
    assert (Path(first["run_dir"]) / "checkpoints" / "damaged" / "4").is_dir()


@pytest.mark.parametrize(
    ("overrides", "message"),
    [({"log_every": 0}, "log_every=0 must be >= 1"), ({"ckpt_every": -1}, "ckpt_every=-1 must be >= 0"),
     ({"seed": -3}, "seed=-3 must be >= 0"), ({"model.num_layers": 0}, "num_layers=0 must be >= 1"),
     ({"model.num_heads": 0}, "num_heads=0 must be >= 1"), ({"model.dtype": "float3"}, "dtype='float3': give a float")],
)  # fmt: skip
def test_config_values_that_crashed_mid_run_are_refused_up_front(tmp_path, overrides, message):
    from test_experiments import make_config

    with pytest.raises(sk.ShardkitError, match=re.escape(message)):
        tr.build(make_config(tmp_path, "bad", **overrides))


@pytest.mark.parametrize("name", ["../../escape", "a/b", ".."])
def test_a_run_name_cannot_escape_the_runs_folder(tmp_path, name):
    from test_experiments import make_config

    with pytest.raises(sk.ShardkitError, match=r"a run name is one folder name under run_dir"):
        tr.build(make_config(tmp_path, name))


# ------------------------------------------------------------------------------------ environment faults (item 5)
def test_a_full_disk_stops_the_run_naming_the_last_good_checkpoint(tmp_path, monkeypatch):
    """Orbax reports ENOSPC from its background thread as RESOURCE_EXHAUSTED (as on a real full tmpfs, checked by
    hand); the run must stop at once with a SaveError naming the step that is safe, not go on stepping."""
    from test_experiments import make_config, metrics

    from shardkit import checkpoint

    real = checkpoint.ocp.CheckpointManager.save

    def save(self, step, *args, **kw):
        if step >= 8:
            raise ValueError('RESOURCE_EXHAUSTED: Error writing "params.embed" ... No space left on device '
                             "[os_error_code='28']")  # fmt: skip
        return real(self, step, *args, **kw)

    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", save)
    config = make_config(tmp_path, "full", steps=16, ckpt_every=4, eval_every=0)
    with pytest.raises(checkpoint.SaveError, match=r"step 8 .* the disk is full .* last good checkpoint is step 4"):
        tr.train(config)
    assert max(metrics(tmp_path / "runs" / "full")) == 8  # stopped where the save failed
    monkeypatch.setattr(checkpoint.ocp.CheckpointManager, "save", real)
    resumed = tr.train(config)  # space freed: the same command resumes from the last good step
    assert (resumed["start_step"], resumed["step"]) == (4, 16)


def test_orbax_reports_of_a_failed_save_are_left_to_the_one_save_error():
    """On a real full disk (a 3 MB tmpfs, by hand: `mount -t tmpfs -o size=3M tmpfs /mnt/x`, then
    `python -m experiments.train --config.run_dir=/mnt/x/runs --config.ckpt_every=5`) orbax logged an ERROR line and
    a traceback from each save thread, asyncio one per unawaited write at exit, and tensorstore's callbacks one
    "Event loop is closed" traceback per pending write: 553 lines above the SaveError. Now stderr is that one line.
    Here the same records, as orbax and asyncio make them, go through the filters the Checkpointer installs."""
    import logging
    import types

    from shardkit import checkpoint

    quiet = checkpoint.QuietSaveFailures()

    def record(name, path, msg, level=logging.ERROR):
        return logging.LogRecord(name, level, path, 1, msg, None, None)

    orbax = "/venv/site-packages/orbax/checkpoint/_src/"
    signal = "[process=0] _SignalingThread.run() raised an exception: RESOURCE_EXHAUSTED"
    commit = "Failed to run 4 Handler Commit operations ... in background save thread"
    unawaited = "Task exception was never retrieved\nfuture: <Task coro=<async_serialize_from_host() at /orbax/x.py>>"
    assert not quiet.filter(record("absl", orbax + "futures/future.py", signal))
    assert not quiet.filter(record("absl", orbax + "checkpointers/async_checkpointer.py", commit))
    assert not quiet.filter(record("asyncio", "/py/asyncio/base_events.py", unawaited))
    assert quiet.filter(record("absl", orbax + "checkpoint_manager.py", "Saving checkpoint at step 5", logging.INFO))
    assert quiet.filter(record("absl", "/mine/train.py", "Failed to run ... background save thread"))  # not orbax's
    assert quiet.filter(record("asyncio", "/py/asyncio/base_events.py", "Task exception was never retrieved\nmine"))
    seen = []
    hook = checkpoint._quiet_unraisable(seen.append)

    def closed_loop():
        import asyncio

        loop = asyncio.new_event_loop()
        loop.close()
        loop.call_soon_threadsafe(print)

    for fn, swallowed in ((closed_loop, True), (lambda: 1 / 0, False)):
        try:
            fn()
        except Exception as e:
            hook(types.SimpleNamespace(exc_type=type(e), exc_value=e, exc_traceback=e.__traceback__, object=None))
            assert len(seen) == (0 if swallowed else 1)


def test_distributed_without_a_cluster_or_with_a_taken_port_is_an_error(monkeypatch):
    """Nothing JAX's detectors know: the error lists what they looked for (experiments/cluster.py)."""
    from experiments import runtime

    for var in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "SLURM_JOB_ID",
                "TPU_WORKER_HOSTNAMES", "TPU_PROCESS_ADDRESSES", "OMPI_MCA_orte_hnp_uri",
                "KUBERNETES_SERVICE_HOST"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TPU_SKIP_MDS_QUERY", "1")  # no metadata server query, whatever host runs the suite
    with pytest.raises(sk.ShardkitError, match=r"distributed=True but no cluster was found\. JAX looked for: Open "
                       r"MPI.*Slurm's srun \(SLURM_JOB_ID.*Kubernetes.*launch/.*launch_local"):  # fmt: skip
        runtime.init_distributed()
    import socket

    with socket.socket() as taken:
        taken.bind(("localhost", 0))
        taken.listen()
        port = taken.getsockname()[1]
        monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", f"localhost:{port}")
        monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
        monkeypatch.setenv("JAX_PROCESS_ID", "0")
        with pytest.raises(sk.ShardkitError, match=f"port {port} cannot be served here"):
            runtime.init_distributed()


@pytest.mark.parametrize(
    "entry,args,message",
    [
        ("train", ["--config.stpes=3"], "error: config has no field 'stpes'; Did you mean \"steps\""),
        ("train", ["--config=experiments/configs/nope.py"], "error: config file experiments/configs/nope.py: [Errno"),
        # issue #26 item 5: an explicit config file's typo used to be a three-part traceback (exit 1)
        ("train", ["--config=experiments/configs/gpt_tiny.py", "--config.stepz=3"],
         "error: config has no field 'stepz'; Did you mean \"steps\""),
        ("explain", ["--config=experiments/configs/resnet_digits.py", "--config.steps=abc"],
         "error: flag --config.steps=abc: invalid literal for int()"),
        ("train", ["--config.data.bin_dtype=uint17"], "error: data.bin_dtype='uint17': give the .bin files' integer"),
    ],
    ids=["typo", "no-file", "file-and-typo", "explain-bad-value", "bin-dtype"],
)  # fmt: skip
def test_a_misspelled_config_key_or_missing_file_is_one_error_line(entry, args, message):
    """These fail while absl parses the flags (or at the config's first use, or in the up-front checks before
    anything is built): exit 2 and one line, no traceback, whether or not --config= names a file."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-m", f"experiments.{entry}", *args], cwd=root, capture_output=True,
                         text=True, timeout=300)  # fmt: skip
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1].startswith(message) and "Traceback" not in out.stderr


def test_every_closed_set_config_field_is_checked_up_front_even_where_unused():
    from experiments import runtime

    runtime.check_choices(base.get_config())  # the defaults hold
    for field, value, message in [("pipeline.schedule", "zz", "choose one of gpipe, 1f1b, circular"),
                                  ("pipeline.stage_layers", "3,x", "give the layers of each stage as whole"),
                                  ("hetero.mode", "lop", "choose one of loop, pad"),
                                  ("sdp.reduce", "x", "choose one of auto, ring, psum"),
                                  ("model.remat", "some", "choose one of none, full, dots"),
                                  ("optimizer.name", "sgd", "choose one of adamw"),
                                  ("model.dtype", "float33", "give a float dtype"),
                                  ("model.param_dtype", "int32", "give a float dtype"),
                                  ("data.bin_dtype", "float32", "give the .bin files' integer")]:  # fmt: skip
        config = base.get_config()  # strategy fsdp: none of the pipeline / hetero / sdp sections is read
        section, key = field.split(".")
        config[section][key] = value
        with pytest.raises(sk.ShardkitError, match=rf"{field}={value!r}: {message}"):
            runtime.check_choices(config)


# ------------------------------------------------------------------------------------------ data (items 4, 8)
def test_token_ids_outside_the_vocabulary_are_refused_through_the_api(run):
    _, _, step = run
    state = step.init_state()
    for bad in (-1, TINY.vocab_size):
        batch = jax.tree.map(np.array, make_batch())  # writable host copies
        batch["targets"][3, 5] = bad
        with pytest.raises(sk.ShardkitError, match=r"batch\['targets'\] must be in \[0, vocab_size=128\)"):
            step(state, batch)


IDS, IDS3 = jax.ShapeDtypeStruct((16, 32), jnp.int32), jax.ShapeDtypeStruct((16, 32, 2), jnp.int32)


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ({"inputs": jax.ShapeDtypeStruct((16, 32), jnp.float32), "targets": IDS},
         r"GPT: batch\['inputs'\] has dtype float32; it must be an integer dtype"),
        ({"inputs": IDS}, r"GPT: the batch has no 'targets' \(keys: \['inputs'\]\); its loss reads 'inputs'"),
        ({"inputs": IDS, "targets": jax.ShapeDtypeStruct((16, 16), jnp.int32)},
         r"GPT: batch entries \['inputs', 'targets'\] must have one shape"),
        ({"inputs": IDS3, "targets": IDS3},
         r"GPT: batch\['inputs'\] has shape \(16, 32, 2\) \(3-D\); it must be 2-D"),
        ([IDS, IDS], r"GPT: the batch must be a dict with keys \['inputs', 'targets'\]"),
    ],
    ids=["float-ids", "no-targets", "targets-shape", "3d", "not-a-dict"],
)  # fmt: skip
def test_a_malformed_gpt_batch_is_one_error_before_xla(run, batch, message):
    """Issue #26 items 1-3: each used to be a raw JAX error (indices must have an integer type, KeyError, ...)."""
    _, _, step = run
    with pytest.raises(sk.ShardkitError, match=message):
        step.lower(step.abstract_state(), batch)  # abstract: the model's check needs no values, nothing compiles


def test_every_model_checks_the_batch_its_loss_reads():
    from models.cosmoflow import CosmoFlow, CosmoFlowConfig
    from models.resnet import ResNet, ResNetConfig
    from models.unet3d import UNet3D, UNet3DConfig

    f32, i32 = jnp.float32, jnp.int32
    sds = jax.ShapeDtypeStruct
    cases = [
        (lambda r: ResNet(ResNetConfig(widths=(4,), blocks=(1,)), rngs=r),
         {"image": sds((8, 8, 8, 1), i32), "label": sds((8,), i32)}, r"ResNet: batch\['image'\] has dtype int32"),
        (lambda r: ResNet(ResNetConfig(widths=(4,), blocks=(1,)), rngs=r),
         {"image": sds((8, 8, 8, 3), f32), "label": sds((8,), i32)}, r"has 3 channels; the model takes in_channels=1"),
        (lambda r: ResNet(ResNetConfig(widths=(4,), blocks=(1,)), rngs=r),
         {"image": sds((8, 8, 8, 1), f32), "label": np.full(8, 10, np.int32)}, r"must be in \[0, num_classes=10\)"),
        (lambda r: UNet3D(UNet3DConfig(widths=(4, 8)), rngs=r),
         {"volume": sds((8, 8, 8, 8, 1), f32), "label": sds((8, 8, 8, 4), i32)}, r"UNet3D: batch\['volume'\] \(8, 8"),
        (lambda r: CosmoFlow(CosmoFlowConfig(size=8, widths=(4,), dense=(8,)), rngs=r),
         {"volume": sds((8, 8, 8, 8, 1), f32)}, r"CosmoFlow: the batch has no 'target'"),
        (lambda r: CosmoFlow(CosmoFlowConfig(size=8, widths=(4,), dense=(8,)), rngs=r),
         {"volume": sds((8, 8, 8, 8, 1), f32), "target": sds((8, 3), f32)}, r"must be \[B, D, H, W, 1\] and \[B, 4\]"),
    ]  # fmt: skip
    mesh = sk.make_mesh("data=8")
    for build, batch, message in cases:
        model = sk.abstract_model(build)
        step = sk.make_train_step(model, optax.sgd(0.1), mesh, "dp", batch_axes=type(model).batch_axes)
        with pytest.raises(sk.ShardkitError, match=message):
            step.lower(step.abstract_state(), batch)


def test_a_token_file_read_with_the_wrong_width_is_refused(tmp_path):
    from experiments.data import text

    tokens = np.random.default_rng(0).integers(0, 300, 10_000)
    tokens.astype(np.uint16).tofile(tmp_path / "u16.bin")
    tokens.astype(np.uint32).tofile(tmp_path / "u32.bin")
    with pytest.raises(ValueError, match=r"likely a uint16 file .* set data\.bin_dtype=uint16"):
        text.load_dataset(tmp_path / "u16.bin", bin_dtype=np.uint32)
    with pytest.raises(ValueError, match=r"likely a uint32 file read as uint16: set data\.bin_dtype=uint32"):
        text.load_dataset(tmp_path / "u32.bin", bin_dtype=np.uint16)
    for name, dt in (("u16.bin", np.uint16), ("u32.bin", np.uint32)):  # the right widths load
        assert text.load_dataset(tmp_path / name, bin_dtype=dt).vocab_size == 300


def test_a_short_token_file_names_the_split_that_is_short(tmp_path):
    from test_experiments import make_config

    folder = tmp_path / "tokens"
    folder.mkdir()
    np.arange(5000, dtype=np.uint16).tofile(folder / "train.bin")
    np.arange(10, dtype=np.uint16).tofile(folder / "val.bin")
    config = make_config(tmp_path, "short", **{"data.path": str(folder)})
    with pytest.raises(sk.ShardkitError, match=r"val split has 10 tokens < seq_len \+ 1 = 33"):
        tr.build(config)


def test_two_quick_ctrl_c_still_commit_the_stop_checkpoint(tmp_path):
    """Item 8: the first Ctrl-C asks for a checkpoint and a stop; a second one right after (while that first
    checkpoint is written) used to abandon it and lose the run. Now it warns, and the step is committed."""
    import signal
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    small = {"steps": 500, "progress": False, "log_every": 1, "eval_every": 0, "model.num_layers": 2,
             "model.d_model": 64, "model.mlp_dim": 128, "batch_size": 16, "seq_len": 32,
             "data.max_files": 120}  # fmt: skip
    flags = [f"--config.run_dir={tmp_path}", "--config.name=r", f"--config.data.cache_dir={tmp_path / 'data'}"]
    flags += [f"--config.{k}={v}" for k, v in small.items()]
    p = subprocess.Popen([sys.executable, "-m", "experiments.train", *flags], cwd=root, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        for line in p.stdout:
            if line.startswith("step ") and "/500" in line:  # training: press Ctrl-C twice, 20 ms apart
                p.send_signal(signal.SIGINT)
                time.sleep(0.02)
                p.send_signal(signal.SIGINT)
                break
        out = p.stdout.read()
        p.wait(timeout=120)
    finally:
        p.kill()
    # The second press lands while the step or the save runs (a warning), or after the commit; two presses close
    # together may also arrive as one (Python runs a handler once per pending signal). Either way the run stops
    # with a committed checkpoint: nothing is lost.
    assert p.returncode != 0 and "Traceback" not in out.split("checkpointed step")[0], out[-2000:]
    committed = [d.name for d in (tmp_path / "r" / "checkpoints").iterdir() if d.name.isdigit()]
    assert committed, out[-2000:]


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--model", "gpt_7bb"], "error: --model 'gpt_7bb': no such config; choose one of cosmoflow_512"),
     (["--model", "resnet_digits"], "error: --model 'resnet_digits' has task 'image_classification'; the planner"),
     (["--hardware", "foo"], "error: unknown mesh preset 'foo'; available: cpu8")],
)  # fmt: skip
def test_the_planner_cli_names_a_wrong_model_or_hardware_in_one_line(args, message, capsys):
    """`experiments.plan` was a ModuleNotFoundError / ShardkitError traceback (#26's audit): now exit 2, one line."""
    from experiments import plan

    with pytest.raises(SystemExit) as exit_:
        plan.main(args)
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines
