"""The backend layer without a GPU: what each backend says about itself, and the CuPy backend's
stream wrappers (CuPy creates them without touching a device)."""

import types

import pytest

from cuda_on_cpu import build
from metrale_attn.backends import get_backend
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.cache import cache_root


def test_the_cpu_backend_has_no_device_and_says_its_times_are_an_emulators():
    backend = get_backend("cpu")
    assert isinstance(backend, CpuBackend)
    assert backend.device() is None and backend.emulated is True


def test_the_cpu_backend_builds_into_the_package_cache_whatever_the_shim_defaults_to(tmp_path, monkeypatch):
    """The shim has a cache of its own; metrale-attn's users keep theirs (cache_root()/cuda_on_cpu)."""
    monkeypatch.setenv("CUDA_ON_CPU_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_MEMO", {})
    source = 'extern "C" __global__ void cached_here(float* out) { out[threadIdx.x] = 1.0f; }\n'
    CpuBackend().load(types.SimpleNamespace(name="cached_here", source=lambda: source, defines=dict))
    assert list((cache_root() / "cuda_on_cpu").glob("cached_here-*.so")) and not any(tmp_path.iterdir())


def test_a_raw_stream_handle_maps_to_one_wrapper_and_a_bounded_number_of_handles_are_kept():
    """DecodeAttention notices a stream change by identity, so the same handle must give the
    same wrapper; handles are the caller's, so the backend keeps only the most recent ones."""
    pytest.importorskip("cupy", reason="CuPy is not installed")
    from metrale_attn.backends.cupy_backend import MAX_EXTERNAL_STREAMS, CupyBackend

    backend = CupyBackend()
    assert backend.emulated is False
    first = backend.launch_stream(0x1000)
    assert first.ptr == 0x1000 and backend.launch_stream(0x1000) is first
    wrappers = [backend.launch_stream(0x1000 + i) for i in range(1, MAX_EXTERNAL_STREAMS + 1)]
    assert all(backend.launch_stream(0x1000 + i) is w for i, w in enumerate(wrappers, 1))
    again = backend.launch_stream(0x1000)  # the oldest handle was let go: a new, equivalent wrapper
    assert again is not first and again.ptr == first.ptr
    assert CupyBackend().launch_stream(0x2000) is not backend.launch_stream(0x2000)  # per backend
