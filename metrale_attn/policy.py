"""The paged-decode launch policy: split-K count, workspace size, GQA-packed gate.

Pure functions of configuration (the environment is read only by
``policy_from_env`` and the GQA gate's once-per-process resolution,
``gqa_pack_resolution``/``gqa_pack_enabled``). Nothing here imports the rest of
the package, CuPy or NumPy.

Why the policy exists: the online-softmax merge of split-K partials is not
associative, so a split count that moved with the number of co-batched sequences
would change a sequence's output bytes depending on what it is batched with.
``auto`` and pinned counts depend only on ``(sm_count, num_q_heads)``; only
``legacy`` reads the batch.

All counts are unsigned 32-bit integers: arguments must lie in ``0 .. 2**32 - 1``
and products saturate at ``2**32 - 1`` instead of wrapping. A count may be any
``numbers.Integral`` (a NumPy integer too) but not a bool. The rules, their constants
and the reasons behind them, with worked numbers: docs/launch-policy.md.
"""

from __future__ import annotations

import functools
import numbers
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple, Optional

ENV_SPLITK = "METRALE_ATTN_DECODE_SPLITK"
ENV_GQA_PACK = "METRALE_ATTN_DECODE_GQA_PACK"

U32_MAX = 2**32 - 1

SPLITK_TARGET_WAVES = 2
"""Waves of CTAs ``auto`` aims to put on the device with one sequence in flight."""

MAX_DECODE_SPLITS = 16
"""Ceiling on the split count under ``auto`` and pinned policies, and so on the
workspace. Without it one q head on 132 SMs would ask for 264 splits."""

DECODE_GQA_PACK_WIDTH = 6
"""Query heads one packed CTA carries; the packed kernel source ``#define``s the
same value as ``PD_GQA`` and the loader refuses a mismatch. 6 is the 24/4 ratio."""

DECODE_GQA_PACK_HEAD_DIM = 256
"""The only head dim the packed kernel is compiled for (``#define PD_HDIM``)."""

DECODE_GQA_PACK_DECLARED = False
"""The packed kernel's declared state: off on every target."""

PD_MIN_KV_PER_SPLIT = 256
"""Tokens a non-empty split covers at least (fewer only at the sequence's end).

One line of why: 256 tokens of K+V at head_dim 128 in bf16 are 128 KiB, which keeps
a split's fixed costs (loading q, writing and re-reading its ``head_dim + 2`` fp32
partial) near 1% of the bytes it streams. The split-K kernel receives it as
``-DPD_MIN_KV_PER_SPLIT``; this constant is its only source.
"""

# Spellings are trimmed of the Unicode White_Space set only. Python's str.strip() would
# also strip U+001C..U+001F, which are not White_Space: "\x1c4" must not parse as 4.
_WHITESPACE = (
    "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000\u2001\u2002\u2003\u2004\u2005\u2006"
    "\u2007\u2008\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
)
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")
_DECIMAL_U32 = re.compile(r"\+?[0-9]+", re.ASCII)


def normalize(spelling: str) -> str:
    """Trim Unicode whitespace and lowercase ASCII letters only: how every environment
    variable and option spelling of the package is read."""
    return spelling.strip(_WHITESPACE).translate(_ASCII_LOWER)


def parse_count(spelling: str) -> Optional[int]:
    """A decimal count as ``parse`` reads one (``normalize``d; an optional ``+``, ASCII
    digits only, at most ``2**32 - 1``), else None: ``"\x1c2"``, ``"٢"``, ``"²"``, ``"-1"``
    and ``"2.0"`` are not counts."""
    word = normalize(spelling)
    if _DECIMAL_U32.fullmatch(word) and int(word) <= U32_MAX:
        return int(word)
    return None


