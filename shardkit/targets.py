"""Targets: hardware that need not be present. A TPU slice by its usual name, as compile-only devices.

    tgt = sk.target("v5p-128")                     # 64 chips of TPU v5p (v4 / v5p count TensorCores, 2 per chip)
    tgt = sk.target("v5e-8x2")                     # two v5e-8 slices joined by DCN
    mesh = sk.make_mesh("data=2,fsdp=32", target=tgt)
    step = sk.make_train_step(sk.abstract_model(make_model), tx, mesh, strategy)
    report = sk.explain(step, step.abstract_state(), step.abstract_batch({"inputs": ((64, 2048), jnp.int32), ...}))
    report.fits                                    # the TPU compiler's peak within the chip's HBM (less a margin)

XLA's TPU compiler (libtpu, from `pip install "jax[tpu]"`) runs on any host: `jax.experimental.topologies`
describes a slice's devices without the chips, and a `Mesh` over them lowers and compiles (nothing can run on
them). The chip figures (HBM, peak FLOP/s, links) come from the presets `meshes/tpu_<generation>_*.toml`.

Names: `<generation>-<n>` with generation v4, v5e (alias v5litepod), v5p, v6e (alias v6litepod); n counts chips for
v5e / v6e and TensorCores for v4 / v5p (two per chip, one JAX device per chip: "megacore"), as Google Cloud names
them. `x<k>` adds k slices over the data-center network (DCN): the mesh's first (slowest) axis spans them.
A libtpu topology name is accepted as it is too: "v5e:2x4", "v5:4x4x4" (chips).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

from shardkit._host import (
    _cuda_plugin,
    _register_plugins_quietly,
    _stderr_kept,
    gpu_attached,
    import_jax_quietly,
)
from shardkit.errors import ShardkitError
from shardkit.presets import HardwarePreset, available_presets, load_preset

#: generation -> (libtpu's topology prefix, chip config, TensorCores per name unit, slice shapes by chip count, preset)
_GENERATIONS: dict[str, tuple[str, str | None, int, dict[int, str], str]] = {}
_SHAPES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}
_SHAPES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
              512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16", 4096: "16x16x16"}  # fmt: skip
_GENERATIONS.update(
    v4=("v4", "megacore", 2, _SHAPES_3D, "tpu_v4_32"),
    v5p=("v5", "megacore", 2, _SHAPES_3D, "tpu_v5p_8"),
    v5e=("v5e", None, 1, _SHAPES_2D, "tpu_v5e_8"),
    v6e=("v6e", None, 1, _SHAPES_2D, "tpu_v6e_8"),
)
_ALIASES = {"v5litepod": "v5e", "v6litepod": "v6e", "v5": "v5p"}  # Cloud's accelerator-type spellings
_PREFIX_GEN = {prefix: gen for gen, (prefix, *_rest) in _GENERATIONS.items()}
#: HBM kept back from `fits`: the TPU runtime holds some memory for itself (program, collective scratch). An
#: assumption, not a measurement: no chip has been measured here. Override with sk.target(name, hbm_margin=...).
HBM_MARGIN = 0.05


def example_names() -> list[str]:
    """Target names that exist, one line's worth per generation (for error messages and docs)."""
    out = []
    for gen, (_, _, per_chip, shapes, _) in _GENERATIONS.items():
        out.append(", ".join(f"{gen}-{c * per_chip}" for c in shapes if c * per_chip >= 4 or per_chip == 1))
    return out


