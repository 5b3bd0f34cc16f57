"""Per-hardware defaults: SM count, compute capability and declared policies.

A target names a GPU family. On a GPU the family comes from the device's compute
capability and the SM count from the device; on the CPU backend the table's SM
count stands in. ``resolve_target_policy`` applies the one precedence rule: an explicit
argument, else a parseable environment value, else the target's declaration.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Optional

from . import policy
from .policy import SplitkPolicy


@dataclass(frozen=True)
class Target:
    """One GPU family. ``splitk_declared`` is a policy spelling, or None (-> legacy).
    ``smem_per_block``: the most dynamic shared memory one block may opt into (bytes);
    a kernel that asks for more does not launch there."""

    name: str
    hw: str
    sm_count: int
    compute_capability: tuple[int, int]
    splitk_declared: Optional[str]
    smem_per_block: int
    gqa_pack_declared: bool = policy.DECODE_GQA_PACK_DECLARED

    @property
    def arch(self) -> str:
        """NVRTC architecture, e.g. ``sm_90``."""
        major, minor = self.compute_capability
        return f"sm_{major}{minor}"

    @property
    def converts_fp8(self) -> bool:
        """Whether the target has the fp8 -> f16x2 ``cvt`` the ``mma`` core reads fp8 caches
        with (PTX ``cvt.rn.f16x2.e4m3x2``: sm_89 and later)."""
        return tuple(self.compute_capability) >= FP8_CVT_CAPABILITY


FP8_CVT_CAPABILITY = (8, 9)
"""The first compute capability with PTX's fp8 conversions (``cvt.rn.f16x2.e4m3x2``)."""

TARGETS: dict[str, Target] = {
    t.name: t
    for t in (
        # The launch policy's own targets: Hopper and Blackwell.
        Target("hopper", "H100/H200", 132, (9, 0), "auto", 227 * 1024),
        Target("b200", "B200", 148, (10, 0), "auto", 227 * 1024),
        Target("b300", "B300", 148, (10, 3), "auto", 227 * 1024),
        Target("gb10", "GB10", 48, (12, 1), None, 99 * 1024),
        # Every other family a user has, one target per compute capability (a device of the
        # family brings its own SM count): Ampere, Ada, consumer Blackwell. Shared memory per
        # block is each architecture's opt-in maximum (CUDA C++ Programming Guide, "Compute
        # Capabilities"); they declare the batch-invariant policy.
        Target("a100", "A100/A30", 108, (8, 0), "auto", 163 * 1024),
        Target("a10", "A10/A40/RTX A6000/RTX 3090", 72, (8, 6), "auto", 99 * 1024),
        Target("l40s", "L40S/L4/RTX 6000 Ada/RTX 4090", 142, (8, 9), "auto", 99 * 1024),
        Target("rtx5090", "RTX 5090/RTX PRO 6000", 170, (12, 0), "auto", 99 * 1024),
    )
}
DEFAULT_TARGET = "hopper"


def get_target(name: str) -> Target:
    """The target called ``name`` (case-insensitive), or a ValueError listing the known ones."""
    target = TARGETS.get(str(name).strip().lower())
    if target is None:
        raise ValueError(f"target must be one of {', '.join(TARGETS)}; got {name!r}")
    return target


def detect_target(compute_capability: tuple[int, int], sm_count: int) -> Target:
    """The target of a device, carrying the device's own SM count.

    An unknown capability is an error rather than a guess: the split count and the
    compiled architecture both depend on it.
    """
    for target in TARGETS.values():
        if target.compute_capability == tuple(compute_capability):
            return replace(target, sm_count=sm_count)
    major, minor = compute_capability
    known = ", ".join(f"{t.name} (sm_{t.compute_capability[0]}{t.compute_capability[1]})" for t in TARGETS.values())
    raise ValueError(
        f"no target for compute capability {major}.{minor} (sm_{major}{minor}); known targets: {known}. "
        "Pick one explicitly with target='hopper' (CLI: --target hopper)."
    )


def target_for(device, name: Optional[str]) -> Target:
    """The target a layer runs with: on a GPU (``device``: its ``compute_capability`` and
    ``sm_count``) the device's (``name`` then keeps its table but the device's SM count),
    else the named one or the default (``device`` None: the table's SM count stands in)."""
    if device is None:
        return get_target(name or DEFAULT_TARGET)
    if name is None:
        return detect_target(device.compute_capability, device.sm_count)
    return replace(get_target(name), sm_count=device.sm_count)


@dataclass(frozen=True)
class TargetPolicy:
    """The policy a target runs with, and where each value came from.

    ``*_source`` is ``"declaration"``, ``"environment"`` or ``"argument"``.
    """

    target: Target
    splitk: SplitkPolicy
    splitk_source: str
    gqa_pack: bool
    gqa_pack_source: str

    @property
    def sm_count(self) -> int:
        return self.target.sm_count

    def line(self) -> str:
        """``target defaults (<hw>): attn_decode_splitk=<label> gqa_pack=<on|off> sm_count=<n>``,
        followed by the values that did not come from the declaration."""
        text = (
            f"target defaults ({self.target.name}: {self.target.hw}): "
            f"attn_decode_splitk={self.splitk.label()} gqa_pack={'on' if self.gqa_pack else 'off'} "
            f"sm_count={self.sm_count}"
        )
        overridden = [
            f"{key} from {source}"
            for key, source in (("attn_decode_splitk", self.splitk_source), ("gqa_pack", self.gqa_pack_source))
            if source != "declaration"
        ]
        return text + (f" ({', '.join(overridden)})" if overridden else "")


def resolve_target_policy(
    target: Target,
    *,
    splitk: Optional[str] = None,
    gqa_pack: Optional[bool] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> TargetPolicy:
    """Resolve the split-K policy and the GQA-pack gate for ``target``.

    ``splitk``/``gqa_pack`` are explicit overrides (a bad spelling is an error,
    unlike an unparseable environment value, which keeps the declaration). With
    ``environ=None`` the GQA gate and its reported source come from
    ``policy.gqa_pack_resolution``, resolved once per process; pass a mapping to
    resolve against it instead.
    """
    env = os.environ if environ is None else environ
    if splitk is not None:
        chosen = policy.parse(str(splitk))
        if chosen is None:
            raise ValueError(
                f"splitk must be 'auto', 'legacy', 'off'/'0' or a split count; got {splitk!r}"
            )
        split_policy, split_source = chosen, "argument"
    else:
        split_policy, from_env = policy.resolve_policy(target.splitk_declared or "", env.get(policy.ENV_SPLITK))
        split_source = "environment" if from_env else "declaration"

    if gqa_pack is not None:
        if not isinstance(gqa_pack, bool):
            raise TypeError(f"gqa_pack must be a bool or None, got {gqa_pack!r}")
        on, pack_source = gqa_pack, "argument"
    else:
        # The process's gate is resolved once, value and source together, so the
        # target line reports what the dispatch uses even if the variable changes later.
        if environ is None:
            on, from_env = policy.gqa_pack_resolution(target.gqa_pack_declared)
        else:
            on, from_env = policy.GqaPackResolution.of(target.gqa_pack_declared, environ.get(policy.ENV_GQA_PACK))
        pack_source = "environment" if from_env else "declaration"
    return TargetPolicy(target, split_policy, split_source, on, pack_source)