def as_int(value) -> Optional[int]:
    """``value`` as a Python int when it is an integer (``numbers.Integral``: ints and
    NumPy integers), else None; bools are not counts and give None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return None
    return int(value)


def _u32(name: str, value: int) -> int:
    checked = as_int(value)
    if checked is None:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    value = checked
    if not 0 <= value <= U32_MAX:
        raise ValueError(f"{name} must be in 0..{U32_MAX}, got {value}")
    return value


def _sat_mul(*factors: int) -> int:
    product = 1
    for f in factors:
        product *= f
    return min(product, U32_MAX)


@dataclass(frozen=True)
class SplitkPolicy:
    """How a target picks its split count: ``legacy``, ``auto`` or a pinned count.

    Build them as ``SplitkPolicy.LEGACY``, ``SplitkPolicy.AUTO`` and
    ``SplitkPolicy.pinned(n)`` (which clamps ``n`` to ``1..MAX_DECODE_SPLITS``).
    ``parse(p.label()) == p`` for every policy.
    """

    kind: Literal["legacy", "auto", "pinned"]
    count: int = 0
    """The pinned split count, ``1..MAX_DECODE_SPLITS``; 0 for the other kinds."""

    LEGACY: ClassVar[SplitkPolicy]
    AUTO: ClassVar[SplitkPolicy]

    def __post_init__(self) -> None:
        if self.kind == "pinned":
            if not 1 <= self.count <= MAX_DECODE_SPLITS:
                raise ValueError(f"a pinned split count must be 1..{MAX_DECODE_SPLITS}, got {self.count}")
        elif self.kind in ("legacy", "auto"):
            if self.count != 0:
                raise ValueError(f"{self.kind} carries no count, got {self.count}")
        else:
            raise ValueError(f"kind must be 'legacy', 'auto' or 'pinned', got {self.kind!r}")

    @staticmethod
    def pinned(count: int) -> SplitkPolicy:
        """A pinned count, clamped to ``1..MAX_DECODE_SPLITS`` (0 means one split)."""
        return SplitkPolicy("pinned", min(max(_u32("count", count), 1), MAX_DECODE_SPLITS))

    def label(self) -> str:
        """The spelling ``parse`` reads back as this policy: ``legacy``, ``auto`` or ``"4"``."""
        return str(self.count) if self.kind == "pinned" else self.kind

    def __str__(self) -> str:
        return self.label()


SplitkPolicy.LEGACY = SplitkPolicy("legacy")
SplitkPolicy.AUTO = SplitkPolicy("auto")


def parse(spelling: str) -> Optional[SplitkPolicy]:
    """Read a split-K policy spelling, trimmed and ASCII-case-insensitive.

    ``legacy``; ``auto``; ``0``/``off``/``false``/``no`` are one split (no split-K);
    a decimal count (an optional ``+``, ASCII digits, at most ``2**32 - 1``) is pinned
    and clamped to ``1..MAX_DECODE_SPLITS``: ``"40"`` -> 16. Anything else is ``None``
    (``"-1"``, ``"4.0"``, ``"1_0"``, ``"4294967296"``, ``""``), which keeps the
    declaration in ``resolve_policy``.
    """
    word = normalize(spelling)
    if word == "legacy":
        return SplitkPolicy.LEGACY
    if word == "auto":
        return SplitkPolicy.AUTO
    if word in ("0", "off", "false", "no"):
        return SplitkPolicy.pinned(1)
    count = parse_count(word)
    return None if count is None else SplitkPolicy.pinned(count)


def resolve_policy(declared: str, env_raw: Optional[str]) -> tuple[SplitkPolicy, bool]:
    """The target's declaration, overridden by a parseable environment value.

    Returns ``(policy, came_from_env)``. An unparseable declaration is ``legacy``;
    an unparseable environment value is ignored. This is the one resolution both
    the dispatch and the workspace sizing use, so the count a launch uses and the
    one its workspace was sized for come from the same rule.
    """
    from_env = parse(env_raw) if env_raw is not None else None
    if from_env is not None:
        return from_env, True
    return parse(declared) or SplitkPolicy.LEGACY, False


def policy_from_env(declared: str, environ: Mapping[str, str] = os.environ) -> SplitkPolicy:
    """``resolve_policy`` of a target's declaration against ``METRALE_ATTN_DECODE_SPLITK``."""
    return resolve_policy(declared, environ.get(ENV_SPLITK))[0]