def _parse(name: str) -> tuple[str, int, int, str | None]:
    """name -> (generation, chips per slice, slices, explicit topology shape or None)."""
    s = name.strip().lower().replace("tpu-", "").replace("tpu_", "")
    if m := re.fullmatch(r"(v4|v5|v5e|v6e):(\d+(?:x\d+){1,2})(?:x(\d+)slices?)?", s):  # libtpu's own names
        gen, shape = _PREFIX_GEN[m.group(1)], m.group(2)
        return gen, math.prod(int(x) for x in shape.split("x")), int(m.group(3) or 1), shape
    m = re.fullmatch(r"([a-z0-9]+?)-(\d+)(?:x(\d+))?", s)
    gen = _ALIASES.get(m.group(1), m.group(1)) if m else None
    if gen not in _GENERATIONS:
        raise ShardkitError(
            f"unknown target {name!r}: give a TPU slice by its Cloud name, e.g. "
            + "; ".join(example_names())
            + " (v4 / v5p count TensorCores, two per chip); add 'x<k>' for k slices ('v5e-8x2'), or a libtpu "
            "topology such as 'v5e:2x4'; or a GPU node: " + _gpu_names()
        )
    n, slices = int(m.group(2)), int(m.group(3) or 1)
    per_chip, shapes = _GENERATIONS[gen][2], _GENERATIONS[gen][3]
    if n % per_chip or n // per_chip not in shapes or slices < 1:
        sizes = ", ".join(f"{gen}-{c * per_chip}" for c in shapes)
        raise ShardkitError(f"target {name!r}: {gen} slices come in these sizes: {sizes}" + (
            f" ({gen}'s number counts TensorCores, two per chip)" if per_chip == 2 else "") +
            "; for another shape give libtpu's topology name, e.g. 'v5e:2x4'")  # fmt: skip
    return gen, n // per_chip, slices, None


#: other target families, each (is_name, make, of_kind, names): shardkit/targets_gpu.py registers NVIDIA GPUs
_FAMILIES: list[tuple[Callable[[str], bool], Callable[..., Any], Callable[[str], Any], Callable[[], str]]] = []


def register_family(is_name: Callable[[str], bool], make: Callable[..., Any], of_kind: Callable[[str], Any],
                    names: Callable[[], str]) -> None:  # fmt: skip
    """Adds a family of targets: `is_name(name)` says a name is one of its, `make(name, hbm_margin)` builds it,
    `of_kind(device_kind)` the target of a device kind (None if not its), `names()` its names for error messages."""
    _FAMILIES.append((is_name, make, of_kind, names))


def _gpu_names() -> str:
    return "; ".join(names() for *_, names in _FAMILIES)


def libtpu_missing() -> str:
    """Why the TPU compiler cannot be loaded here ('' when it can): libtpu is a separate wheel."""
    if importlib.util.find_spec("libtpu") is not None:
        return ""
    import jax

    return (f"XLA's TPU compiler (libtpu) is not installed in {sys.prefix}: "
            f"pip install \"jax[tpu]=={jax.__version__}\" (no TPU needed: it compiles for the target from this "
            "machine; about 700 MB)")  # fmt: skip


def tpu_attached() -> bool:
    """A TPU chip on this host's PCI bus (Google's vendor id 0x1ae0), as JAX itself looks for one."""
    try:
        return any(p.read_text().strip() == "0x1ae0" for p in _pci_vendors())
    except OSError:
        return False


def _pci_vendors() -> list[Any]:
    import pathlib

    return list(pathlib.Path("/sys/bus/pci/devices").glob("*/vendor"))


def keep_host_platforms() -> None:
    """On a host without the accelerator a compiler plugin is installed for, JAX's plugins probe for it at start-up:
    libtpu prints TPU_ACCELERATOR_TYPE / TPU_WORKER_HOSTNAMES warnings and an INVALID_ARGUMENT line, JAX's CUDA plugin
    logs "Unable to load CUDA" (a traceback) and is then not registered. Unless the user chose the platforms
    (`JAX_PLATFORMS` / jax_platforms), keep JAX on this host's CPU there; the compilers stay available for targets
    (`jax.experimental.topologies` loads them on demand). A host with a TPU or GPU keeps JAX's default (on a GPU host
    with libtpu installed: "cuda,cpu", without the TPU probe). The CUDA plugin's registration on a GPU-less host
    (its libraries' "Could not find cuda drivers" lines) is done here, quietly. Runs at `import shardkit`, before
    JAX's backends start; afterwards it changes nothing."""
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")  # no metadata-server query from a compile-only host
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "true")  # several processes (pytest-xdist) may load it
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return
    cuda, gpu = _cuda_plugin(), gpu_attached()
    chosen = os.environ.get("JAX_PLATFORMS") or jax.config.jax_platforms
    if not chosen:
        if tpu_attached() or (gpu and libtpu_missing()) or (not cuda and libtpu_missing()):
            return  # JAX's default: its own accelerator, or nothing installed that would probe for an absent one
        chosen = ("cuda,cpu" if cuda else "rocm,cpu") if gpu else "cpu"
        jax.config.update("jax_platforms", chosen)
    if cuda and not gpu and not {"cuda", "gpu"} & set(chosen.replace(" ", "").split(",")):
        _register_plugins_quietly()


