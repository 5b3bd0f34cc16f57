"""What the package says under the ``metrale_attn`` logger: each compile (spec, where, seconds,
cache hit or miss), each fallback (simt, a cache directory it cannot use), the plan chosen at
construction (DEBUG), and a compile that is taking long, while it runs (INFO)."""

from __future__ import annotations

import logging
import time
import types

import pytest

from cuda_on_cpu import build
from metrale_attn import attention
from metrale_attn.backends.cpu_backend import CpuBackend

from support.problems import decoder, problem

P = problem(seed=31, seq_lens=(5, 40), num_q_heads=4, num_kv_heads=2)


def stand_in(name: str):
    """What ``CpuBackend.load`` reads of a spec (its name, source and defines), for a one-line kernel."""
    source = f'extern "C" __global__ void {name}(float* out) {{ out[threadIdx.x] = 1.0f; }}\n'
    return types.SimpleNamespace(name=name, source=lambda: source, defines=dict)


def test_a_construction_logs_its_target_variants_and_plans_at_debug(caplog):
    with caplog.at_level(logging.DEBUG, logger="metrale_attn"):
        decoder(P, max_batch=4)
    (record,) = [r for r in caplog.records if r.name == "metrale_attn.attention" and r.levelno == logging.DEBUG]
    text = record.getMessage()
    assert "DecodeAttention 4/2/64, page 16" in text and "impl mma" in text and "decode_splitk_" in text
    assert "batch 1: auto: ceil(2 x 132 SMs / 4 q heads)" in text


def test_each_cpu_compile_logs_its_variant_seconds_and_whether_the_cache_had_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("METRALE_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_MEMO", {})
    with caplog.at_level(logging.DEBUG, logger="metrale_attn"):
        CpuBackend().load(stand_in("logged"))
        monkeypatch.setattr(build, "_MEMO", {})  # a new process: only the disk cache is left
        CpuBackend().load(stand_in("logged"))
    lines = [r.getMessage() for r in caplog.records if r.name == "metrale_attn.backends.cpu_backend"]
    assert len(lines) == 2
    assert lines[0].startswith("compiled logged for the CPU backend") and "cache miss" in lines[0]
    assert " s (cache miss" in lines[0] and str(tmp_path) in lines[0]
    assert lines[1].startswith("loaded logged for the CPU backend from the cache (hit")


def test_a_compile_still_running_after_the_threshold_says_so_while_it_runs(monkeypatch, caplog):
    class SlowBuilds(CpuBackend):
        def load_many(self, specs):
            time.sleep(0.3)
            return super().load_many(specs)

    monkeypatch.setattr(attention, "SLOW_COMPILE_S", 0.05)
    with caplog.at_level(logging.INFO, logger="metrale_attn"):
        decoder(P, backend=SlowBuilds())
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos[0].startswith("still compiling 1 kernel spec(s) for sm_90 (decode_splitk_")
    assert infos[-1].startswith("done compiling 1 kernel spec(s)")


def test_a_fallback_to_simt_is_logged_as_well_as_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="metrale_attn"), pytest.warns(RuntimeWarning):
        decoder(problem(seed=31, seq_lens=(5, 40), num_q_heads=4, num_kv_heads=2, kv_dtype="fp8"), target="a10")
    (record,) = [r for r in caplog.records if r.name == "metrale_attn.attention"]
    assert record.levelno == logging.WARNING and "a10 (sm_86) lacks" in record.getMessage()
    assert "using impl='simt'" in record.getMessage()


def test_a_cache_directory_that_cannot_be_written_is_logged_as_well_as_warned(tmp_path, monkeypatch, caplog):
    root = tmp_path / "a-file"
    root.write_text("")
    monkeypatch.setenv("METRALE_ATTN_CACHE_DIR", str(root))
    for name, value in (("_MEMO", {}), ("_FALLBACK_DIRS", {}), ("_FALLBACK_WARNED", False)):
        monkeypatch.setattr(build, name, value)
    with caplog.at_level(logging.WARNING, logger="metrale_attn"), pytest.warns(build.CacheFallbackWarning):
        CpuBackend().load(stand_in("unwritable_logged"))
    (record,) = [r for r in caplog.records if r.name == "metrale_attn.backends.cpu_backend"]
    assert f"cannot write the CUDA-on-CPU kernel cache {root}" in record.getMessage()
