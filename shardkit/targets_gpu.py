"""GPU targets: NVIDIA nodes that need not be present, compiled for by XLA's CUDA compiler on any host.

    tgt = sk.target("h100-8")                      # one HGX/DGX node: 8 x H100 SXM on NVLink
    tgt = sk.target("h100-8x4")                    # 4 such nodes (hosts) joined by InfiniBand
    mesh = sk.make_mesh("data=4,fsdp=8", target=tgt)   # the first axis spans the hosts (the slowest links)
    report = sk.explain(step, step.abstract_state(), step.abstract_batch(shapes)); report.fits

XLA's CUDA compiler ships in JAX's CUDA plugin (`jax-cuda12-plugin`, `jax-cuda12-pjrt`) and runs `ptxas` from
`nvidia-cuda-nvcc-cu12`; none of them needs a GPU. `jax.experimental.topologies.get_topology_desc(platform="cuda",
target_config=SPEC, topology="1x<hosts>x<gpus per host>")` describes the devices of a GPU the compiler is told
about in SPEC, a GpuTargetConfigProto (text form) kept in meshes/gpu_specs/. The chip figures (HBM, peak FLOP/s,
NVLink and inter-host bandwidth, with their sources) come from the preset beside it in meshes/.

Names: `<gpu>-<n>` with gpu h100, h200, a100, b200 and n GPUs per host (1, 2, 4 or 8); `x<k>` adds hosts. What a
deviceless compile gives is real for collectives, memory and which kernels run; gemm tiles are not (autotuning
needs a GPU: every gemm gets XLA's fallback tiles), and nothing is timed.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import pathlib
import re
import shutil
import sys
from typing import Any

from shardkit.errors import ShardkitError
from shardkit.presets import HardwarePreset, available_presets, load_preset, preset_dirs
from shardkit.targets import Target, register_family

#: gpu -> (GpuTargetConfigProto file in meshes/gpu_specs/, preset with the chip's figures)
GPUS: dict[str, tuple[str, str]] = {
    "h100": ("h100_sxm.txtpb", "gpu_8xh100"),
    "h200": ("h200_sxm.txtpb", "gpu_h200_8"),  # H100's compute, H200's memory and bandwidth (the spec says so)
    "a100": ("a100_sxm_80.txtpb", "gpu_a100_8"),
    "b200": ("b200_sxm.txtpb", "gpu_b200_8"),
}
GPUS_PER_HOST = (1, 2, 4, 8)
#: HBM kept back from `fits` on a GPU: the CUDA context, cuBLAS / cuDNN workspaces and NCCL's buffers live beside
#: XLA's allocations. An assumption, not a measurement. JAX preallocates 75% of the memory unless
#: XLA_PYTHON_CLIENT_MEM_FRACTION says more (e.g. 0.9): a program that fits here needs that setting.
GPU_HBM_MARGIN = 0.10
_NAME = re.compile(r"(?:nvidia[-_])?([a-z]\d{3})-(\d+)(?:x(\d+))?")


def is_gpu_name(name: str) -> bool:
    """Whether `name` is spelled as a GPU target (`h100-8`, `a100-8x2`), known or not."""
    return bool(_NAME.fullmatch(name.strip().lower()))


def example_names() -> str:
    return ", ".join(f"{g}-8" for g in GPUS) + " (GPUs per host: 1, 2, 4 or 8; 'x<k>' for k hosts: 'h100-8x4')"


def cuda_missing() -> str:
    """Why XLA's CUDA compiler cannot be loaded here ('' when it can): JAX's CUDA plugin and ptxas are wheels of
    their own."""
    import jax

    lack = [p for p in ("jax_cuda12_plugin", "jax_plugins.xla_cuda12") if not _has_module(p)]
    ptxas = _has_module("nvidia.cuda_nvcc") or shutil.which("ptxas")
    if not lack and ptxas:
        return ""
    return (f"XLA's CUDA compiler is not installed in {sys.prefix} ("
            + ", ".join([*lack, *([] if ptxas else ["ptxas"])]) + " missing): pip install "
            f"\"jax[cuda12-local]=={jax.__version__}\" nvidia-cuda-nvcc-cu12 (no GPU needed: about 310 MB; "
            "jax[cuda12] would add 3 GB of runtime libraries a compile does not use)")  # fmt: skip


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def spec_path(file: str) -> pathlib.Path:
    for d in preset_dirs():
        if (p := d / "gpu_specs" / file).is_file():
            return p
    raise ShardkitError(f"GPU spec meshes/gpu_specs/{file} not found (searched {', '.join(map(str, preset_dirs()))})")


def device_kind_of(spec_text: str) -> str:
    """The device_kind JAX reports for devices compiled for `spec_text`: its `device_description_str`."""
    m = re.search(r'device_description_str:\s*"([^"]*)"', spec_text)
    return m.group(1) if m else ""


@functools.cache
def _devices(spec_file: str, topology: str) -> tuple[Any, ...]:
    if why := cuda_missing():
        raise ShardkitError(f"cannot compile for GPU topology {topology!r} ({spec_file}): {why}")
    from jax.experimental import topologies

    spec = spec_path(spec_file).read_text()
    try:
        desc = topologies.get_topology_desc(platform="cuda", target_config=spec, topology=topology)
    except NotImplementedError as e:  # the plugin did not register: its start-up check failed (no GPU, no CPU pin)
        raise ShardkitError(
            f"JAX's CUDA plugin is installed but not registered ({e}): on a host without a GPU, JAX must run on "
            "the CPU: set JAX_PLATFORMS=cpu (import shardkit before jax does this when JAX_PLATFORMS is unset)"
        ) from e
    except Exception as e:
        raise ShardkitError(f"XLA could not describe GPU topology {topology!r} for {spec_file}: {e}") from e
    return tuple(sorted(desc.devices, key=lambda d: (d.process_index, d.id)))


@dataclasses.dataclass(frozen=True)
class GpuTarget(Target):
    """GPU nodes that need not be present: `num_slices` hosts of `chips_per_slice` GPUs; `topology` is XLA's
    "1x<hosts>x<gpus per host>"; `spec` the GpuTargetConfigProto file (meshes/gpu_specs/) the compiler is given."""

    spec: str = ""

    platform = "gpu"
    compiler = "XLA's CUDA compiler"

    @property
    def devices(self) -> list[Any]:
        """The compile-only devices, host by host, from XLA's topology description; cached per process."""
        if why := cuda_missing():
            raise ShardkitError(f"cannot compile for GPU target {self.name!r}: {why}")
        return list(_devices(self.spec, self.topology))

    @property
    def spec_text(self) -> str:
        return spec_path(self.spec).read_text()

    def preset(self, axes: dict[str, int] | None = None) -> HardwarePreset:
        """As Target.preset: with `axes`, the first axis spans the hosts (the inter-host links, `[links.dcn]`)."""
        p = super().preset(axes)
        hosts = f"{self.num_slices} hosts x {self.chips_per_slice}" if self.num_slices > 1 else f"{self.num_devices}"
        return dataclasses.replace(p, description=f"{self.name}: {hosts} x {self.device_kind}, compile-only target")

    def __str__(self) -> str:
        hosts = f"{self.num_slices} hosts x {self.chips_per_slice}" if self.num_slices > 1 else f"{self.num_devices}"
        chip = f"{self.hbm_bytes / 2**30:.0f} GiB HBM and {self.peak_flops / 1e12:.0f} TFLOP/s bf16 per GPU"
        return f"{self.name} ({hosts} x {self.device_kind}, topology {self.topology}; {chip})"


