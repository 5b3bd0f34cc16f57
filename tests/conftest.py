"""Shared helpers: build a problem, run it through DecodeAttention, check it against the reference."""

from __future__ import annotations

import functools
import importlib
import multiprocessing
import os
import re
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from metrale_attn import DecodeAttention, kernels, policy, tolerance
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.problems import Problem, make_problem
from metrale_attn.config import LayerConfig, ModelShape
from metrale_attn.targets import TARGETS, TargetPolicy

TOYS = Path(__file__).parent / "toy_kernels"

REQUIRE_TORCH = "METRALE_ATTN_REQUIRE_TORCH"
"""Set (to 1) by ``.ci/run``: there a missing torch fails the torch tests instead of skipping them."""


def import_torch():
    """``torch``, or a skip where it is not installed; where ``METRALE_ATTN_REQUIRE_TORCH``
    is set (CI), a missing torch is an error, so the torch tests can never be skipped there."""
    if os.environ.get(REQUIRE_TORCH, "").strip() not in ("", "0"):
        import torch

        return torch
    return pytest.importorskip("torch")


REQUIRE_VLLM = "METRALE_ATTN_REQUIRE_VLLM"
"""Set (to 1) by ``.ci/run`` in its vLLM venv: there a missing vLLM fails the vLLM tests."""


def import_vllm():
    """``vllm``, or a skip where it is not installed (the main venv); where
    ``METRALE_ATTN_REQUIRE_VLLM`` is set (CI's vLLM venv), a missing vLLM is an error."""
    if os.environ.get(REQUIRE_VLLM, "").strip() not in ("", "0"):
        import vllm

        return vllm
    return pytest.importorskip("vllm")


def toy_source(name: str) -> str:
    """tests/toy_kernels/<name>.cu as the dispatch code compiles a kernel: a ``#line 1`` directive in front
    and each ``#include "x.cuh"`` of kernels_cu/ inlined with ``#line`` directives (metrale_attn.kernels.inline),
    so errors name the real file and line on both backends."""
    path = f"tests/toy_kernels/{name}.cu"
    lines = (TOYS / f"{name}.cu").read_text().split("\n")
    out = [f'#line 1 "{path}"']
    for number, line in enumerate(lines, 1):
        include = re.fullmatch(r'\s*#\s*include\s*"([^"]+\.cuh)"\s*', line)
        out += [kernels.inline(include.group(1)), f'#line {number + 1} "{path}"'] if include else [line]
    return "\n".join(out)


@pytest.fixture(autouse=True)
def _fresh_gqa_gate():
    """The GQA gate is resolved once per process; each test starts from the environment it sets."""
    policy.gqa_pack_enabled.cache_clear()
    yield
    policy.gqa_pack_enabled.cache_clear()


ARM_OPTIONS = {
    "unpacked": dict(splitk="off", gqa_pack=False),
    "splitk": dict(splitk="auto", gqa_pack=False),
    "gqa_packed": dict(splitk="off", gqa_pack=True),
}


def layer_config(target_policy: TargetPolicy, shape: ModelShape, *, max_batch: int, page_size: int = 16, q_dtype="bf16",
                 kv_dtype="bf16", **fields) -> LayerConfig:
    """A ``LayerConfig`` for plan tests (its fields taken as valid, as ``configure`` leaves them)."""
    return LayerConfig(shape, page_size, q_dtype, kv_dtype, max_batch, target_policy, **fields)


def problem(*, seed=0, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, seq_lens=(0, 1, 37),
            kv_dtype="bf16", q_dtype="bf16", layout="NHD", **kwargs):
    return make_problem(
        np.random.default_rng(seed), num_seqs=len(seq_lens), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, seq_lens=list(seq_lens), kv_dtype=kv_dtype, q_dtype=q_dtype,
        layout=layout, **kwargs)


def decoder(p: Problem, *, max_batch=None, backend="cpu", **options) -> DecodeAttention:
    return DecodeAttention(
        p.q.shape[1], p.k_cache.shape[2] if p.kv_layout == "NHD" else p.k_cache.shape[1], p.q.shape[2],
        p.k_cache.shape[1] if p.kv_layout == "NHD" else p.k_cache.shape[2],
        q_dtype=p.q.dtype, kv_dtype=p.k_cache.dtype, kv_layout=p.kv_layout,
        max_batch=max_batch or max(len(p.seq_lens), 1), backend=backend, **options)


