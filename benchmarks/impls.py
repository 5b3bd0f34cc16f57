"""Which kernel implementations this build of ``metrale_attn`` offers: the benchmarks' one capability hook.

The lead is replacing the CUDA-core kernels ("simt") by tensor-core kernels ("mma")
that serve ``heads_per_cta`` query heads of one KV head per CTA. The new API adds two
keyword arguments to ``DecodeAttention`` (``impl=``: "simt", "mma", or None for the
default; ``heads_per_cta=``: an int dividing the group size, or None for the plan's
rule) and two fields to ``DecodePlan`` (``impl``, ``heads_per_cta``). Everything in
``benchmarks/`` that depends on that API (the old-vs-new comparison, the L2 probe's
old/new kernels, the ``heads_per_cta`` sweep) asks ``kernel_impls()`` and nothing
else, so today's build runs, measures its one implementation and says what is "not
available in this build"; when the new API lands, all of it switches on without edits.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Optional

IMPL_NAMES = ("simt", "mma")
"""``impl=`` spellings of the new API: the CUDA-core kernels (old) and the tensor-core kernels (new)."""
NEW_IMPL = "mma"
NOT_AVAILABLE = "not available in this build"


@dataclass(frozen=True)
class KernelImpls:
    """What ``DecodeAttention`` accepts. ``impls``: the ``impl=`` values to measure, ``(None,)``
    when there is one implementation (then no ``impl=`` is passed)."""

    impls: tuple
    heads_per_cta: bool

    @property
    def comparison(self) -> bool:
        """Old and new kernels can both be forced (the old-vs-new comparison runs)."""
        return len(self.impls) > 1

    def why_not(self, feature: str) -> str:
        """Why ``feature`` ("impl" or "heads_per_cta") did not run, or "" if it did."""
        have = self.comparison if feature == "impl" else self.heads_per_cta
        return "" if have else f"{NOT_AVAILABLE} (DecodeAttention takes no {feature}=)"

    def options(self, impl: Optional[str] = None, heads_per_cta: Optional[int] = None) -> dict:
        """``DecodeAttention`` keyword arguments forcing ``impl`` / ``heads_per_cta``; only what the build takes."""
        out = {}
        if impl is not None and self.comparison:
            out["impl"] = impl
        if heads_per_cta is not None and self.heads_per_cta:
            out["heads_per_cta"] = heads_per_cta
        return out

    def sweep_impl(self) -> Optional[str]:
        """The implementation the ``heads_per_cta`` sweep forces: the new kernels where there is a choice."""
        return NEW_IMPL if self.comparison else None


def kernel_impls(decode_attention=None) -> KernelImpls:
    """Inspect ``DecodeAttention``'s signature: ``impl=`` -> both implementations; ``heads_per_cta=``."""
    if decode_attention is None:
        from metrale_attn import DecodeAttention as decode_attention
    try:
        params = inspect.signature(decode_attention).parameters
    except (TypeError, ValueError):
        params = {}
    return KernelImpls(impls=IMPL_NAMES if "impl" in params else (None,), heads_per_cta="heads_per_cta" in params)


def plan_impl(plan) -> Optional[str]:
    """The implementation a plan runs (``DecodePlan.impl`` of the new API; None today)."""
    return getattr(plan, "impl", None)


def plan_heads_per_cta(plan, pack_width: int) -> int:
    """Query heads per CTA of a plan: ``DecodePlan.heads_per_cta`` of the new API; today 1, or
    ``pack_width`` (``DECODE_GQA_PACK_WIDTH``) on the GQA-packed arm."""
    value = getattr(plan, "heads_per_cta", None)
    if value is not None:
        return int(value)
    return pack_width if plan.arm == "gqa_packed" else 1