def compile_only(mesh: Any) -> bool:
    """Whether `mesh`'s devices can only be compiled for (a target's topology devices, or a platform this process
    has not started): nothing can be put on them or run there."""
    import jax

    devices = getattr(mesh, "devices", None)
    if devices is None or not getattr(devices, "size", 0):  # an AbstractMesh: a trace, no devices at all
        return False
    first = devices.flat[0]
    try:
        live = jax.devices(first.platform)
    except RuntimeError:  # e.g. "tpu" on a host running JAX on cpu: the devices come from libtpu's topology
        return True
    return first not in live


def require_runnable(mesh: Any, what: str) -> None:
    """A ShardkitError, before JAX's own AttributeError, when `what` would execute on compile-only devices."""
    if compile_only(mesh):
        d = mesh.devices.flat[0]
        raise ShardkitError(
            f"{what} runs a computation, and this mesh's {mesh.devices.size} x {d.device_kind} devices can only be "
            "compiled for (a target: nothing runs on them). Take the abstract path: model = "
            "sk.abstract_model(make_model); step = sk.make_train_step(model, tx, mesh, strategy); "
            "sk.explain(step, step.abstract_state(), step.abstract_batch(shapes)) -- or the CLI's "
            "--config.target=... --config.compile_only"
        )


@contextlib.contextmanager
def cache_off_for(mesh: Any) -> Iterator[None]:
    """Wraps a `.compile()` for `mesh`: on compile-only devices JAX's persistent compilation cache is bypassed, since
    its entries for them are written but cannot be read back ("PjRtCompiler must be constructed with a Client to
    call DeserializeLoadedExecutable": a warning, then the compile again). JAX decides once per process whether the
    cache is used (jax._src.compilation_cache.is_cache_used, memoised), so the `jax_enable_compilation_cache` flag
    alone does not reach a process that has compiled before: that decision is set to "not used" for the duration
    and restored after. Elsewhere nothing changes."""
    if not compile_only(mesh):
        yield
        return
    from jax._src import compilation_cache as cc

    lock = getattr(cc, "_cache_initialized_mutex", None)
    if lock is None or not hasattr(cc, "_cache_checked") or not hasattr(cc, "_cache_used"):  # another jax: the flag
        from jax._src import config as jax_config

        with jax_config.enable_compilation_cache(False):
            yield
        return
    with lock:
        saved = cc._cache_checked, cc._cache_used
        cc._cache_checked, cc._cache_used = True, False
    try:
        yield
    finally:
        with lock:
            cc._cache_checked, cc._cache_used = saved


def out_of_memory(error: BaseException) -> str:
    """The compiler's reason when `error` is XLA refusing a program larger than the devices' memory
    ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, ... (213.45G) exceeds available HBM (95.74G)."), else "":
    a verdict on the plan (it does not fit), not a failure of the tool."""
    text = str(error)
    return text.split("RESOURCE_EXHAUSTED:", 1)[1].strip().splitlines()[0] if "RESOURCE_EXHAUSTED:" in text else ""


#: device_kind (as JAX reports it) -> generation, for a mesh built on devices rather than from a name
_KINDS = {"TPU v4": "v4", "TPU v5": "v5p", "TPU v5p": "v5p", "TPU v5 lite": "v5e", "TPU v5e": "v5e",
          "TPU v6 lite": "v6e", "TPU v6e": "v6e"}  # fmt: skip


