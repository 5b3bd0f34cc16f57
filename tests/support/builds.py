"""The NVRTC builds the kernel-source and cubin tests inspect: which ``(spec, architecture)``
pairs the default run compiles and which only the ``slow`` run does, and each build done once
per session, started early in worker processes (conftest.py's ``pytest_collection_finish``
calls ``start_prebuilds``)."""

from __future__ import annotations

import collections
import functools
import importlib
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor

import pytest

from metrale_attn import kernels
from metrale_attn.config import SIMT_HEAD_DIMS
from metrale_attn.targets import TARGETS

ARCHES = tuple(sorted({t.arch for t in TARGETS.values()}, key=lambda a: int(a[3:])))
"""Every target's architecture: Ampere (sm_80, sm_86), Ada (sm_89), Hopper, Blackwell (sm_100,
sm_103) and consumer Blackwell (sm_120, sm_121)."""

SPOT_SPECS = (
    kernels.KernelSpec("unpacked", 256, "fp16", "bf16", "mma", 1, set(kernels.FEATURES)),  # most registers
    kernels.KernelSpec("splitk", 256, "fp16", "bf16", "mma", 1),
    kernels.KernelSpec("unpacked", 192, "fp16", "bf16", "mma", 2, set(kernels.FEATURES)),  # the widest 16-row dim
    kernels.KernelSpec("unpacked", 128, "fp16", "bf16", "mma", 2, set(kernels.FEATURES)),
    kernels.KernelSpec("unpacked", 128, "bf16", "fp8", "mma"),
    kernels.KernelSpec("splitk", 64, "fp16", "fp8", "mma"),  # 4-stage rings
    kernels.KernelSpec("gqa_packed", 256, "bf16", "fp8", "mma"),
    kernels.KernelSpec("unpacked", 128, "bf16", "fp8", "simt"),
    kernels.KernelSpec("splitk", 256, "fp16", "fp16", "simt"),
    kernels.KernelSpec("gqa_packed", 256, "bf16", "bf16", "simt"),
    kernels.KernelSpec("splitk", 512, "bf16", "fp8", "simt"),  # the widest simt row: 117..123 registers
    # simt multi-token at MLA's 576/512, fp16 cache: the most registers of the simt specs (117..126)
    kernels.KernelSpec("splitk", 576, "fp16", "fp16", "simt", features={"multi_token"}, v_head_dim=512),
)
"""The specs the default run also compiles for every other architecture (the heaviest of
each implementation and arm); the whole matrix is behind the ``slow`` marker."""


FAMILY_HEADS = ("sm_90", "sm_100", "sm_120")
"""The first architecture of each family: the default run compiles every spot spec for
these, and the two heaviest for the rest (sm_103, sm_121 differ from their family's head
in a few instructions' availability, not in the kernels' code paths)."""


SPOT_ONLY_ARCHES = ("sm_86", "sm_103", "sm_121")
"""Architectures whose slow column is the spot specs alone: each shares its code paths with
another's full column (sm_80, sm_100, sm_120; sm_89 keeps its own for the fp8 cvt)."""


def _sm90_sample() -> set:
    """One plain spec per (impl, arm, head_dim, kv dtype, row tiles) at the simt head dims
    (64, 128, 256, 512), the first in ``all_specs`` order: the q dtype changes only q's conversion,
    which the spot specs and the slow matrix cover. The mma core's other head dims take the
    same code with padding steps skipped at compile time: one spec per (arm, kv dtype, row
    tiles), each taking the head dim compiled least so far, so every one of them compiles."""
    sample, padded = {}, {}
    for v in kernels.all_specs():
        if v.features:
            continue
        if v.v_head_dim:  # MLA's 576/512: one spec an arm (bf16), the rest slow
            sample.setdefault((v.impl, v.arm, v.head_dim, v.v_head_dim), v)
        elif v.head_dim in SIMT_HEAD_DIMS:
            sample.setdefault((v.impl, v.arm, v.head_dim, v.kv_dtype, v.row_tiles), v)
        else:
            padded.setdefault((v.arm, v.kv_dtype, v.row_tiles), []).append(v)
    used = collections.Counter()
    for key, specs in sorted(padded.items()):
        head_dim = min({v.head_dim for v in specs}, key=lambda d: (used[d], d))  # the least compiled so far
        used[head_dim] += 1
        sample[key] = next(v for v in specs if v.head_dim == head_dim)
    return set(sample.values())


def arch_matrix():
    """``(spec, arch)`` test parameters: a sample of the plain specs for sm_90
    (``_sm90_sample``), the spot specs (feature-bearing ones among them) for each
    family's first architecture and the two heaviest for the others, the rest marked
    ``slow`` (``.ci/run`` runs them). The padded head dims (80, 96, 112, ...: the code of
    64/128/256 with padding steps skipped at compile time) are in sm_90's column only, and
    in the others' through the spot specs: an architecture differs in instructions, which the
    simt head dims' specs cover, not in head dims (every padded dim on every architecture
    would be ~5,000 more NVRTC builds, past CI's budget). sm_86, sm_103 and sm_121 (the
    same code paths as sm_80, sm_100 and sm_120, ``FAMILY_HEADS``) build the spot specs only."""
    params, sample = [], _sm90_sample()
    for arch in ARCHES:
        for v in kernels.all_specs():
            if not v.builds_for(arch):  # an fp8 mma spec before sm_89 (the target falls back to simt)
                continue
            if arch in SPOT_ONLY_ARCHES and v not in SPOT_SPECS:
                continue
            if arch != "sm_90" and v.head_dim not in SIMT_HEAD_DIMS and not v.v_head_dim and v not in SPOT_SPECS:
                continue
            spot = v in (SPOT_SPECS if arch in FAMILY_HEADS else SPOT_SPECS[:2])
            slow = not (spot or (arch == "sm_90" and v in sample))
            params.append(pytest.param(v, arch, id=f"{v.name}-{arch}", marks=[pytest.mark.slow] if slow else []))
    return params