def auto_splits(sm_count: int, num_q_heads: int) -> int:
    """``clamp(ceil(SPLITK_TARGET_WAVES * sm_count / num_q_heads), 1, MAX_DECODE_SPLITS)``.

    The split-K grid is ``(num_q_heads, num_splits, num_seqs)``, so one sequence
    alone puts at least two waves of CTAs on the device when the cap allows; a
    wider batch launches more CTAs with the same count. Zero heads or SMs count
    as one. Worked numbers: 24 q heads on 148 SMs -> ceil(296 / 24) = 13 splits;
    24 on 132 -> 11; 64 on 132 -> 5; one head on 132 -> 264, capped at 16.
    """
    heads = max(_u32("num_q_heads", num_q_heads), 1)
    target = _sat_mul(SPLITK_TARGET_WAVES, max(_u32("sm_count", sm_count), 1))
    return min(max(-(-target // heads), 1), MAX_DECODE_SPLITS)


def legacy_splits(sm_count: int, num_q_heads: int, ref_seqs: int) -> int:
    """``sm_count // (num_q_heads * ref_seqs)``, or 1 once that product covers the SMs.

    Reads the reference batch, so the count moves with it: 24 q heads on 132 SMs
    give 5 splits for one sequence, 2 for two, 1 from five on. Uncapped: one head
    and one sequence on 132 SMs give 132.
    """
    sm_count = _u32("sm_count", sm_count)
    current_ctas = _sat_mul(max(_u32("num_q_heads", num_q_heads), 1), max(_u32("ref_seqs", ref_seqs), 1))
    return 1 if current_ctas >= sm_count else sm_count // current_ctas


def split_ref_seqs(num_seqs: int, max_decode_seqs: int) -> int:
    """The batch ``legacy`` sizes for: ``max(max_decode_seqs, num_seqs)``."""
    return max(_u32("max_decode_seqs", max_decode_seqs), _u32("num_seqs", num_seqs))


def num_splits(policy: SplitkPolicy, sm_count: int, num_q_heads: int, legacy_ref_seqs: int) -> int:
    """The split count of a launch. Only ``legacy`` reads ``legacy_ref_seqs``."""
    if policy.kind == "legacy":
        return legacy_splits(sm_count, num_q_heads, legacy_ref_seqs)
    if policy.kind == "auto":
        return auto_splits(sm_count, num_q_heads)
    return min(max(policy.count, 1), MAX_DECODE_SPLITS)


def workspace_slots(
    policy: SplitkPolicy, sm_count: int, num_q_heads: int, max_rows: int, legacy_ref_seqs: int,
    rows_per_seq: int = 1,
) -> int:
    """``[o[head_dim], m, l]`` slots the split-K workspace must hold.

    The split kernel writes slot ``((row * num_q_heads) + head) * num_splits + split``
    for each query row (a sequence's query token: ``rows_per_seq`` of them, the most query
    tokens a call may carry), so ``max_rows`` must be the widest launch in rows (batch x
    ``rows_per_seq``); a short workspace is a silent out-of-bounds write on the GPU.
    ``legacy`` needs ``sm_count`` slots a query row of a sequence: when it splits,
    ``num_q_heads * ref_seqs < sm_count`` with ``ref_seqs >= num_seqs`` (sequences, not
    rows: a multi-token call splits as a one-token call), so ``num_seqs * num_q_heads *
    num_splits <= sm_count`` and ``num_seqs * rows_per_seq * num_q_heads * num_splits <=
    sm_count * rows_per_seq``. The other policies need ``max_rows * num_q_heads *
    num_splits``: 256 rows x 24 heads x 11 splits = 67584 slots on hopper, 69.7 MB at
    head_dim 256.
    """
    if policy.kind == "legacy":
        return _sat_mul(max(_u32("sm_count", sm_count), 1), max(_u32("rows_per_seq", rows_per_seq), 1))
    splits = num_splits(policy, sm_count, num_q_heads, legacy_ref_seqs)
    return _sat_mul(max(_u32("max_rows", max_rows), 1), max(_u32("num_q_heads", num_q_heads), 1), splits)


def parse_gqa_pack(spelling: str) -> Optional[bool]:
    """``1``/``on``/``true``/``yes`` -> True, ``0``/``off``/``false``/``no`` -> False,
    trimmed and ASCII-case-insensitive; anything else ``None`` (keeps the declaration)."""
    word = normalize(spelling)
    if word in ("1", "on", "true", "yes"):
        return True
    if word in ("0", "off", "false", "no"):
        return False
    return None


def resolve_gqa_pack(declared: bool, env_raw: Optional[str]) -> bool:
    """``declared``, overridden by a parseable ``METRALE_ATTN_DECODE_GQA_PACK`` value."""
    from_env = parse_gqa_pack(env_raw) if env_raw is not None else None
    return declared if from_env is None else from_env


class GqaPackResolution(NamedTuple):
    """The GQA gate as resolved: whether it is on, and whether the environment said so."""

    on: bool
    from_env: bool

    @staticmethod
    def of(declared: bool, env_raw: Optional[str]) -> GqaPackResolution:
        """``resolve_gqa_pack`` with its source: pure, for any environment value."""
        from_env = env_raw is not None and parse_gqa_pack(env_raw) is not None
        return GqaPackResolution(resolve_gqa_pack(declared, env_raw), from_env)


@functools.cache
def gqa_pack_resolution(declared: bool = DECODE_GQA_PACK_DECLARED) -> GqaPackResolution:
    """The GQA gate of this process and where it came from, resolved once.

    A fixed answer keeps a captured CUDA graph consistent with later launches.
    ``METRALE_ATTN_DECODE_GQA_PACK`` is read on the first call only, and the value
    and its source are read together, so a report of the source (the target line)
    can never disagree with the value the dispatch uses. Tests that change the
    variable call ``gqa_pack_enabled.cache_clear()`` (the same cache).
    """
    return GqaPackResolution.of(declared, os.environ.get(ENV_GQA_PACK))


def gqa_pack_enabled(declared: bool = DECODE_GQA_PACK_DECLARED) -> bool:
    """Whether the packed kernel is on in this process: ``gqa_pack_resolution``'s
    value, resolved once (``gqa_pack_enabled.cache_clear()`` forgets it)."""
    return gqa_pack_resolution(declared).on


gqa_pack_enabled.cache_clear = gqa_pack_resolution.cache_clear


def gqa_pack_shape_ok(num_q_heads: int, num_kv_heads: int, head_dim: int) -> bool:
    """Whether the packed kernel can serve this shape; each term is its precondition.

    ``num_kv_heads > 0`` (the grid's x extent); ``num_q_heads == num_kv_heads *
    DECODE_GQA_PACK_WIDTH`` (the kernel takes its heads from ``kv_head * PD_GQA``;
    the test multiplies because division truncates: 25 over 4 divides to 6);
    ``head_dim == DECODE_GQA_PACK_HEAD_DIM``.
    """
    num_kv_heads = _u32("num_kv_heads", num_kv_heads)
    return (
        num_kv_heads > 0
        and _u32("num_q_heads", num_q_heads) == _sat_mul(num_kv_heads, DECODE_GQA_PACK_WIDTH)
        and _u32("head_dim", head_dim) == DECODE_GQA_PACK_HEAD_DIM
    )


def gqa_pack_ctas(num_kv_heads: int, num_seqs: int) -> int:
    """CTAs a packed launch puts on the device: ``num_kv_heads * num_seqs``, a
    ``DECODE_GQA_PACK_WIDTH``-fold cut from the unpacked grid. 4 KV heads cover
    gb10's 48 SMs only from 12 sequences on."""
    return _sat_mul(_u32("num_kv_heads", num_kv_heads), _u32("num_seqs", num_seqs))
