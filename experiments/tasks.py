"""The model families `experiments.train` trains, chosen by `config.task`: one small builder each.

    lm                    models.gpt.GPT on byte tokens (experiments/data/text.py); its own loss and batch_axes
    image_classification  models.resnet.ResNet on images (experiments/data/images.py), classification_loss
    volume_regression     models.cosmoflow.CosmoFlow on generated cosmology volumes (experiments/data/volumes.py) or
                          a folder of .npy volumes + targets.npy; MSE against predicting the mean
    volume_segmentation   models.unet3d.UNet3D on generated volumes of labelled spheres and boxes; voxel accuracy, Dice

A task knows its model (`make_model`), loss (`loss_fn`, `batch_axes`; None = the model's own), batches
(`batch_spec` for compiling, `train_batch(step, s)` for step s, `val_batches`), what a step processes (`unit`,
`units_per_step`, `flops_per_unit` for MFU) and what to print before the run (`describe`). The training loop in
experiments/train.py is the same for all of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx

import shardkit as sk
from experiments import init_from
from experiments.data import images, text, volumes
from experiments.data import tokens as shards
from models import cosmoflow, unet3d
from models.gpt import GPT, GPTConfig
from models.resnet import BATCH_AXES, ResNet, ResNetConfig, classification_loss

TASKS = ("lm", "image_classification", "volume_regression", "volume_segmentation")


def model_config(config: ml_collections.ConfigDict, data_vocab: int) -> GPTConfig:
    """GPTConfig from config.model; vocab_size 0 = the data's (padded to 128), max_seq_len 0 = seq_len."""
    hf = init_from.model_config(config, data_vocab)  # --config.init_from=hf:<dir>: the folder's architecture
    if hf is not None:
        return hf
    fields = dict(config.model)
    fields["vocab_size"] = fields["vocab_size"] or -(-data_vocab // 128) * 128
    fields["max_seq_len"] = fields["max_seq_len"] or config.seq_len
    if fields["vocab_size"] < data_vocab:
        raise sk.ShardkitError(f"model.vocab_size={fields['vocab_size']} < the data's vocabulary {data_vocab}: its "
                               "token ids would index past the embedding; use a model of at least that vocabulary, "
                               "or prepare the data with the model's own tokenizer")  # fmt: skip
    if config.seq_len > fields["max_seq_len"]:
        raise sk.ShardkitError(f"seq_len={config.seq_len} > model.max_seq_len={fields['max_seq_len']}")
    return GPTConfig(**fields)


@dataclasses.dataclass
class LMTask:
    """Next-token prediction: GPT on a token corpus; batches {"inputs", "targets"[, "positions"]} int32 [B, T],
    + "positions" and "segment_ids" from the end-of-document tokens of prepared data (experiments/data/tokens.py)."""

    config: ml_collections.ConfigDict
    model_cfg: GPTConfig
    ds: text.TokenDataset
    kind = "lm"
    unit, short = "tokens", "tok"  # metrics.jsonl: tokens, tokens_per_s
    loss_fn = None  # GPT.loss
    batch_axes = None  # GPT.batch_axes = ("batch", "seq")

    def make_model(self, rngs: nnx.Rngs) -> GPT:
        return GPT(self.model_cfg, rngs=rngs)

    @property
    def units_per_step(self) -> int:
        return self.config.batch_size * self.config.seq_len

    @property
    def flops_per_unit(self) -> float:
        return self.model_cfg.flops_per_token(self.config.seq_len)

    @property
    def eod(self) -> int | None:
        """The end-of-document id that segments windows into documents (prepared data, data.documents), or None."""
        eod = getattr(self.ds, "eod_id", None)
        return eod if eod is not None and self.config.data.get("documents", True) else None

    def _layout(self, step: sk.TrainStep) -> np.ndarray | None:
        """Context parallelism: the loader lays tokens out for the ring (zigzag / striped) and adds positions."""
        layout, ring = sk.kernels.batch_layout(step.strategy, step.mesh)  # what the strategy's kernels declare
        return None if layout == "contiguous" else sk.attention.layout_perm(layout, self.config.seq_len, ring)

    def batch_spec(self, step: sk.TrainStep | None = None) -> dict[str, jax.ShapeDtypeStruct]:
        sharding = step.batch_sharding if step else None
        tokens = jax.ShapeDtypeStruct((self.config.batch_size, self.config.seq_len), jnp.int32, sharding=sharding)
        keys = (
            ("inputs", "targets") if step is None or self._layout(step) is None else ("inputs", "targets", "positions")
        )
        return dict.fromkeys(shards.BATCH_KEYS if self.eod is not None else keys, tokens)

    def train_batch(self, step: sk.TrainStep, s: int) -> dict[str, jax.Array]:
        c = self.config
        return shards.global_batch(self.ds, s, c.batch_size, c.seq_len, step.batch_sharding, seed=c.seed,
                                   perm=self._layout(step), eod=self.eod)  # fmt: skip

    def val_batches(self, step: sk.TrainStep) -> list[dict[str, jax.Array]]:
        c = self.config
        return shards.val_batches(self.ds, c.eval_batches, c.batch_size, c.seq_len, step.batch_sharding,
                                  self._layout(step), self.eod)  # fmt: skip

    def describe(self, say: Callable[[str], None]) -> dict[str, Any]:
        """Prints the model and data lines; returns what goes into config.json's info."""
        mcfg, ds, c = self.model_cfg, self.ds, self.config
        say(
            f"model: {mcfg.num_params() / 1e6:.2f}M params ({mcfg.num_params(False) / 1e6:.2f}M non-embedding), "
            f"{mcfg.num_layers} x {mcfg.d_model}, {mcfg.flops_per_token(c.seq_len) / 1e6:.1f} MFLOP/token; "
            f"batch {c.batch_size} x {c.seq_len} = {c.batch_size * c.seq_len:,} tokens/step"
        )
        entropy = ds.unigram_entropy_nats()
        say(
            f"data: {ds.name}, train {len(ds.train):,} / val {len(ds.val):,} tokens; unigram entropy {entropy:.3f} "
            "nats/token = the loss of predicting by token frequency alone: the baseline to beat clearly"
        )
        return dict(unigram_entropy=entropy, data_vocab_size=ds.vocab_size)


def _lm(config: ml_collections.ConfigDict) -> LMTask:
    try:
        d = config.data
        if d.path and shards.is_prepared(d.path):  # python -m experiments.data.prepare's output
            ds = shards.load_prepared(d.path)
        else:
            ds = text.load_dataset(
                d.path or None,
                cache_dir=d.cache_dir or None,
                bin_dtype=np.dtype(d.bin_dtype),
                max_files=d.max_files or None,
            )
        for split, tokens in (("train", ds.train), ("val", ds.val)):  # the error names the split that is short
            text.batch_offsets(len(tokens), 0, 0, config.seq_len, split=split)
    except (OSError, ValueError) as e:
        raise sk.ShardkitError(f"data.path={config.data.path or '(stdlib)'}: {e}") from e
    return LMTask(config, model_config(config, ds.vocab_size), ds)


@dataclasses.dataclass
class ImageTask:
    """Image classification: ResNet on {"image": f32[B, H, W, C], "label": int32[B]}; validation = the whole split."""

    config: ml_collections.ConfigDict
    model_cfg: ResNetConfig
    ds: images.ImageDataset
    kind = "image_classification"
    unit, short = "examples", "ex"  # metrics.jsonl: examples, examples_per_s
    loss_fn = staticmethod(classification_loss)  # (mean cross-entropy, {"accuracy"})
    batch_axes = BATCH_AXES

    def make_model(self, rngs: nnx.Rngs) -> ResNet:
        return ResNet(self.model_cfg, rngs=rngs)

    @property
    def units_per_step(self) -> int:
        return self.config.batch_size

    @property
    def flops_per_unit(self) -> float:
        return self.model_cfg.flops_per_example(*self.ds.image_shape[:2])

    def _shardings(self, step: sk.TrainStep, size: int) -> dict[str, Any]:
        return step.batch_shardings(images.batch_spec(size, self.ds.image_shape))

    def batch_spec(self, step: sk.TrainStep | None = None, size: int = 0) -> dict[str, jax.ShapeDtypeStruct]:
        size = size or self.config.batch_size
        return images.batch_spec(size, self.ds.image_shape, self._shardings(step, size) if step else None)

    @property
    def val_batch_size(self) -> int:
        return len(self.ds.val_labels) // self.config.eval_batches

    def train_batch(self, step: sk.TrainStep, s: int) -> dict[str, jax.Array]:
        c = self.config
        return images.global_batch(self.ds, s, c.batch_size, self._shardings(step, c.batch_size), seed=c.seed)

    def val_batches(self, step: sk.TrainStep) -> list[dict[str, jax.Array]]:
        return images.val_batches(self.ds, self.config.eval_batches, self._shardings(step, self.val_batch_size))

    def describe(self, say: Callable[[str], None]) -> dict[str, Any]:
        mcfg, ds, c = self.model_cfg, self.ds, self.config
        h, w, ch = ds.image_shape
        say(
            f"model: ResNet {mcfg.num_params() / 1e3:.1f}K params, widths {list(mcfg.widths)} x blocks "
            f"{list(mcfg.blocks)}, {self.flops_per_unit / 1e6:.1f} MFLOP/example (convs + head, fwd + bwd); "
            f"batch {c.batch_size} images {h}x{w}x{ch}"
        )
        chance = float(ds.class_counts("val").max() / len(ds.val_labels))
        say(
            f"data: {ds.name}, train {len(ds.train_labels):,} / val {len(ds.val_labels):,} images, "
            f"{ds.num_classes} classes; chance: loss ln {ds.num_classes} = {math.log(ds.num_classes):.3f} nats, "
            f"accuracy {chance:.1%} (the most frequent validation class)"
        )
        return dict(chance_loss=math.log(ds.num_classes), chance_accuracy=chance, image_shape=list(ds.image_shape))


def _image_classification(config: ml_collections.ConfigDict) -> ImageTask:
    d = config.data
    try:
        ds = images.load_dataset(d.name, val_size=d.val_size, split_seed=d.split_seed)
        images.val_batches(ds, config.eval_batches)  # the validation split divides into eval_batches batches
    except ValueError as e:
        raise sk.ShardkitError(f"data: {e} (data.name={d.name!r}, data.val_size, eval_batches)") from e
    fields = dict(config.model)
    fields["num_classes"] = fields.get("num_classes") or ds.num_classes
    if fields["num_classes"] < ds.num_classes:
        raise sk.ShardkitError(f"model.num_classes={fields['num_classes']} < the data's {ds.num_classes} classes")
    try:
        model_cfg = ResNetConfig(**fields, in_channels=ds.image_shape[-1])
    except (TypeError, ValueError) as e:
        raise sk.ShardkitError(f"model: {e}") from e
    return ImageTask(config, model_cfg, ds)


@dataclasses.dataclass
class VolumeTask:
    """3D CNNs on volumes `[B, S, S, S, 1]`: CosmoFlow regression or U-Net segmentation (config.task).

    Every batch is built by `volumes.global_batch`: each device generates (or reads, for .npy folders) only its own
    spatial block of each of its samples, so under a spatial strategy no sample exists whole anywhere. Training
    draws `batch_size` of `data.train_size` samples per step (a permutation per epoch, by `seed`); validation is
    `eval_batches x batch_size` fixed samples of a separate stream (`data.seed + 1`), or the folder's last ones.
    """

    config: ml_collections.ConfigDict
    model_cfg: Any
    kind: str
    source: Any  # CosmoSpec | SegSpec | NpyVolumes
    unit, short = "volumes", "vol"

    @property
    def regression(self) -> bool:
        return self.kind == "volume_regression"

    @property
    def loss_fn(self) -> Any:
        return cosmoflow.regression_loss if self.regression else unet3d.segmentation_loss

    @property
    def batch_axes(self) -> dict[str, Any]:
        return cosmoflow.BATCH_AXES if self.regression else unet3d.BATCH_AXES

    def make_model(self, rngs: nnx.Rngs) -> nnx.Module:
        model = cosmoflow.CosmoFlow if self.regression else unet3d.UNet3D
        return model(self.model_cfg, rngs=rngs)

    @property
    def size(self) -> int:
        return self.source.shape[0] if isinstance(self.source, volumes.NpyVolumes) else self.source.size

    @property
    def channels(self) -> int:
        return self.source.shape[-1] if isinstance(self.source, volumes.NpyVolumes) else 1

    @property
    def units_per_step(self) -> int:
        return self.config.batch_size

    @property
    def flops_per_unit(self) -> float:
        m = self.model_cfg
        return m.flops_per_example() if self.regression else m.flops_per_example(self.size)

    val_batch_size = property(lambda self: self.config.batch_size)

    def batch_spec(self, step: sk.TrainStep | None = None, size: int = 0) -> dict[str, jax.ShapeDtypeStruct]:
        b, s = size or self.config.batch_size, self.size
        other = jax.ShapeDtypeStruct((b, self.model_cfg.num_outputs), jnp.float32) if self.regression else (
            jax.ShapeDtypeStruct((b, s, s, s), jnp.int32))  # fmt: skip
        spec = {"volume": jax.ShapeDtypeStruct((b, s, s, s, self.channels), jnp.float32),
                "target" if self.regression else "label": other}  # fmt: skip
        if step is None:
            return spec
        shardings = step.batch_shardings(spec)
        return {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=shardings[k]) for k, v in spec.items()}

    def _batch(self, step: sk.TrainStep, indices: Any, seed: int) -> dict[str, jax.Array]:
        spec = self.batch_spec(step, len(indices))
        sh = {k: v.sharding for k, v in spec.items()}
        if isinstance(self.source, volumes.NpyVolumes):
            src, shape = self.source, spec["volume"].shape
            vol = volumes.global_batch(lambda i, blk: src.block(i, blk), indices, shape, sh["volume"])
            return {"volume": vol, "target": jax.device_put(np.stack([src.target(i) for i in indices]), sh["target"])}
        if self.regression:
            return volumes.cosmo_batch(seed, indices, self.source, sh["volume"], sh["target"])
        return volumes.seg_batch(seed, indices, self.source, sh["volume"], sh["label"])

    def _split(self) -> tuple[int, int]:
        """(train samples, first validation index): a folder's last eval_batches x batch_size volumes validate."""
        c, n_val = self.config, self.config.eval_batches * self.config.batch_size
        if isinstance(self.source, volumes.NpyVolumes):
            return len(self.source) - n_val, len(self.source) - n_val
        return c.data.train_size, 0

    def train_batch(self, step: sk.TrainStep, s: int) -> dict[str, jax.Array]:
        c, (n, _) = self.config, self._split()
        return self._batch(step, [int(i) for i in images.batch_indices(n, s, c.batch_size, c.seed)], c.data.seed)

    def val_batches(self, step: sk.TrainStep) -> list[dict[str, jax.Array]]:
        c, (_, first) = self.config, self._split()
        seed = c.data.seed if isinstance(self.source, volumes.NpyVolumes) else c.data.seed + 1
        b = c.batch_size
        return [self._batch(step, list(range(first + k * b, first + (k + 1) * b)), seed) for k in range(c.eval_batches)]

    def describe(self, say: Callable[[str], None]) -> dict[str, Any]:
        m, c, s = self.model_cfg, self.config, self.size
        name = "CosmoFlow" if self.regression else "3D U-Net"
        say(f"model: {name} {m.num_params() / 1e3:.1f}K params, widths {list(m.widths)}, "
            f"{self.flops_per_unit / 1e9:.2f} GFLOP/volume (fwd + bwd); batch {c.batch_size} volumes {s}^3 x "
            f"{self.channels}")  # fmt: skip
        n_val, seed = c.eval_batches * c.batch_size, c.data.seed + 1
        if isinstance(self.source, volumes.NpyVolumes):
            t = np.stack([self.source.target(i) for i in range(self._split()[1], len(self.source))])
            baseline = float(((t - t.mean(0)) ** 2).mean())
            say(f"data: {self.source} ({len(self.source) - n_val} train / {n_val} val); predicting the mean target: "
                f"MSE {baseline:.4f}")  # fmt: skip
            return dict(baseline_loss=baseline)
        if self.regression:
            baseline = volumes.mean_baseline(seed, range(n_val), self.source)
            say(f"data: generated lognormal density fields {s}^3 (power-law spectrum; targets "
                f"{', '.join(volumes.CosmoSpec.PARAM_NAMES)} in [-1, 1]), {c.data.train_size} train / {n_val} val "
                f"samples; predicting the mean target: MSE {baseline:.4f}, the baseline to beat clearly")  # fmt: skip
            return dict(baseline_loss=baseline)
        labels = np.stack([volumes.seg_block(seed, i, self.source)[1] for i in range(n_val)])
        chance = float(np.bincount(labels.ravel(), minlength=3).max() / labels.size)
        say(f"data: generated {s}^3 volumes of labelled spheres and boxes in noise ({volumes.SegSpec.NUM_CLASSES} "
            f"classes), {c.data.train_size} train / {n_val} val; chance: accuracy {chance:.1%} (all background), "
            "Dice 0")  # fmt: skip
        return dict(chance_accuracy=chance, chance_loss=math.log(volumes.SegSpec.NUM_CLASSES))


