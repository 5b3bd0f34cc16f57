"""Dequantization scales read on the device (``device_scales=True``: one value or one per KV
head, folded by the kernels exactly as the host folds floats) and the lse in base 2
(``lse_base=2``)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from metrale_attn import DecodeAttention

from support.backends import BACKENDS
from support.problems import ARM_OPTIONS, check_against_reference, decoder, problem, run_poisoned

LN2 = np.float32(math.log(2.0))


def _fp8(seed, **kw):
    """An fp8 problem whose per-tensor scales are fp32 values (as engines keep them), so a host
    float and a device fp32 scale hold the same number."""
    p = problem(seed=seed, seq_lens=(0, 1, 37, 300), num_q_heads=8, num_kv_heads=2, kv_dtype="fp8", **kw)
    p.k_scale, p.v_scale = float(np.float32(p.k_scale)), float(np.float32(p.v_scale))
    return p


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arm", ["unpacked", "splitk"])
@pytest.mark.parametrize("features", [{}, dict(logits_soft_cap=20.0), dict(window_left=40)])
def test_one_device_scale_gives_the_bytes_of_the_same_host_float(backend, arm, features):
    """The kernels fold a device k scale into the logit scale as the host folds a float
    (sm_scale * k_scale * log2 e in double, then fp32; with the soft-cap, / cap), and apply
    a device v scale as the host's: the same values give the same bytes."""
    p = _fp8(31)
    host = run_poisoned(decoder(p, backend=backend, **ARM_OPTIONS[arm], **features), p)
    device = run_poisoned(decoder(p, backend=backend, device_scales=True, **ARM_OPTIONS[arm], **features), p)
    assert host[0].tobytes() == device[0].tobytes() and host[1].tobytes() == device[1].tobytes()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2", "bf16"])
@pytest.mark.parametrize("arm", list(ARM_OPTIONS))
def test_per_head_device_scales_meet_the_bar_of_the_per_head_reference(backend, kv_dtype, arm):
    heads = dict(num_q_heads=12, num_kv_heads=2, head_dim=256) if arm == "gqa_packed" else dict(num_q_heads=8,
                                                                                             num_kv_heads=4)
    p = problem(seed=32, seq_lens=(0, 1, 37, 300), kv_dtype=kv_dtype, per_head_scales=True, **heads)
    assert np.ndim(p.k_scale) == 1 and len(set(p.k_scale.tolist())) == heads["num_kv_heads"]
    attn = decoder(p, backend=backend, device_scales=True, **ARM_OPTIONS[arm])
    check_against_reference(p, *run_poisoned(attn, p))


def test_each_kv_heads_bytes_under_per_head_scales_are_a_host_run_at_that_heads_scale():
    """A CTA serves the query heads of one KV head and reads that head's scales alone."""
    p = problem(seed=33, seq_lens=(5, 300), num_q_heads=8, num_kv_heads=4, kv_dtype="fp8", per_head_scales=True)
    out, lse = run_poisoned(decoder(p, splitk="3", device_scales=True), p)
    group = 2
    for h in range(4):
        one = problem(seed=33, seq_lens=(5, 300), num_q_heads=8, num_kv_heads=4, kv_dtype="fp8",
                      per_head_scales=True)
        one.k_scale, one.v_scale = float(p.k_scale[h]), float(p.v_scale[h])
        o, s = run_poisoned(decoder(one, splitk="3"), one)
        heads = slice(h * group, (h + 1) * group)
        assert o[:, heads].tobytes() == out[:, heads].tobytes() and s[:, heads].tobytes() == lse[:, heads].tobytes()


def test_device_scales_and_host_floats_are_refused_where_the_layer_expects_the_other():
    p = _fp8(34)
    host, device = decoder(p), decoder(p, device_scales=True)
    scales = np.ones(1, np.float32)
    with pytest.raises(ValueError, match="built for host scales"):
        host.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scales=scales, v_scales=scales)
    with pytest.raises(ValueError, match="not k_scale= / v_scale= floats"):
        device.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scale=0.5, k_scales=scales,
                   v_scales=scales)
    with pytest.raises(ValueError, match="k_scales and v_scales must both be given"):
        device.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scales=scales)
    for bad, match in ((np.ones(3, np.float32), r"one per KV head \(\[2\]"), (np.ones(2, np.float64), "float32"),
                       (np.ones((2, 1), np.float32), "float32 array"), (np.ones(4, np.float32)[::2], "contiguous")):
        with pytest.raises(ValueError, match=match):
            device.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scales=bad, v_scales=scales)
    with pytest.raises(ValueError, match="impl='simt' has no sinks"):  # simt serves device_scales, not sinks
        decoder(p, device_scales=True, sinks=True, impl="simt")
    with pytest.raises(TypeError, match="device_scales must be a bool"):
        decoder(p, device_scales=1)


@pytest.mark.parametrize("value, match", [(np.nan, "finite float > 0"), (0.0, "finite float > 0"),
                                          (-1.0, "finite float > 0"), (np.inf, "finite normal fp32"),
                                          (1e-40, "finite normal fp32")])
def test_device_scale_values_the_host_can_read_are_checked_like_host_floats(value, match):
    """On the CPU backend the scales are host memory, so their values are checked every call,
    naming the element (on a GPU: with check_indices=True)."""
    p = _fp8(35)
    attn = decoder(p, device_scales=True)
    good = np.ones(2, np.float32)
    bad = good.copy()
    bad[1] = value
    with pytest.raises(ValueError, match=rf"k_scales\[1\] = .*{match}"):
        attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scales=bad, v_scales=good)
    with pytest.raises(ValueError, match=rf"v_scales\[1\] = .*{match}"):
        attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scales=good, v_scales=bad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("arm", list(ARM_OPTIONS))
@pytest.mark.parametrize("impl", ["mma", "simt"])
def test_lse_in_base_2_is_the_natural_lse_before_its_last_multiply(backend, arm, impl):
    """``lse_base=2`` writes the kernels' own log2 state, ``m + log2 l``; the natural lse is that
    times fp32 ln 2, so the two are one rounding apart, exactly, and out is unchanged."""
    heads = dict(num_q_heads=12, num_kv_heads=2, head_dim=256) if arm == "gqa_packed" else {}
    p = problem(seed=36, seq_lens=(0, 1, 37, 300), **heads)
    natural = run_poisoned(decoder(p, backend=backend, impl=impl, **ARM_OPTIONS[arm]), p)
    base2 = run_poisoned(decoder(p, backend=backend, impl=impl, lse_base=2, **ARM_OPTIONS[arm]), p)
    assert natural[0].tobytes() == base2[0].tobytes()
    assert (base2[1] * LN2).astype(np.float32).tobytes() == natural[1].tobytes()
    assert np.all(np.isneginf(base2[1][p.seq_lens == 0]))


def test_lse_base_accepts_e_and_2_and_refuses_anything_else():
    p = problem(seed=37, seq_lens=(5,))
    assert decoder(p, lse_base=" E ").config.lse_base == "e" and decoder(p, lse_base=np.int64(2)).config.lse_base == "2"
    for bad in (10, "ln", True, 2.0):
        with pytest.raises(ValueError, match="lse_base must be 'e'"):
            decoder(p, lse_base=bad)


def test_device_scales_compile_a_specialization_of_their_own():
    p = _fp8(38)
    assert decoder(p, device_scales=True).config.features == {"device_scales"}
    assert isinstance(decoder(p), DecodeAttention) and not decoder(p).config.features
