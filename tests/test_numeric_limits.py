"""The mma kernels at the edges of their number formats (issue 18): sequences of up to
INT32_MAX keys (D5), bf16 query rows of any bf16 magnitude against fp16/fp8 caches (D4),
and finite sink logits beyond what base-2 bookkeeping holds in fp32 (D1); each against the
float64 reference under the one bar, on the CPU backend."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

from cuda_on_cpu import compile_module
from metrale_attn import reference, sources, tolerance
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.problems import Problem, make_problem

from support.problems import decoder, problem

INT32_MAX = 2**31 - 1


def _run(attn, p: Problem, q=None, sinks=None):
    """(out, lse) of a run with both poisoned with NaN first; q may be multi-token."""
    q = p.q if q is None else q
    out = np.full(q.shape, np.nan, dtype=q.dtype)
    lse = np.full(q.shape[:-1], np.nan, dtype=np.float32)
    attn.run(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scale=p.k_scale, v_scale=p.v_scale,
             out=out, lse=lse, sinks=sinks)
    return out, lse


def _check_lse(lse, ref_lse):
    neg = np.isneginf(ref_lse)
    assert np.all(np.isneginf(lse[neg]))
    np.testing.assert_allclose(lse[~neg], ref_lse[~neg], rtol=2e-6, atol=2e-6)


# -- D5: INT32_MAX keys ----------------------------------------------------------------------


def _window_at_the_end(seq_len: int, head_dim: int, kv_dtype: str, q_len: int, window_left: int):
    """One sequence of seq_len keys with page size 256 whose block table (ceil(L / 256) columns)
    names pages only from the first page a window touches: every entry before is -1, and the
    cache holds just the last three pages (shuffled)."""
    page_size = 256
    small = make_problem(np.random.default_rng(seq_len % 1000 + q_len), num_seqs=1, num_q_heads=4, num_kv_heads=2,
                         head_dim=head_dim, page_size=page_size, seq_lens=[3 * page_size], kv_dtype=kv_dtype)
    columns = -(-seq_len // page_size)
    first_key = max(seq_len - q_len - window_left, 0)  # the first query token's first key
    assert first_key // page_size >= columns - 3, "the window reaches before the pages the cache holds"
    table = np.full((1, columns), -1, np.int32)
    table[0, -3:] = small.block_tables[0, :3]
    q = np.random.default_rng(q_len).standard_normal((1, q_len, 4, head_dim)).astype(small.q.dtype)
    p = Problem(q[:, 0], small.k_cache, small.v_cache, table, np.array([seq_len], np.int32), small.k_scale,
                small.v_scale, "NHD")
    v_read = reference.gather_kv(p.v_cache, table, p.seq_lens, 0, "NHD", start=first_key) * p.v_scale
    return p, (q if q_len > 1 else None), float(np.abs(v_read).max())


@pytest.mark.parametrize("splitk", ["off", "4"])
@pytest.mark.parametrize("seq_len", [INT32_MAX, 2**31 - 31, 2**31 - 32 - 1])
def test_a_sequence_of_up_to_int32_max_keys_attends_to_its_window_and_reads_only_the_pages_it_touches(
        seq_len, splitk):
    # hd 64 bf16: 32-token tiles; 2^31 - 31 is the first length whose (hi + TT - 1) / TT overflowed
    p, _, v_absmax = _window_at_the_end(seq_len, 64, "bf16", 1, 300)
    attn = decoder(p, window_left=300, splitk=splitk)  # the CPU backend's host index check runs too
    out, lse = _run(attn, p)
    ref_out, ref_lse = p.reference(return_lse=True, window_left=300)
    tolerance.assert_close_to_reference(out, ref_out, v_absmax=v_absmax)
    _check_lse(lse, ref_lse)


@pytest.mark.parametrize("splitk", ["off", "4"])
@pytest.mark.parametrize("head_dim, kv_dtype", [(128, "fp16"), (64, "fp8")])  # 16- and 32-token tiles
def test_multi_token_decode_at_int32_max_keys_attends_each_query_token_to_its_own_window(head_dim, kv_dtype,
                                                                                        splitk):
    p, q, v_absmax = _window_at_the_end(INT32_MAX, head_dim, kv_dtype, 3, 100)
    attn = decoder(p, window_left=100, max_q_len=3, splitk=splitk)
    out, lse = _run(attn, p, q=q)
    ref_out, ref_lse = p.reference(return_lse=True, q=q, window_left=100)
    tolerance.assert_close_to_reference(out, ref_out, v_absmax=v_absmax)
    _check_lse(lse, ref_lse)


def test_the_core_computes_no_signed_overflow_at_int32_max_keys_under_ubsan(monkeypatch, capfd):
    # The producer runs tiles past the last key: past 2^31 near INT32_MAX, which wraps on the
    # GPU and on the host build alike, so only the sanitizer sees int overflow there.
    from cuda_on_cpu import build

    if not hasattr(build, "_flags"):
        pytest.skip("cuda_on_cpu.build has no _flags to add the sanitizer to")
    flags = build._flags
    monkeypatch.setattr(build, "_flags", lambda *args: flags(*args) + ["-fsanitize=signed-integer-overflow"])
    p, _, v_absmax = _window_at_the_end(INT32_MAX, 64, "bf16", 1, 300)
    for splitk in ("off", "4"):
        out, _ = _run(decoder(p, window_left=300, splitk=splitk), p)
        tolerance.assert_close_to_reference(out, p.reference(window_left=300), v_absmax=v_absmax)
    reports = [line for line in capfd.readouterr().err.splitlines() if "runtime error" in line]
    assert not reports, "\n".join(reports)


# -- D4: bf16 query rows of any magnitude against fp16 / fp8 keys ------------------------------


def _rows_of_magnitude(p: Problem, exponent: int) -> Problem:
    """p with every bf16 q row scaled to max |q| = 2^exponent exactly, and keys stored as
    N(0, 1) 2^a with k_scale = 2^(-exponent - a), so that the logits q.k k_scale (sm_scale 1)
    are O(1) while k_scale and the kernels' folded k_scale log2(e) stay normal fp32 values."""
    q = p.q.astype(np.float64)
    q = q / np.abs(q).max(axis=-1, keepdims=True) * 2.0**exponent
    a = -2 if exponent > 0 else (12 if p.k_cache.dtype == np.float16 else 6)
    keys = np.random.default_rng(exponent % 89).standard_normal(p.k_cache.shape) * 2.0**a
    top = float(ml_dtypes.finfo(p.k_cache.dtype).max)  # 448 for fp8 e4m3
    k_cache = np.clip(keys, -top, top).astype(p.k_cache.dtype)
    k_scale = 2.0 ** (-exponent - a)
    for value in (k_scale, k_scale * math.log2(math.e)):
        assert np.finfo(np.float32).tiny <= value <= np.finfo(np.float32).max
    return Problem(q.astype(ml_dtypes.bfloat16), k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scale, p.v_scale,
                   p.kv_layout)


