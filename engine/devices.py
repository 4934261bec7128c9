"""Where a model's layers go: the devices llama.cpp's backends found (engine/llama.py lists them)
and the flags llama-server has (`--n-gpu-layers`, `--device`, `--split-mode`, `--tensor-split`,
`--main-gpu`, `--no-kv-offload`), resolved into what llama.cpp's model parameters take.

`auto` offloads as many layers as the chosen devices' free memory holds, each layer with its
weights and (unless --no-kv-offload) its KV, keeping 1 GiB of each device free for compute
buffers and others, as llama-server's own fitting does by default.

Each worker process loads its own copy of the layers and has its own KV. With several workers
and several devices, each worker takes one device (worker i the i-th, round the list), so that
they decode side by side sharing the host's pool; workers on the same device divide its free
memory. llama.cpp reserves everything a worker's device needs when it starts (the weights, KV
for every cell, compute buffers for the largest batch), so a worker that starts cannot run out
later; a count of layers that cannot fit is refused before anything is allocated."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.config import Offload

DEVICE_HEADROOM = 1 << 30  # bytes kept free on each device (llama-server's --fit-target)


@dataclass(frozen=True)
class Device:
    name: str  # llama.cpp's: Vulkan0, CUDA0, Metal
    description: str
    kind: str  # "gpu", "igpu" (host memory), "cpu" or "accel" (used beside the CPU: BLAS)
    free: int  # bytes
    total: int

    @property
    def offloads(self) -> bool:
        """Layers can be placed on it (llama-server's --device takes no CPU device)."""
        return self.kind in ("gpu", "igpu")

    def describe(self) -> str:
        return f"{self.name} ({self.description}, {self.free >> 20} of {self.total >> 20} MiB free)"


@dataclass(frozen=True)
class ModelShape:
    """What placing a model needs to know of it, read before its weights are loaded."""

    n_layer: int
    weight_bytes: int  # the GGUF's size
    kv_bytes_per_layer: int  # one layer's K and V for every cell of the worker's contexts


@dataclass(frozen=True)
class Placement:
    """What llama.cpp's model parameters take."""

    gpu_layers: int  # of n_layer + 1 (the output layer counts as one more, as in llama.cpp)
    devices: tuple[Device, ...]  # those offloaded to; () with gpu_layers 0
    split_mode: str
    tensor_split: tuple[float, ...]
    main_gpu: int
    kv_offload: bool
    why: str  # for the start-up log

    @property
    def on_device(self) -> bool:
        return self.gpu_layers > 0


class PlacementError(ValueError):
    """The flags name what is not there: a device, a main GPU past the list, a split longer
    than the devices."""


def place(offload: Offload, found: list[Device], shape: Callable[[], ModelShape],
          worker: int = 0) -> Placement:
    """Where worker `worker` (of offload.workers) puts its layers. `shape` is read only when
    there is a device to place layers on: without one (a CPU build, or no GPU found) the
    model's file is not opened twice."""
    devices = _chosen(offload, found)
    if offload.tensor_split and len(offload.tensor_split) > max(len(devices), 1):
        raise PlacementError(f"--tensor-split has {len(offload.tensor_split)} shares for "
                             f"{len(devices)} device(s)")
    if devices and not 0 <= offload.main_gpu < len(devices):
        raise PlacementError(f"--main-gpu {offload.main_gpu}: there are {len(devices)} "
                             "device(s), counted from 0")
    if offload.split_mode == "none" and devices:
        devices = [devices[offload.main_gpu]]  # llama.cpp then puts every layer there
    sharing, tensor_split, main_gpu, seat = offload.workers, offload.tensor_split, \
        0 if offload.split_mode == "none" else offload.main_gpu, ""
    if offload.workers > 1 and len(devices) > 1:  # one device a worker
        sharing = len(range(worker % len(devices), offload.workers, len(devices)))
        devices, tensor_split, main_gpu = [devices[worker % len(devices)]], (), 0
        seat = f"worker {worker} of {offload.workers} on a device of its own; " if sharing == 1 \
            else f"worker {worker} of {offload.workers} on a device shared by {sharing}; "
    elif offload.workers > 1 and devices:
        seat = f"{offload.workers} workers share the device; "
    if not devices:
        return Placement(0, (), offload.split_mode, offload.tensor_split, 0,
                         offload.kv_offload,
                         "no GPU device" if offload.devices is None else "--device none")
    model = shape()
    all_layers = model.n_layer + 1
    per_layer = model.weight_bytes / all_layers + \
        (model.kv_bytes_per_layer if offload.kv_offload else 0)
    free = sum(d.free for d in devices) // sharing  # this worker's part
    if offload.gpu_layers == "auto":
        room = sum(max(d.free - DEVICE_HEADROOM, 0) for d in devices) // sharing
        layers = min(int(room // per_layer), all_layers) if per_layer else all_layers
        why = f"--n-gpu-layers auto: {layers} of {all_layers} fit in the free memory"
    else:
        layers = all_layers if offload.gpu_layers == "all" else \
            min(int(offload.gpu_layers), all_layers)
        why = f"--n-gpu-layers {offload.gpu_layers}"
        if layers * per_layer > free:
            raise PlacementError(
                f"--n-gpu-layers {offload.gpu_layers}: {layers} layers "
                f"{'with their KV ' if offload.kv_offload else ''}need about "
                f"{layers * per_layer / 2**20:.0f} MiB on {', '.join(d.name for d in devices)}"
                f", which {'has' if len(devices) == 1 else 'have'} {free >> 20} MiB free"
                f"{f' for each of {sharing} workers' if sharing > 1 else ''}: offload fewer "
                "layers (or auto), lower --ctx-size, or keep the KV in host memory "
                "(--no-kv-offload)")
    return Placement(layers, tuple(devices) if layers else (), offload.split_mode,
                     tensor_split, main_gpu, offload.kv_offload, seat + why)


def _chosen(offload: Offload, found: list[Device]) -> list[Device]:
    """The devices layers may go to: those named, or every GPU llama.cpp found."""
    if offload.devices is None:
        return [d for d in found if d.offloads]
    by_name = {d.name: d for d in found}
    for name in offload.devices:
        if name not in by_name or not by_name[name].offloads:
            known = ", ".join(d.name for d in found if d.offloads) or "none"
            raise PlacementError(f"--device {name}: no such GPU device (found: {known})")
    return [by_name[name] for name in offload.devices]