def gpu_target(name: str, hbm_margin: float | None = None) -> GpuTarget:
    """The GPU target named `name` ("h100-8", "h100-8x4", "a100-8", "b200-8", "h200-8")."""
    m = _NAME.fullmatch(name.strip().lower())
    gpu = m.group(1) if m else ""
    if gpu not in GPUS:
        raise ShardkitError(f"unknown GPU target {name!r}: GPU targets are {example_names()}")
    per_host, hosts = int(m.group(2)), int(m.group(3) or 1)
    if per_host not in GPUS_PER_HOST or hosts < 1:
        raise ShardkitError(
            f"GPU target {name!r}: {per_host} GPUs per host; give 1, 2, 4 or 8 GPUs per host and 'x<k>' for k "
            f"hosts, e.g. '{gpu}-8x4' (32 GPUs on 4 hosts)"
        )
    spec, preset_name = GPUS[gpu]
    if preset_name not in available_presets():
        raise ShardkitError(f"target {name!r} needs the preset meshes/{preset_name}.toml (the GPU's figures)")
    chip = load_preset(preset_name)
    canonical = f"{gpu}-{per_host}" + (f"x{hosts}" if hosts > 1 else "")
    margin = GPU_HBM_MARGIN if hbm_margin is None else hbm_margin
    return GpuTarget(canonical, gpu, f"1x{hosts}x{per_host}", None, per_host, hosts, chip, margin, spec=spec)


def gpu_of_kind(device_kind: str) -> GpuTarget | None:
    """The one-host target of the GPU whose spec reports `device_kind` (None if none does)."""
    for gpu, (spec, _) in GPUS.items():
        try:
            if device_kind_of(spec_path(spec).read_text()) == device_kind:
                return gpu_target(f"{gpu}-8")
        except ShardkitError:
            continue
    return None


register_family(is_gpu_name, gpu_target, gpu_of_kind, example_names)

__all__ = ["GPUS", "GPU_HBM_MARGIN", "GpuTarget", "cuda_missing", "gpu_of_kind", "gpu_target", "is_gpu_name"]
