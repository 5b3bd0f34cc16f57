"""The device-to-device copy bandwidth: the ceiling every "% of copy" figure is taken against.

A ``copy_gib`` GiB buffer is copied ``repeats`` times with ``cudaMemcpyAsync`` on one stream,
each copy timed with CUDA events; the bandwidth is (bytes read + bytes written) / median time,
in DECIMAL terabytes per second (1 TB/s = 1e12 B/s). A decode call's ratio to it is its bytes
moved over its time, over this. On the CPU it times ``numpy.copyto`` of a host buffer instead,
labelled as such: it says nothing about a GPU.
"""

from __future__ import annotations

import statistics
import time

TB = 1e12  # decimal terabyte
GIB = 1 << 30


def measure_copy_bandwidth(*, cpu: bool = False, copy_gib: float = 4.0, repeats: int = 10, warmup: int = 3) -> dict:
    """Copy bandwidth in decimal TB/s: (bytes read + bytes written) / median seconds."""
    return _copy_cpu(copy_gib, repeats) if cpu else _copy_gpu(copy_gib, repeats, warmup)


def _copy_gpu(copy_gib: float, repeats: int, warmup: int) -> dict:
    import cupy

    nbytes = int(copy_gib * GIB)
    stream = cupy.cuda.Stream(non_blocking=True)
    src = cupy.empty(nbytes, dtype=cupy.uint8)
    dst = cupy.empty(nbytes, dtype=cupy.uint8)
    D2D = 3  # cudaMemcpyDeviceToDevice
    with stream:
        src.fill(1)
        dst.fill(0)
    samples_ms = []
    for i in range(warmup + repeats):
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record(stream)
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, D2D, stream.ptr)
        end.record(stream)
        end.synchronize()
        if i >= warmup:
            samples_ms.append(cupy.cuda.get_elapsed_time(start, end))
    median_s = statistics.median(samples_ms) / 1e3
    moved = 2 * nbytes  # every byte is read once and written once
    del src, dst
    cupy.get_default_memory_pool().free_all_blocks()
    return {
        "method": f"cudaMemcpyAsync device-to-device of {copy_gib:g} GiB, CUDA events, median of {repeats} "
                  f"after {warmup} warm-up copies; bytes read + written",
        "bytes_moved": moved,
        "median_s": median_s,
        "samples_ms": [round(s, 4) for s in samples_ms],
        "tb_per_s": moved / median_s / TB,
    }


def _copy_cpu(copy_gib: float, repeats: int) -> dict:
    import numpy as np

    nbytes = int(min(copy_gib, 1 / 16) * GIB)  # 64 MiB at most on the host
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.zeros(nbytes, dtype=np.uint8)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - t0)
    median_s = statistics.median(samples)
    return {
        "method": f"numpy.copyto of {nbytes / GIB:g} GiB in host memory, median of {repeats}; bytes read + "
                  "written (host memory, NOT a GPU figure)",
        "bytes_moved": 2 * nbytes,
        "median_s": median_s,
        "samples_ms": [round(s * 1e3, 4) for s in samples],
        "tb_per_s": 2 * nbytes / median_s / TB,
    }