def run_poisoned(attn: DecodeAttention, p: Problem, **kwargs):
    """Run with out and lse pre-filled with NaN, so anything the kernel fails to write shows."""
    n, h, d = p.q.shape
    out = np.full((n, h, d), np.nan, dtype=p.q.dtype)
    lse = np.full((n, h), np.nan, dtype=np.float32)
    attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scale=p.k_scale, v_scale=p.v_scale,
             out=out, lse=lse, **kwargs)
    return out, lse


def check_against_reference(p: Problem, out, lse, sm_scale=None):
    """``out`` within the bar of the float64 reference (the near-zero allowance from the
    problem's max|V| and max|s|), ``lse`` -inf for empty rows and within 2e-6 elsewhere."""
    ref_out, ref_lse = p.reference(return_lse=True, sm_scale=sm_scale)
    tolerance.assert_close_to_reference(out, ref_out, v_absmax=p.v_absmax(),
                                        logit_absmax=lambda: p.logit_absmax(sm_scale=sm_scale))
    empty = p.seq_lens == 0
    assert np.all(np.isneginf(lse[empty]))
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=2e-6, atol=2e-6)


ARCHES = tuple(sorted({t.arch for t in TARGETS.values()}, key=lambda a: int(a[3:])))
"""Every target's architecture: Ampere (sm_80, sm_86), Ada (sm_89), Hopper, Blackwell (sm_100,
sm_103) and consumer Blackwell (sm_120, sm_121)."""

SPOT_SPECS = (
    kernels.KernelSpec("unpacked", 256, "fp16", "bf16", "mma", 1, set(kernels.FEATURES)),  # most registers
    kernels.KernelSpec("splitk", 256, "fp16", "bf16", "mma", 1),
    kernels.KernelSpec("unpacked", 128, "fp16", "bf16", "mma", 2, set(kernels.FEATURES)),
    kernels.KernelSpec("unpacked", 128, "bf16", "fp8", "mma"),
    kernels.KernelSpec("splitk", 64, "fp16", "fp8", "mma"),  # 4-stage rings
    kernels.KernelSpec("gqa_packed", 256, "bf16", "fp8", "mma"),
    kernels.KernelSpec("unpacked", 128, "bf16", "fp8", "simt"),
    kernels.KernelSpec("splitk", 256, "fp16", "fp16", "simt"),
    kernels.KernelSpec("gqa_packed", 256, "bf16", "bf16", "simt"),
)
"""The specs the default run also compiles for every other architecture (the heaviest of
each implementation and arm); the whole matrix is behind the ``slow`` marker."""


FAMILY_HEADS = ("sm_90", "sm_100", "sm_120")
"""The first architecture of each family: the default run compiles every spot spec for
these, and the two heaviest for the rest (sm_103, sm_121 differ from their family's head
in a few instructions' availability, not in the kernels' code paths)."""


def _sm90_sample() -> set:
    """One plain spec per (impl, arm, head_dim, kv dtype, row tiles), the first in
    ``all_specs`` order: the q dtype changes only q's conversion, which the spot
    specs and the slow matrix cover."""
    sample = {}
    for v in kernels.all_specs():
        if not v.features:
            sample.setdefault((v.impl, v.arm, v.head_dim, v.kv_dtype, v.row_tiles), v)
    return set(sample.values())


def arch_matrix():
    """``(spec, arch)`` test parameters: a sample of the plain specs for sm_90
    (``_sm90_sample``), the spot specs (feature-bearing ones among them) for each
    family's first architecture and the two heaviest for the others, the rest marked
    ``slow`` (``.ci/run`` runs them)."""
    params, sample = [], _sm90_sample()
    for arch in ARCHES:
        for v in kernels.all_specs():
            if not v.builds_for(arch):  # an fp8 mma spec before sm_89 (the target falls back to simt)
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


def pytest_collection_finish(session):
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
        importlib.import_module("cupy_backends.cuda.libs.nvrtc")
    except ImportError:
        return True
    return False


class CountingBackend(CpuBackend):
    """A CPU backend that records every spec it loads and every launch (and so proves a
    refusal launched nothing)."""

    def __init__(self):
        super().__init__()
        self.launches = []
        self.loaded = []

    def load(self, spec):
        self.loaded.append(spec.name)
        module, record = super().load(spec), self.launches

        class Counting:
            def launch(self, launch):
                record.append(launch.kernel)
                module.launch(launch)

        return Counting()