def spec_matrix():
    """Every spec as a test parameter, the sm_90 column of ``arch_matrix``."""
    return [pytest.param(p.values[0], id=p.values[0].name, marks=p.marks) for p in arch_matrix()
            if p.values[1] == "sm_90"]


def nvrtc_build(spec, arch: str):
    """``(cubin, ptxas -v log)`` of ``spec`` for ``arch`` through the backend's own NVRTC
    path, compiled once per test session (several test files inspect the same builds)."""
    return _nvrtc_build(spec, arch)[:2]


def nvrtc_ptx(spec, arch: str = "sm_90") -> str:
    """The PTX of the same compile as ``nvrtc_build``."""
    ptx = _nvrtc_build(spec, arch)[2]
    return ptx.decode() if isinstance(ptx, bytes) else ptx


@functools.cache
def _nvrtc_build(spec, arch: str):
    future = _PREBUILDS.pop((spec, arch), None)
    if future is not None and not future.cancel():  # running or done in a worker: wait for it
        return future.result()
    return _nvrtc_compile(spec, arch)


def _nvrtc_compile(spec, arch: str):
    from metrale_attn.backends.cupy_backend import nvrtc_compile

    return nvrtc_compile(spec, arch, ptxas_verbose=True, with_ptx=True)  # as the workers do


_PREBUILDS: dict = {}
"""``(spec, arch)`` -> the future of its NVRTC build in a worker process."""


def start_prebuilds(session) -> None:
    """Start the NVRTC builds the selected tests will inspect (every ``arch_matrix`` and
    ``spec_matrix`` parameter) in worker processes, one core short of all, so they
    overlap the tests before them; ``_nvrtc_build`` takes a build from its worker, or does
    it itself when no worker has started it yet (the workers take them from the last, so
    the two meet in the middle). Only where CuPy's NVRTC is installed, and not inside a
    pytest-xdist worker."""
    wanted = {}
    for item in session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if isinstance(params.get("spec"), kernels.KernelSpec):
            wanted.setdefault((params["spec"], params.get("arch", "sm_90")), None)
    workers = (os.cpu_count() or 1) - 1
    if not wanted or not workers or _nvrtc_missing() or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # under pytest-xdist the workers are the parallelism (each would prebuild every spec)
    from metrale_attn.backends.cupy_backend import nvrtc_compile

    # spawn, not fork: the parent may hold CuPy's and the test threads' state; the task is a
    # partial of a package function, so the workers never import this file.
    compile_one = functools.partial(nvrtc_compile, ptxas_verbose=True, with_ptx=True)
    pool = ProcessPoolExecutor(max_workers=min(workers, len(wanted)), mp_context=multiprocessing.get_context("spawn"))
    for spec, arch in reversed(wanted):  # the workers from the last, the tests from the first
        _PREBUILDS[spec, arch] = pool.submit(compile_one, spec, arch)
    session.config.add_cleanup(lambda: pool.shutdown(wait=True, cancel_futures=True))


def _nvrtc_missing() -> bool:
    try:
        importlib.import_module("cuda.bindings.nvrtc")  # how the backend calls NVRTC
    except ImportError:
        return True
    return False


needs_nvrtc = pytest.mark.skipif(_nvrtc_missing(), reason="NVRTC (cuda-bindings) is not installed")
"""Only the tests that compile skip without cuda-bindings; the pure-Python ones always run."""

_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def spill_frames(log: str) -> list[tuple[str, str, str]]:
    """``(stack frame, spill stores, spill loads)`` bytes, as ptxas -v prints them, of each
    kernel of a build's log (``("0", "0", "0")``: every register array indexed by constants,
    nothing spilled)."""
    return _FRAME.findall(log)


TIGHTEST_DEFAULT_ARCHES = ("sm_90", "sm_120")
"""The architectures the default run builds a tiling's tightest specs for; the others are ``slow``."""


def tightest_spill_params(tightest, first) -> list:
    """``(spec, arch)`` test parameters of every feature at once, both arms, on every
    architecture that builds them: ``tightest`` rows ``(head dim, q, cache, row tiles, smem
    limit)``. The default run builds the ``first`` spec ``(arm, head dim, cache)`` for
    ``TIGHTEST_DEFAULT_ARCHES`` and the others for sm_90; the rest are ``slow`` (CI's slow step)."""
    from metrale_attn.config import FEATURES
    from metrale_attn.kernels import KernelSpec

    params = []
    for head_dim, q, kv, rt, limit in tightest:
        for arch in ARCHES:
            for arm in ("unpacked", "splitk"):
                spec = KernelSpec(arm, head_dim, q, kv, "mma", rt, set(FEATURES), smem_limit=limit)
                if not spec.builds_for(arch):  # fp8: sm_89 and later
                    continue
                slow = arch not in TIGHTEST_DEFAULT_ARCHES or (arm, head_dim, kv) != first and arch != "sm_90"
                params.append(pytest.param(spec, arch, id=f"{spec.name}-{arch}",
                                           marks=[pytest.mark.slow] if slow else []))
    return params
