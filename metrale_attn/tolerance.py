"""The correctness bar: the one tolerance every kernel output is held to, in one place.

An output element passes when it is within :data:`ULP_BAR` (1) unit in the last place
of the float64 reference rounded once, to nearest even, to the output dtype; or, where
cancellation leaves the result so near zero that fp32 error dominates its last bits,
when its absolute error is at most :func:`near_zero_allowance`:

    max|V| x (NEAR_ZERO_ABS + LOGIT_ABS x (head_dim / 16 + 2) x max|s|)

``max|V|`` is the largest dequantized V value the kernel read
(:func:`metrale_attn.reference.max_abs_v_read`), ``max|s|`` the largest magnitude of a
logit (the scaled, capped score, natural-log units) or sink the softmax saw
(:func:`metrale_attn.reference.max_abs_logit`; 0 when the caller does not give it,
which keeps the bar at its strictest). NaN never passes. There is no other tolerance:
tests, the demo and the benchmarks all call :func:`assert_close_to_reference` or
:func:`close_to_reference_mask`.

Why the logit term (the derivation): the kernels compute each logit ``s_t`` in fp32 on
the tensor cores. Every product of a bf16/fp16/fp8 q and k element is exact in fp32,
and the sum over ``head_dim`` goes into an fp32 accumulator in ``head_dim / 16`` MMA
steps, each rounding once (unit roundoff ``u = 2**-24``); the score scale and the fold
into base 2 add two more roundings. So ``|ds_t| <= (head_dim / 16 + 2) u max|s|`` to
first order (``max|s|`` bounds the partial sums the roundings act on). The output
``o = sum_t p_t v_t / sum_t p_t`` with ``p_t = e^(s_t - m)`` moves, to first order, by
``sum_t p_t (ds_t - mean ds) (v_t - o) / sum_t p_t``, at most ``2 max|ds| max|V|``: hence
``LOGIT_ABS = 2u``. With ``sm_scale = 1`` and ``|s|`` about 22 (FlashInfer's sink decode
test, |s| up to ~35 at head dim 64) that is what honest fp32 logits need; at the usual
``1/sqrt(head_dim)`` and unit inputs (|s| <= 8) the allowance stays below ``2**-16 max|V|``,
far under one bf16 or fp16 ulp of any element but the nearly cancelled ones.

The helpers it is built from are exact and exported: :func:`round_to` (one rounding
from float64, no double rounding through float32) and :func:`ulp_distance` (distance on
the monotonic integer line of bit patterns; ``+0`` and ``-0`` are 0 apart). Like the
reference, this module imports nothing of the package.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = [
    "ULP_BAR",
    "NEAR_ZERO_ABS",
    "LOGIT_ABS",
    "ULP_NAN",
    "near_zero_allowance",
    "round_to",
    "ulp_distance",
    "close_to_reference_mask",
    "assert_close_to_reference",
]

#: A kernel output element passes if it is within ``ULP_BAR`` units in the last place
#: of the float64 reference rounded (to nearest even) to the output dtype.
ULP_BAR = 1

#: ...or if its absolute error is at most ``near_zero_allowance``, which starts from
#: ``NEAR_ZERO_ABS * max|V|``, ``V`` being the
#: dequantized V values the kernel read. This is the single allowance for elements
#: near zero: each output is a convex combination of V rows accumulated in fp32, whose
#: rounding error is of order ``2**-24 * max|V|`` (times a small factor) regardless of
#: the size of the result. Where the result is tiny compared with ``max|V|``, one
#: bf16/fp16 ulp of it is smaller than that fp32 error, so an ulp bar would be
#: meaningless there. Away from zero the allowance is far below one ulp (bf16 ulp is
#: ``2**-8`` relative, fp16 ``2**-11``), so it never loosens the ulp bar.
#: ``2**-20 * max|V|`` is 16 fp32 ulps of ``max|V|``.
NEAR_ZERO_ABS = 2.0**-20

#: ...and grows by ``LOGIT_ABS * (head_dim / 16 + 2) * max|s| * max|V|``: the fp32 rounding
#: of the logits, which moves the softmax weights (see the module docstring's derivation).
LOGIT_ABS = 2.0 * 2.0**-24


def near_zero_allowance(v_absmax: float, logit_absmax: float = 0.0, head_dim: int = 0) -> float:
    """The absolute error an element may have where the ulp bar cannot hold: ``max|V| x
    (NEAR_ZERO_ABS + LOGIT_ABS x (head_dim / 16 + 2) x max|s|)``."""
    return float(v_absmax) * (NEAR_ZERO_ABS + LOGIT_ABS * (head_dim / 16 + 2) * float(logit_absmax))

# (significand bits including the implicit one, smallest normal exponent, largest exponent)
_FORMATS = {
    np.dtype(ml_dtypes.bfloat16): (8, -126, 127),
    np.dtype(np.float16): (11, -14, 15),
    np.dtype(np.float32): (24, -126, 127),
}


def round_to(x, dtype) -> np.ndarray:
    """Round float64 values to ``dtype`` (bf16, fp16 or fp32), round-to-nearest-even.

    The rounding is done once, from float64 (``ml_dtypes`` float64 -> bfloat16 goes
    through float32 and can round twice). Overflow goes to +-inf, NaN stays NaN, the
    sign of zero is kept, subnormals are produced where the format has them.
    """
    dtype = np.dtype(dtype)
    if dtype not in _FORMATS:
        raise TypeError(f"round_to supports bfloat16, float16 and float32, got {dtype}")
    precision, emin, emax = _FORMATS[dtype]
    x = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(x)
    xf = np.where(finite, x, 0.0)
    _, exponent = np.frexp(xf)  # |x| in [2**(e-1), 2**e)
    # Spacing of the target format at |x|, never finer than its subnormal spacing.
    quantum_exp = np.maximum(exponent - precision, emin - precision + 1)
    rounded = np.ldexp(np.round(np.ldexp(xf, -quantum_exp)), quantum_exp)  # np.round: half to even
    max_finite = (2.0 - 2.0 ** (1 - precision)) * 2.0**emax
    rounded = np.where(np.abs(rounded) > max_finite, np.copysign(np.inf, rounded), rounded)
    rounded = np.where(finite, rounded, x)
    # Every value is now exactly representable, so this cast is exact.
    return rounded.astype(dtype)


def _ordered_ints(a: np.ndarray) -> np.ndarray:
    """Map float bit patterns onto a monotonic int64 line (+0 and -0 both map to 0)."""
    bits_dtype = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    bits = a.view(bits_dtype).astype(np.int64)
    sign = 1 << (8 * a.dtype.itemsize - 1)
    return np.where(bits & sign, -(bits & (sign - 1)), bits)


#: What :func:`ulp_distance` reports wherever either side is NaN.
ULP_NAN = 2**40


def ulp_distance(a, b) -> np.ndarray:
    """Elementwise distance in units in the last place between two float arrays.

    ``a`` and ``b`` must have the same dtype: bf16, fp16 (or fp32). Bit patterns are
    mapped to a monotonic integer line, so adjacent values are 1 apart, ``+0`` and
    ``-0`` are 0 apart, the two smallest subnormals of opposite sign are 2 apart, and
    the largest finite value is 1 from infinity. Where either side is NaN the result
    is :data:`ULP_NAN` (``2**40``, far beyond any finite distance).

    Returns int64 with the broadcast shape of ``a`` and ``b``.
    """
    a = np.asarray(a)
    b = np.asarray(b)
    if a.dtype != b.dtype:
        raise TypeError(f"ulp_distance needs equal dtypes, got {a.dtype} and {b.dtype}")
    if a.dtype not in _FORMATS:
        raise TypeError(f"ulp_distance supports bfloat16, float16 and float32, got {a.dtype}")
    dist = np.abs(_ordered_ints(a) - _ordered_ints(b))
    nan = np.isnan(a.astype(np.float64)) | np.isnan(b.astype(np.float64))
    return np.where(nan, ULP_NAN, dist)


def close_to_reference_mask(out, ref, *, v_absmax: float, logit_absmax=0.0) -> np.ndarray:
    """Boolean mask of the elements of ``out`` that meet THE correctness bar.

    Args:
        out: kernel output, bf16 or fp16 (fp32 also accepted), ``[..., head_dim]``.
        ref: float64 reference of the same shape.
        v_absmax: ``max|V|`` over the dequantized V values actually read
            (:func:`metrale_attn.reference.max_abs_v_read`).
        logit_absmax: ``max|s|`` over the logits and sinks the softmax saw
            (:func:`metrale_attn.reference.max_abs_logit`); 0 keeps the strictest bar.

    An element passes iff it is not NaN, the reference is not NaN, and it is within
    :data:`ULP_BAR` ulp of ``round_to(ref, out.dtype)`` or its absolute error to
    ``ref`` is at most :func:`near_zero_allowance`. ``logit_absmax`` may be a function of
    no argument that gives it: it is asked only if an element misses the strictest bar
    (computing it costs about as much as the reference).
    """
    if callable(logit_absmax):
        strict = close_to_reference_mask(out, ref, v_absmax=v_absmax)
        return strict if strict.all() else close_to_reference_mask(out, ref, v_absmax=v_absmax,
                                                                   logit_absmax=logit_absmax())
    out = np.asarray(out)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape mismatch: kernel {out.shape} vs reference {ref.shape}")
    ulps = ulp_distance(out, round_to(ref, out.dtype))
    with np.errstate(invalid="ignore"):  # inf - inf gives NaN: a failure, as it should
        abs_err = np.abs(out.astype(np.float64) - ref)
        near_zero_ok = abs_err <= near_zero_allowance(v_absmax, logit_absmax, out.shape[-1] if out.ndim else 0)
    not_nan = ~np.isnan(out.astype(np.float64)) & ~np.isnan(ref)
    return not_nan & ((ulps <= ULP_BAR) | near_zero_ok)


def assert_close_to_reference(out, ref, *, v_absmax: float, logit_absmax=0.0, what: str = "output") -> None:
    """Raise AssertionError unless every element meets :func:`close_to_reference_mask`
    (``logit_absmax``: a float, or a function of no argument asked only on a miss).

    The message gives the number of failing elements, the worst ulp distance, its
    index, and the kernel value against the reference (float64 and rounded).
    """
    out = np.asarray(out)
    ref = np.asarray(ref, dtype=np.float64)
    ok = close_to_reference_mask(out, ref, v_absmax=v_absmax)
    if ok.all():
        return
    if callable(logit_absmax):
        logit_absmax = logit_absmax()
    ok = close_to_reference_mask(out, ref, v_absmax=v_absmax, logit_absmax=logit_absmax)
    if ok.all():
        return
    allowance = near_zero_allowance(v_absmax, logit_absmax, out.shape[-1] if out.ndim else 0)
    rounded = round_to(ref, out.dtype)
    ulps = np.where(ok, -1, ulp_distance(out, rounded))
    worst = np.unravel_index(int(np.argmax(ulps)), ulps.shape)
    n_bad = int((~ok).sum())
    worst_ulps = int(ulps[worst])
    worst_ulps_text = "NaN" if worst_ulps >= ULP_NAN else str(worst_ulps)
    raise AssertionError(
        f"{what}: {n_bad} of {ok.size} elements ({out.dtype}) miss the bar "
        f"(<= {ULP_BAR} ulp, or abs error <= the near-zero allowance {allowance:.6g}: max|V| = "
        f"{float(v_absmax):.6g}, max|s| = {float(logit_absmax):.6g}); worst {worst_ulps_text} ulp at index "
        f"{tuple(int(i) for i in worst)}: kernel {float(out[worst])!r} vs reference "
        f"{float(ref[worst])!r} (rounded {float(rounded[worst])!r})"
    )