def chip_of(mesh: Any) -> HardwarePreset | None:
    """The chip figures (HBM, peak FLOP/s) for `mesh`'s devices: the TPU generation's preset, else a preset in
    meshes/ with the same device_kind; None when unknown (and for CPU, whose 'HBM' is the host's shared memory)."""
    devices = getattr(mesh, "devices", None)
    if devices is None or not getattr(devices, "size", 0):
        return None
    d = devices.flat[0]
    if d.platform == "cpu":
        return None
    gen = _KINDS.get(d.device_kind)
    if gen is not None:
        return load_preset(_GENERATIONS[gen][4])
    for *_, of_kind, _ in _FAMILIES:  # a registered family's kind (a GPU target): the target, with its HBM margin
        if (t := of_kind(d.device_kind)) is not None:
            return t
    for name in available_presets():
        p = load_preset(name)
        if p.device_kind == d.device_kind and not p.groups:
            return p
    return None


def wraparound(topology: str) -> tuple[bool, bool, bool] | None:
    """Which of a slice's ICI dimensions close into rings, as libtpu's `wrap` option takes them; None: none (an open
    mesh, libtpu's default). A v4 / v5p slice with every side >= 4 chips (v5p-128 = 4x4x4 and up) is a torus in all
    three; on v5e / v6e a side wraps when it spans a pod side (16 chips), as MaxText's train_compile describes its
    targets. Without it XLA plans a v5p-128's 64-chip collectives on an open mesh and writes fsdp's all-gathers as
    all-reduces of zero-padded buffers (docs/performance.md, "Scale cells against MaxText")."""
    prefix, _, shape = topology.partition(":")
    dims = [int(x) for x in shape.split("x")]
    if len(dims) == 3 and prefix in ("v4", "v5"):
        wrap = (min(dims) >= 4,) * 3
    else:
        wrap = tuple(d == 16 for d in dims) + (False,) * (3 - len(dims))
    return wrap if any(wrap) else None


@functools.cache
def _devices(topology: str, chip_config: str | None, slices: int) -> tuple[Any, ...]:
    if why := libtpu_missing():
        raise ShardkitError(f"cannot compile for TPU target {topology!r}: {why}")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    from jax.experimental import topologies

    kw: dict[str, Any] = {"chip_config_name": chip_config} if chip_config else {}
    if math.prod(int(x) for x in topology.partition(":")[2].split("x")) == 1:
        kw["chips_per_host_bounds"] = (1, 1, 1)  # a one-chip host (v5e-1, v6e-1): libtpu's default host is 2x2x1
    if wrap := wraparound(topology):
        kw["wrap"] = wrap  # the torus the slice is: its collectives are planned on the links it has
    with _stderr_kept() as said:  # libtpu's start-up lines about the absent chip: shown only if this fails
        try:
            desc = topologies.get_topology_desc(topology_name=topology, platform="tpu", num_slices=slices, **kw)
        except Exception as e:  # libtpu's own message (an unknown shape for this libtpu, ...)
            raise ShardkitError(
                f"libtpu could not describe TPU topology {topology!r} x {slices} slice(s): {e}\n{said()}"
            ) from e
    return tuple(desc.devices)