@pytest.mark.parametrize("splitk", ["off", "3"])
@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8"])
@pytest.mark.parametrize("exponent", [116, 127, -120, -130])  # -130: every row a bf16 subnormal
def test_a_bf16_query_row_of_magnitude_2_to_the_exponent_meets_the_bar_against_an_fp16_or_fp8_cache(
        exponent, kv_dtype, splitk):
    p = _rows_of_magnitude(problem(seed=exponent % 97, page_size=16, seq_lens=(1, 37, 300), kv_dtype=kv_dtype,
                                   q_dtype="bf16"), exponent)
    assert np.all(np.abs(p.q.astype(np.float64)).max(axis=-1) == 2.0**exponent)
    keys = reference.gather_kv(p.k_cache, p.block_tables, p.seq_lens, 2, "NHD")[:, 0] * p.k_scale
    logits = keys @ reference.to_float64(p.q[2, 0])
    assert 0.1 < logits.std() < 10, "the logits are not O(1)"
    out, lse = _run(decoder(p, sm_scale=1.0, splitk=splitk), p)
    ref_out, ref_lse = p.reference(return_lse=True, sm_scale=1.0)
    tolerance.assert_close_to_reference(out, ref_out, v_absmax=p.v_absmax())
    _check_lse(lse, ref_lse)


