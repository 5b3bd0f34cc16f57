"""Backends: where a plan's kernels are compiled and launched.

Both backends take the same launch description (``Launch``: kernel name, 3-D grid,
3-D block, dynamic shared bytes, arguments) and hand out the same array
description (``ArrayInfo``), so the dispatch above them is written and tested once.

- ``cupy``: cubins compiled by NVRTC (no ``-ftz``), loaded by ``cupy.RawModule`` on a CUDA device.
- ``cpu``: the same sources built with the host C++ compiler against the
  CUDA-on-CPU shim (the package ``cuda_on_cpu``); NumPy arrays. For tests and demos.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional, Protocol

BACKENDS = ("cupy", "cpu")


def refuse_unstrided(tensor, argument: str) -> None:
    """A torch tensor whose layout is not strided (sparse, mkldnn, ...) has no data pointer a
    kernel could read: refused naming the argument (torch's own error, "Cannot access data
    pointer", names none). Both backends call this before they read a tensor's pointer."""
    layout = getattr(tensor, "layout", None)
    if layout is not None and str(layout) != "torch.strided":
        name = str(layout).removeprefix("torch.").lstrip("_")
        raise TypeError(f"{argument} must be a strided (dense) torch tensor, got a {name} tensor, which has no data "
                        "pointer to launch on: pass a strided one (.to_dense() makes one)")


class Launch(NamedTuple):
    """One kernel launch. ``args`` are typed NumPy scalars and pointers (``Backend.pointer``).

    A named tuple rather than a dataclass: ``run`` builds these on the host's hot path,
    and a frozen dataclass costs several times more to construct."""

    kernel: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: tuple
    dependent: bool = False
    """Launched as the programmatic dependent of the launch before it in the stream, where the
    device has programmatic dependent launch (sm_90 and later; elsewhere, and on the CPU, a plain
    launch): it may start before that one ends, and its kernel waits on the device
    (``pd_wait_prior_grids``) before it reads what that one wrote."""


class ArrayInfo(NamedTuple):
    """What the launcher needs of an array, whatever library holds it (a named tuple, cheap
    to build: ``run`` describes every new buffer).

    ``strides`` are in elements; ``dtype`` is the library's own dtype object or
    name; ``device`` is a device ordinal, or ``None`` for host memory;
    ``writable`` is False for a read-only NumPy array (or a read-only
    ``__cuda_array_interface__``).
    """

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: Any
    itemsize: int
    device: Optional[int]
    writable: bool = True

    def byte_range(self) -> Optional[tuple[int, int]]:
        """``(first, end)``: the addresses from the lowest byte of any element to one past
        the highest (a hull: a strided view spans its gaps too); None when empty."""
        shape, strides = self.shape, self.strides
        if 0 in shape:
            return None
        low = high = 0  # element offsets of the lowest and highest elements
        for i in range(len(shape)):  # run() asks this of every array: a plain loop is the fastest
            reach = (shape[i] - 1) * strides[i]
            if reach < 0:
                low += reach
            else:
                high += reach
        return self.ptr + low * self.itemsize, self.ptr + (high + 1) * self.itemsize


@dataclass(frozen=True)
class DeviceInfo:
    """The GPU a backend launches on: what the target and the compiled architecture are read from."""

    ordinal: int
    compute_capability: tuple[int, int]  # (major, minor): (9, 0) is sm_90
    sm_count: int
    name: str  # the driver's, e.g. "NVIDIA H200"


class Module(Protocol):
    def launch(self, launch: Launch) -> None: ...


class Backend(Protocol):
    name: str
    always_check_indices: bool
    emulated: bool
    """True where launches run on an emulation of the GPU (the CPU backend): its times
    measure the emulator, not a kernel."""

    def device(self) -> Optional[DeviceInfo]:
        """The current GPU, or None (no GPU: the target's table stands in)."""

    def load_many(self, specs) -> list:
        """``[load(v) for v in specs]``, in order; a backend may build them concurrently."""

    def load(self, spec) -> Module:
        """Compile (or fetch from cache) one kernel spec."""

    def uncached(self, specs) -> list:
        """The specs among ``specs`` that ``load`` would compile (in neither this process nor
        the on-disk cache): asked before ``load_many`` so that a cold compile is announced."""

    def describe(self, array, argument: str) -> ArrayInfo:
        """Pointer, shape, strides and dtype of an array this backend can launch on."""

    def fingerprint(self, array) -> Optional[tuple]:
        """A cheap hashable tuple that is equal for two arrays only if ``describe`` would
        describe them alike, or None when this backend cannot tell cheaply (then ``run``
        describes every call). Its first item stands for the address (the pointer, or
        the object's ``id`` when that object's pointer cannot change: the caller then
        keeps the object alive beside it); the rest is the layout (shape, strides,
        dtype, device, writability), so equal tails mean ``moved`` may describe it."""

    def moved(self, info: ArrayInfo, array) -> ArrayInfo:
        """``describe(array)``, for an array whose fingerprint past its first item equals
        that of the array ``info`` describes (same layout, maybe another address): only
        the pointer is read."""

    def empty(self, shape: tuple[int, ...], dtype, like=None):
        """An uninitialized array on this backend (in ``like``'s library when given)."""

    def pointer(self, array, info: Optional[ArrayInfo] = None) -> Any:
        """The launch argument for a pointer parameter (``None`` -> null); ``info``
        is ``describe(array)`` when the caller already has it."""

    def launch_stream(self, stream, like=None):
        """A context manager under which launches go to ``stream`` (``None``: the
        caller's current stream, torch's when ``like`` is a torch tensor)."""

    def current_stream(self) -> Any:
        """The stream launches go to now (inside ``launch_stream``), as an object that
        stays the same object while the stream does; None where launches are synchronous."""

    def stream_busy(self, previous, current) -> bool:
        """Whether ``previous`` (a ``current_stream`` value) may still be running work
        queued before now, seen from ``current``; False when it cannot tell cheaply
        and safely (either stream is capturing a CUDA graph, or the query fails)."""

    def current_device(self) -> Optional[int]:
        """The device launches go to (``None``: host memory)."""

    def upload(self, array):
        """A backend array holding a copy of the NumPy ``array``."""

    def verify_mma(self) -> list[str]:
        """The PTX instructions of the ``mma`` kernels whose results on this backend
        disagree with what the kernels were verified against (empty: trust them)."""

    def host_copy(self, array):
        """A NumPy copy, for the optional full index validation."""

    def synchronize(self) -> None:
        """Wait for every launch so far (timing, demos)."""


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    try:
        import cupy
    except Exception:
        return False
    try:
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


NVIDIA_DEVICE_FILES = ("/dev/nvidia0", "/proc/driver/nvidia/gpus")
"""Where an NVIDIA driver shows a GPU, whether or not CuPy is installed."""


def gpu_present(paths=NVIDIA_DEVICE_FILES) -> Optional[str]:
    """The first of ``paths`` that exists (a GPU's driver is loaded here), or None."""
    return next((path for path in paths if os.path.exists(path)), None)


def get_backend(name: Optional[str] = None) -> Backend:
    """The named backend, or the best one present: CuPy with a GPU, else the CPU.

    ``None`` on a machine that has an NVIDIA GPU (``gpu_present``) but no usable CuPy is
    an error, not the CPU emulator (a thousand times slower): it names the install line;
    ``backend="cpu"`` asks for the emulator on purpose."""
    if name is None:
        if cuda_available():
            name = "cupy"
        elif gpu_present():
            raise RuntimeError(
                f"this machine has an NVIDIA GPU ({gpu_present()}) but CuPy is not installed or sees no device: "
                "pip install 'metrale-attn[cuda12]' (or [cuda13], to match the driver), or pass backend='cpu' to "
                "run the CPU emulator on purpose (a test backend, about a thousand times slower)")
        else:
            name = "cpu"
    if name == "cupy":
        if not cuda_available():
            raise ValueError("backend 'cupy' needs CuPy and a visible CUDA device; none is here (use backend='cpu')")
        from .cupy_backend import CupyBackend

        return CupyBackend()
    if name == "cpu":
        from .cpu_backend import CpuBackend

        return CpuBackend()
    raise ValueError(f"backend must be one of {', '.join(BACKENDS)} or None; got {name!r}")
