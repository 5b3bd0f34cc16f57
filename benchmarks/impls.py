"""The kernel implementations the harness measures, and building one with the mma self-test's verdict.

``metrale_attn`` has two (``metrale_attn.plan.IMPLS``): ``mma``, the default, the tensor-core
kernels whose CTA serves ``heads_per_cta`` query heads of one KV head (persistent CTAs, 8 warps
where they fit, else 6, 4 or 2); and ``simt``, the first CUDA-core kernels, one head per CTA,
the reference implementation and fallback. The harness names both (``IMPLS``, old to new:
``simt``, ``mma``, each a set of ``DecodeAttention`` arguments, ``ARGUMENTS``); the sweep and the
L2 probe force each; the ``heads_per_cta`` tier forces every choice of a group
(``plan.heads_per_cta_choices``) on ``SWEEP_IMPL``. The earlier mma kernels (v2, v2.1, v2.2)
are in git at the tag ``mma-kernels-v2-to-v2.3`` (benchmarks/NOTES.md, "Kernel history").

On a GPU the first ``mma`` construction per device runs a known-answer test of the PTX the mma
kernels use (``metrale_attn/backends/selftest.py``). Where the device disagrees with the emulation
the kernels were verified on, ``DecodeAttention`` warns (``RuntimeWarning``) and builds ``simt``
instead. So what ran is read from what was built (``plan(n).impl``), never from what was asked:
``build`` returns the object with the warnings its construction raised, and ``Built.fell_back``
says that an ``mma`` request got ``simt``; ``selftest_record`` is what the result and the summary
say about it.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Optional

from metrale_attn.config import ENV_IMPL, resolve_impl

IMPLS = ("simt", "mma")
"""The implementations the harness forces, in the order rows are timed and shown: old to new."""
ARGUMENTS = {"simt": dict(impl="simt"), "mma": dict(impl="mma")}
"""What each of ``IMPLS`` asks ``DecodeAttention`` for."""
SWEEP_IMPL = "mma"
"""The implementation the ``heads_per_cta`` tier forces (``simt`` serves one head per CTA)."""


class FellBack(Exception):
    """A forced ``mma`` spec built ``simt``: the device failed the self-test (no row is timed)."""


@dataclass(frozen=True)
class Built:
    """A constructed ``DecodeAttention``; ``asked`` is the ``impl=`` it was given (None: the default)."""

    attn: object
    asked: Optional[str]
    warnings: tuple = ()

    @property
    def wanted(self) -> str:
        """The implementation the request resolves to (one of ``IMPLS``; None: the environment,
        else ``mma``, the default)."""
        if self.asked is not None:
            return self.asked
        return resolve_impl(None, os.environ.get(ENV_IMPL))

    @property
    def impl(self) -> str:
        """What was built: the plan's implementation (one of ``IMPLS``)."""
        return self.attn.plan(1).impl

    @property
    def fell_back(self) -> bool:
        return self.impl != self.wanted

    def fallback_reason(self) -> str:
        said = "; ".join(self.warnings) or "no warning was raised"
        return f"asked for {self.wanted}, built {self.impl} (mma self-test failed on this device: {said})"[:400]


def build(decode_attention, *args, impl: Optional[str] = None, **kwargs) -> Built:
    """``decode_attention(*args, **ARGUMENTS[impl], **kwargs)`` (``impl`` None: ``impl=None``, the
    default), the ``RuntimeWarning``s of its construction recorded (not shown); a construction error
    (``ValueError``: a ``heads_per_cta`` the group refuses) propagates."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", RuntimeWarning)
        attn = decode_attention(*args, **(ARGUMENTS[impl] if impl is not None else dict(impl=None)), **kwargs)
    said = tuple(str(w.message) for w in caught if issubclass(w.category, RuntimeWarning))
    return Built(attn, impl, said)


def selftest_record(built: Optional[Built], backend: str) -> dict:
    """What the run says about the mma self-test, from the first build that wanted ``mma``:
    ``status`` ``ok`` (the mma rows are mma), ``fallback`` (they would be simt: not timed), or
    ``not run`` (nothing asked for mma)."""
    if built is None:
        return {"status": "not run", "detail": "no mma spec was built"}
    if built.fell_back:
        return {"status": "fallback", "detail": built.fallback_reason(), "warnings": list(built.warnings)}
    where = ("CPU backend: the emulation is what the kernels are verified against" if backend == "cpu"
             else "the device agrees with the emulation; the mma rows ran mma")
    return {"status": "ok", "detail": where, "warnings": list(built.warnings)}