@pytest.mark.parametrize("kv_dtype", ["fp16", "fp8"])
def test_a_zero_bf16_query_row_attends_uniformly_even_where_its_score_scale_underflows(kv_dtype):
    # k_scale 2^-60, sm_scale 1: 2^-100 qk_scale (a zero row's scale before issue 18) rounds to 0 in fp32
    p = problem(seed=11, page_size=16, seq_lens=(1, 37, 300), kv_dtype=kv_dtype, q_dtype="bf16")
    q = p.q.copy()
    q[:, 1] = 0
    p = Problem(q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, 2.0**-60, p.v_scale, p.kv_layout)
    for splitk in ("off", "3"):
        out, lse = _run(decoder(p, sm_scale=1.0, splitk=splitk), p)
        ref_out, ref_lse = p.reference(return_lse=True, sm_scale=1.0)
        tolerance.assert_close_to_reference(out, ref_out, v_absmax=p.v_absmax())
        _check_lse(lse, ref_lse)


# -- D1: sinks beyond FLT_MAX ln 2 ------------------------------------------------------------

SINK_TOY = r"""
// pd_add_sink on one state per thread: state [n, 3] = (M, L, O) in, out [n, 4] = (M', L', O',
// alone) where alone = 1 when the function returned true. `unguarded` is the formula as it
// was before issue 18, for the bytes of ordinary sinks.
extern "C" __global__ void add_sink(const float* sink, const float* state, float* out, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float M = state[3 * i], L = state[3 * i + 1], O = state[3 * i + 2];
    const bool alone = pd_add_sink(sink[i], M, L, O);
    out[4 * i] = M;
    out[4 * i + 1] = L;
    out[4 * i + 2] = O;
    out[4 * i + 3] = alone ? 1.f : 0.f;
  }
}

extern "C" __global__ void unguarded(const float* sink, const float* state, float* out, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float M = state[3 * i], L = state[3 * i + 1], O = state[3 * i + 2];
    const float s = sink[i] * (float)PD_LOG2E;
    const float mx = fmaxf(M, s);
    const float ms = mx == pd_neg_inf() ? 0.f : mx;
    const float a = exp2f(M - ms);
    out[4 * i] = mx;
    out[4 * i + 1] = fmaf(L, a, exp2f(s - ms));
    out[4 * i + 2] = O * a;
    out[4 * i + 3] = 0.f;
  }
}
"""


def _sink_module():
    source = sources.inline("pd_splitk.cuh") + '\n#line 1 "tests/test_numeric_limits.py:SINK_TOY"\n' + SINK_TOY
    return compile_module(source, name="numeric_limits_sink", defines=dict(
        PD_HEAD_DIM=64, PD_Q_DTYPE=0, PD_KV_DTYPE=0, PD_MIN_KV_PER_SPLIT=256))


def _add_sink(kernel: str, sinks, states):
    sinks = np.ascontiguousarray(sinks, np.float32)
    states = np.ascontiguousarray(states, np.float32).reshape(-1, 3)
    out = np.full((len(sinks), 4), np.nan, np.float32)
    _sink_module().launch(kernel, (1, 1, 1), (32, 1, 1), 0, [sinks, states, out, np.int32(len(sinks))])
    return out


INF = np.inf
EMPTY = (-INF, 0.0, 0.0)
SEEN = (5.0, 3.0, -2.0)  # M = 5 (log2 units), L = 3, O = -2


def test_a_finite_sink_beyond_flt_max_ln2_makes_the_state_the_sinks_alone_and_says_so():
    sinks = [3e38, 3e38, 2.4e38, -3e38, -2.4e38, 3e38]
    states = [SEEN, EMPTY, (np.finfo(np.float32).max, 1.0, 7.0), EMPTY, EMPTY, (-3e38, 1.0, 1.0)]
    flt_max = np.finfo(np.float32).max
    out = _add_sink("add_sink", sinks, states)
    assert not np.isnan(out).any()
    np.testing.assert_array_equal(out[:, 1], 1.0)  # L' = the sink's own weight, 2^0
    np.testing.assert_array_equal(out[:, 2], 0.0)  # O' = 0: out is exactly 0
    np.testing.assert_array_equal(out[:, 3], 1.0)  # alone: the caller's lse is the sink itself
    np.testing.assert_array_equal(out[:, 0], [flt_max, flt_max, flt_max, -flt_max, -flt_max, flt_max])


