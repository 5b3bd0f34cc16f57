"""The backends a test case runs on, and its arrays there: the CPU backend always, and CuPy on a
CUDA device, marked ``gpu`` (``pytest -m gpu tests/`` selects exactly these runs) and skipped
cleanly where there is none. conftest.py's ``backend`` fixture runs a test once on each; a test
whose cases differ between the two parametrizes ``backend`` itself (``on_backends``)."""

from __future__ import annotations

import numpy as np
import pytest

from metrale_attn.backends import cuda_available
from metrale_attn.backends.cpu_backend import CpuBackend

CPU, GPU = "cpu", "cupy"

ON_GPU = (pytest.mark.gpu, pytest.mark.skipif(not cuda_available(), reason="no CUDA device"))
"""The marks of every run on the device: selected by ``-m gpu``, skipped without a CUDA device."""

BACKENDS = (pytest.param(CPU, id=CPU), pytest.param(GPU, id=GPU, marks=ON_GPU))
"""The ``backend`` parameters: a case once on the CPU backend, once on the device."""


def on_backends(cpu_cases, gpu_cases) -> list:
    """``(backend, *values)`` parameters: ``cpu_cases`` on the CPU backend, ``gpu_cases`` on the
    device (each a list of ``pytest.param``), ids prefixed with the backend's name."""
    def on(backend, case, marks=()):
        return pytest.param(backend, *case.values, id=f"{backend}-{case.id}", marks=[*case.marks, *marks])

    return [on(CPU, c) for c in cpu_cases] + [on(GPU, c, ON_GPU) for c in gpu_cases]


def on_host(backend) -> bool:
    """Whether ``backend`` (a name or a backend object) launches on host memory: the CPU backend."""
    return backend == CPU if isinstance(backend, str) else backend.current_device() is None


def device_array(array: np.ndarray):
    """A CuPy copy of a NumPy array (fp8 as its uint8 bits)."""
    import cupy

    return cupy.asarray(array.view(np.uint8) if array.dtype.itemsize == 1 else array)


def to_backend(backend, array):
    """``array`` where ``backend``'s kernels read it: the NumPy array itself on the CPU backend
    (never copied), a CuPy copy on the device; None stays None."""
    return array if array is None or on_host(backend) else device_array(array)


def to_host(array) -> np.ndarray:
    """An output as NumPy: the array itself from the CPU backend, a copy from the device."""
    if isinstance(array, np.ndarray):
        return array
    import cupy

    return cupy.asnumpy(array)


class SpecRecorder(CpuBackend):
    """A CPU backend that records the spec name of every launch, in order (``specs``)."""

    def __init__(self):
        super().__init__()
        self.specs = []

    def load(self, spec):
        module, specs = super().load(spec), self.specs

        class Recording:
            def launch(self, launch):
                specs.append(spec.name)
                module.launch(launch)

        return Recording()