@dataclasses.dataclass(frozen=True)
class Target:
    """A TPU slice (or several) that need not be present: its compile-only devices and its chip's figures."""

    name: str  # as normalised: "v5p-128", "v5e-8x2"
    generation: str  # v4 | v5e | v5p | v6e
    topology: str  # libtpu's topology name, "v5:4x4x4"
    chip_config: str | None  # "megacore" for v4 / v5p (one JAX device per chip)
    chips_per_slice: int
    num_slices: int
    chip: HardwarePreset  # the generation's preset: HBM per chip, peak FLOP/s, ICI / DCN links
    hbm_margin: float = HBM_MARGIN  # fraction of HBM `fits` keeps back

    platform = "tpu"
    compiler = "XLA's TPU compiler"

    @property
    def num_devices(self) -> int:
        return self.chips_per_slice * self.num_slices

    @property
    def devices(self) -> list[Any]:
        """The compile-only devices (slice by slice), from libtpu's topology description; cached per process."""
        return list(_devices(self.topology, self.chip_config, self.num_slices))

    @property
    def device_kind(self) -> str:
        return self.chip.device_kind

    @property
    def hbm_bytes(self) -> float:
        return self.chip.hbm_bytes

    @property
    def usable_hbm_bytes(self) -> float:
        """What `fits` compares the compiled peak with: HBM per chip less the margin."""
        return self.hbm_bytes * (1.0 - self.hbm_margin)

    @property
    def peak_flops(self) -> float:
        return self.chip.peak_flops

    def fits(self, peak_bytes: float) -> tuple[bool, float]:
        """(whether `peak_bytes` per device fits, the bytes to spare; negative: the bytes it lacks)."""
        spare = self.usable_hbm_bytes - peak_bytes
        return spare >= 0, spare

    def preset(self, axes: dict[str, int] | None = None) -> HardwarePreset:
        """The target as a HardwarePreset for the cost model and the planner (`sk.plan(hardware=...)`): the chip's
        figures for all its devices; with `axes` (a mesh's), the first axis spans the slices (DCN)."""
        axes = dict(axes or {"data": self.num_devices})
        first = next(iter(axes))
        dcn = {first: self.num_slices} if self.num_slices > 1 else {}
        ici = {a: (d // self.num_slices if a == first and dcn else d) for a, d in axes.items()}
        return dataclasses.replace(
            self.chip, name=self.name, num_devices=self.num_devices, ici=ici, dcn=dcn,
            description=f"{self.name}: {self.num_slices} x {self.topology} ({self.device_kind}), compile-only target",
        )  # fmt: skip

    def __str__(self) -> str:
        slices = f" x {self.num_slices} slices (DCN)" if self.num_slices > 1 else ""
        chip = f"{self.hbm_bytes / 2**30:.0f} GiB HBM and {self.peak_flops / 1e12:.0f} TFLOP/s bf16 per chip"
        return f"{self.name} ({self.num_devices} x {self.device_kind}, topology {self.topology}{slices}; {chip})"


def target(name: str | Target, *, hbm_margin: float | None = None) -> Target:
    """The TPU target named `name` ("v5e-8", "v5p-128", "v6e-256", "v4-32", "v5e-8x2", or "v5e:2x4"), or the GPU
    target ("h100-8", "h100-8x4": 4 hosts of 8, "a100-8", "b200-8", "h200-8"; shardkit/targets_gpu.py).

    Its devices are created on first use (`Target.devices`); a missing compiler (libtpu, JAX's CUDA plugin) or an
    unknown name raises a ShardkitError naming the packages or the names that exist. `hbm_margin`: the fraction of
    HBM `fits` keeps back (default HBM_MARGIN on TPU, targets_gpu.GPU_HBM_MARGIN on GPU)."""
    if isinstance(name, Target):
        return name
    if not isinstance(name, str):
        raise ShardkitError(f"target {name!r}: give a name such as 'v5e-8', 'v5p-128' or 'h100-8'")
    if hbm_margin is not None and not 0.0 <= hbm_margin < 1.0:
        raise ShardkitError(f"hbm_margin={hbm_margin}: a fraction of HBM in [0, 1)")
    for is_name, make, *_ in _FAMILIES:  # GPU names (shardkit/targets_gpu.py)
        if is_name(name):
            return make(name, hbm_margin)
    hbm_margin = HBM_MARGIN if hbm_margin is None else hbm_margin
    gen, chips, slices, shape = _parse(name)
    prefix, chip_config, per_chip, shapes, preset_name = _GENERATIONS[gen]
    shape = shape or shapes[chips]
    if preset_name not in available_presets():
        raise ShardkitError(f"target {name!r} needs the preset meshes/{preset_name}.toml (the chip's figures)")
    canonical = f"{gen}-{chips * per_chip}" + (f"x{slices}" if slices > 1 else "")
    return Target(canonical, gen, f"{prefix}:{shape}", chip_config, chips, slices, load_preset(preset_name), hbm_margin)


__all__ = [
    "HBM_MARGIN",
    "Target",
    "cache_off_for",
    "chip_of",
    "compile_only",
    "gpu_attached",
    "import_jax_quietly",
    "keep_host_platforms",
    "libtpu_missing",
    "out_of_memory",
    "register_family",
    "require_runnable",
    "target",
    "tpu_attached",
]  # fmt: skip