def test_a_finite_sink_far_below_a_non_empty_state_leaves_it_bit_for_bit_as_minus_infinity_does():
    states = [SEEN, (-120.0, 2.5, 0.25)]
    for sink in (-3e38, -2.4e38, -INF):
        out = _add_sink("add_sink", [sink] * 2, states)
        assert out[:, :3].tobytes() == np.asarray(states, np.float32).tobytes(), sink
        np.testing.assert_array_equal(out[:, 3], 0.0)
    empty = _add_sink("add_sink", [-INF], [EMPTY])  # no sink and nothing seen: still empty
    assert empty[0, :3].tobytes() == np.asarray(EMPTY, np.float32).tobytes() and empty[0, 3] == 0


def test_a_nan_state_stays_nan_under_a_sink_beyond_flt_max_ln2():
    out = _add_sink("add_sink", [3e38, 3e38], [(5.0, np.nan, 1.0), (5.0, 1.0, np.nan)])
    assert np.isnan(out[0, 1]) and out[0, 3] == 0  # not alone: lse = pd_lse(M, NaN) = NaN
    assert np.isnan(out[1, 2])


def test_ordinary_sinks_fold_to_the_bytes_of_the_formula_before_the_guard():
    rng = np.random.default_rng(18)
    sinks = np.concatenate([rng.normal(0, 3, 40), [0.0, -0.0, 80.0, -80.0, 1e38, -1e38, 2.35e38, -2.35e38, -INF]])
    states = [SEEN, EMPTY, (-7.0, 1.0, 0.5), (200.0, 9.0, 3.0)]
    states = [states[i % len(states)] for i in range(len(sinks))]
    guarded, before = _add_sink("add_sink", sinks, states), _add_sink("unguarded", sinks, states)
    assert guarded[:, :3].tobytes() == before[:, :3].tobytes()
    np.testing.assert_array_equal(guarded[:, 3], 0.0)


class SinkWritingBackend(CpuBackend):
    """The CPU backend, but each launch first writes ``values`` into the ``sinks`` array run()
    was given (and validated, holding harmless values), so the kernels read sinks that a host
    check may refuse."""

    def __init__(self, sinks, values):
        super().__init__()
        self.sinks, self.values = sinks, np.asarray(values, np.float32)

    def load(self, spec):
        module, backend = super().load(spec), self

        class Writing:
            def launch(self, launch):
                backend.sinks[...] = backend.values
                module.launch(launch)

        return Writing()


@pytest.mark.parametrize("splitk", ["off", "4"])
def test_sinks_beyond_flt_max_ln2_give_an_exact_zero_output_and_the_sink_as_the_lse_unpacked_and_split(splitk):
    p = problem(seed=18, page_size=16, seq_lens=(0, 1, 40, 700), num_q_heads=4, num_kv_heads=2)
    huge = np.array([3e38, -3e38, 2.4e38, -INF], np.float32)
    sinks = np.zeros(4, np.float32)  # what run() validates; the kernels read `huge` (SinkWritingBackend)
    attn = decoder(p, sinks=True, splitk=splitk, backend=SinkWritingBackend(sinks, huge))
    assert attn.plan(4).arm == ("unpacked" if splitk == "off" else "splitk")
    out, lse = _run(attn, p, sinks=sinks)
    ref_out, ref_lse = p.reference(return_lse=True, sinks=huge)
    tolerance.assert_close_to_reference(out, ref_out, v_absmax=p.v_absmax())
    assert not np.isnan(lse).any()
    np.testing.assert_array_equal(out[:, [0, 2]].astype(np.float32), 0.0)  # the dominating sinks
    np.testing.assert_array_equal(lse[:, 0], huge[0])  # exact: the sink itself
    np.testing.assert_array_equal(lse[:, 2], huge[2])
    assert lse[0, 1] == huge[1]  # an empty sequence: the sink is its only term
    _check_lse(lse, ref_lse)