def _volumes(config: ml_collections.ConfigDict) -> VolumeTask:
    d, kind = config.data, config.task
    try:
        if d.path:
            if kind != "volume_regression":
                raise ValueError("a folder of .npy volumes (data.path) is read for volume_regression only")
            source = volumes.NpyVolumes(d.path)
            if not source.has_targets:
                raise ValueError(f"{d.path} has no targets.npy (one row of regression targets per volume)")
            if len(source) <= config.eval_batches * config.batch_size:
                raise ValueError(f"{len(source)} volumes: fewer than eval_batches x batch_size + 1")
        else:
            spec = volumes.CosmoSpec if kind == "volume_regression" else volumes.SegSpec
            source = spec(size=d.size)
            if d.train_size < config.batch_size:
                raise ValueError(f"data.train_size={d.train_size} < batch_size={config.batch_size}")
    except (OSError, ValueError) as e:
        raise sk.ShardkitError(f"data: {e}") from e
    fields, channels = dict(config.model), source.shape[-1] if isinstance(source, volumes.NpyVolumes) else 1
    try:
        if kind == "volume_regression":
            outputs = source.target(0).size if isinstance(source, volumes.NpyVolumes) else 4
            size = source.shape[0] if isinstance(source, volumes.NpyVolumes) else d.size
            model_cfg = cosmoflow.CosmoFlowConfig(**fields, size=size, in_channels=channels, num_outputs=outputs)
        else:
            model_cfg = unet3d.UNet3DConfig(**fields, in_channels=channels, num_classes=volumes.SegSpec.NUM_CLASSES)
            if d.size % model_cfg.min_size():
                raise ValueError(
                    f"data.size={d.size} is not divisible by {model_cfg.min_size()} (one halving per level)"
                )
    except (TypeError, ValueError) as e:
        raise sk.ShardkitError(f"model: {e}") from e
    return VolumeTask(config, model_cfg, kind, source)


def build_task(config: ml_collections.ConfigDict) -> LMTask | ImageTask | VolumeTask:
    """The task `config.task` names ("lm" when the config has no task field), data loaded and checked."""
    kind = config.get("task", "lm")
    if kind not in TASKS:
        raise sk.ShardkitError(f"task={kind!r}; available: {', '.join(TASKS)}")
    if kind.startswith("volume"):
        return _volumes(config)
    return _lm(config) if kind == "lm" else _image_classification(config)
