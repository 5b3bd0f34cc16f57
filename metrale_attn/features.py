"""The features of the ``mma`` core, each declared once: one ``Feature`` record per feature.

A record says everything the host derives for a feature: its name (the only spelling: the
define ``PD_<NAME>``, the spec suffix ``_<name>``), when a layer has it, how a caller asks for
it (the words of the ``simt`` refusal), the arrays a call then passes (``Array``: ``run``'s
keyword, the torch op's argument and the kernel's pointer parameter under one name, with the
array's check and the kernel parameter that takes what the check derives), the arguments of the
plain call it takes the place of, and the refusals of a call that does not match the layer.
From ``FEATURE_RECORDS`` come ``config.FEATURES`` (name -> when a layer has it), the ``simt``
refusal, ``validation.ARRAY_ARGUMENTS`` and ``CHECKERS``, ``binding.ARGUMENTS``' entries for
them, ``run``'s keywords and the torch op's schema.

A module of its own rather than part of config.py: the records carry their arrays' checks,
which read an array's description (per call), while config.py checks a layer's keywords (once);
config.py derives ``FEATURES`` from here. Because config imports this module, it sits below
config and imports only ``dtypes``: the few checks of one array's description that the
features' checks share with validation's (alignment, forward strides, a contiguous vector) live
here too, and validation imports them.

Pure: no backend, no device, no kernel source is touched here. An array's description is a
``backends.ArrayInfo`` (read by attribute: shape, strides, dtype, itemsize, ptr).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from . import dtypes

VECTOR_BYTES = 16  # kernels load K/V and q rows with 16-byte vector loads
INDEX_BYTES = 4  # int32 block tables and seq_lens, float32 lse and sinks: 4-byte loads and stores
MAX_SEQ_LEN = 2**31 - 1
"""The longest sequence, in tokens, of either page-table form: the kernels hold a length in an
int32 (seq_lens as given; a CSR length ``(pages - 1) * page_size + kv_last_page_len`` computed
there, which would wrap past it)."""


@dataclass(frozen=True)
class Array:
    """An array a call passes for a feature.

    ``name`` is ``run``'s keyword, the torch op's argument and the kernel's pointer parameter.
    ``check(config, info, rows)`` checks its description (``rows``: out's leading dims, from q)
    and returns what a launch needs of it, which ``derived_parameter`` (when given) takes: a
    kernel parameter that reads 0 when the array is absent. ``dtype``, ``shape`` and ``ranks``
    are what the torch op's fake implementation checks at trace time (sizes are left to the
    real call)."""

    name: str
    check: Callable[[Any, Any, tuple], Any]
    dtype: str
    shape: str
    ranks: tuple[int, ...] = (1,)
    derived_parameter: Optional[str] = None


PLAIN_DEFAULTS = {"block_tables": None, "seq_lens": None, "k_scale": 1.0, "v_scale": 1.0}
"""The plain call's arguments a feature may take the place of (``Feature.replaces``), with the
value that means "not given"."""


@dataclass(frozen=True)
class Feature:
    """One feature of the ``mma`` core (FlashInfer calls them attention *variants*).

    ``has(config)``: whether a layer has it; ``asked``: how a caller asks for it, as the
    ``simt`` refusal says it; ``simt``: whether the ``simt`` kernels serve it too (their core's
    define, as the ``mma`` core's), else a ``simt`` layer asking for it is refused. A feature that takes arrays per call lists them in ``arrays``
    (given exactly when the layer has it), names in ``replaces`` the arguments of the plain call
    it takes the place of (``PLAIN_DEFAULTS``: left out with it; the arrays among them required
    without it), and says what is wrong with a call that does not match: ``refuse_with`` to a
    layer that has it, ``refuse_without`` to one that has not (formatted with ``config``)."""

    name: str
    has: Callable[[Any], bool]
    asked: str
    arrays: tuple[Array, ...] = ()
    simt: bool = False
    replaces: tuple[str, ...] = ()
    refuse_with: str = ""
    refuse_without: str = ""

    def refusal(self, config, call: dict) -> Optional[str]:
        """What is wrong with a call of ``call`` (argument name -> value, None for an absent
        array) to a layer of ``config``, or None when it matches."""
        has = self.has(config)
        wrong = any((call[a.name] is None) == has for a in self.arrays) or any(
            not _left_out(call[name], PLAIN_DEFAULTS[name]) if has else call[name] is None
            for name in self.replaces)
        if not wrong:
            return None
        return (self.refuse_with if has else self.refuse_without).format(config=config)


def _left_out(value, default) -> bool:
    return value is None if default is None else value == default


# -- the checks of one array's description that the features' and validation's share -------


def aligned(info, argument: str, boundary: int = VECTOR_BYTES) -> None:
    """The array starts on a ``boundary``-byte boundary (an empty one may start anywhere)."""
    if info.ptr % boundary and not empty(info):
        what = "vector loads" if boundary == VECTOR_BYTES else f"its {boundary}-byte elements"
        raise ValueError(f"{argument} must start on a {boundary}-byte boundary for {what} (address {info.ptr:#x})")


def empty(info) -> bool:
    """No element: nothing is read or written through it, so its strides and address do
    not matter (NumPy 2 gives ``np.empty((0, ...))`` strides of 0)."""
    return 0 in info.shape


def forward_strides(info, argument: str) -> None:
    if info.strides and min(info.strides) < 0:
        raise ValueError(f"{argument} has negative strides {list(info.strides)}, which are not supported: pass a "
                         f"copy (np.ascontiguousarray) or a view with positive strides")


def contiguous_int32(info, argument: str, length: int) -> None:
    forward_strides(info, argument)
    if info.shape != (length,) or dtypes.name_of(info.dtype) != dtypes.INT32:
        raise ValueError(f"{argument} must be contiguous int32 [{length}], got {info.dtype} {list(info.shape)}")
    if length > 1 and info.strides[0] != 1:
        raise ValueError(f"{argument} must be contiguous int32 [{length}], got a strided view (element stride "
                         f"{info.strides[0]}, not 1)")
    aligned(info, argument, INDEX_BYTES)


# -- the features' arrays: (config, description, out's leading dims) -> what the launch needs --


def check_sinks(config, info, rows) -> None:
    """Contiguous float32 ``[num_q_heads]``; host values are checked on every call
    (``validation.check_sink_values``)."""
    H = config.shape.num_q_heads
    if info.shape != (H,) or (H > 1 and info.strides != (1,)) or dtypes.name_of(info.dtype) != dtypes.FLOAT32:
        raise ValueError(f"sinks must be a contiguous float32 [{H}] array, got {info.dtype} {list(info.shape)} "
                         f"strides {list(info.strides)}")
    aligned(info, "sinks", INDEX_BYTES)


def check_scales(config, info, argument: str) -> int:
    """A float32 dequantization scale on the device (``device_scales``): one value (shape
    ``[]`` or ``[1]``, for the tensor) or ``[num_kv_heads]`` contiguous (one per KV head);
    returns the element stride a KV head's scale is read at (0 for one value)."""
    KV = config.shape.num_kv_heads
    per_head = info.shape == (KV,) and (KV == 1 or info.strides == (1,))
    if dtypes.name_of(info.dtype) != dtypes.FLOAT32 or not (info.shape in ((), (1,)) or per_head):
        raise ValueError(f"{argument} must be a float32 array of one value ([] or [1]) or of one per KV head "
                         f"([{KV}], contiguous), got {info.dtype} {list(info.shape)} strides {list(info.strides)}")
    aligned(info, argument, INDEX_BYTES)
    return 1 if per_head and KV > 1 else 0


def check_k_scales(config, info, rows) -> int:
    return check_scales(config, info, "k_scales")


def check_v_scales(config, info, rows) -> int:
    return check_scales(config, info, "v_scales")


def check_kv_indptr(config, info, rows) -> None:
    """Contiguous int32 ``[num_seqs + 1]``: sequence ``s``'s pages are ``kv_indices[kv_indptr[s]
    : kv_indptr[s + 1]]``."""
    contiguous_int32(info, "kv_indptr", rows[0] + 1)


def check_kv_indices(config, info, rows) -> None:
    """Contiguous int32 ``[nnz]``: every sequence's page ids, one after another; at most
    ``MAX_SEQ_LEN`` tokens in all, so that no sequence's length can wrap the kernels' int32 where
    its lengths are not read on the host (a GPU without ``check_indices``): a sequence holds at most
    all ``nnz`` pages. 2**31 tokens of KV are terabytes, past any batch a device holds."""
    if len(info.shape) != 1:
        raise ValueError(f"kv_indices must be contiguous int32 [nnz], got {info.dtype} {list(info.shape)}")
    contiguous_int32(info, "kv_indices", info.shape[0])
    tokens = info.shape[0] * config.page_size
    if tokens > MAX_SEQ_LEN:
        raise ValueError(f"kv_indices holds {info.shape[0]} pages of {config.page_size} tokens, {tokens} in all: one "
                         f"sequence of them could pass {MAX_SEQ_LEN} (2**31 - 1) tokens, the longest the kernels' int32 "
                         "lengths hold; split the batch")


def check_kv_last_page_len(config, info, rows) -> None:
    """Contiguous int32 ``[num_seqs]``: the tokens of each sequence's last page (1 ..
    page_size; a sequence of no page has none)."""
    contiguous_int32(info, "kv_last_page_len", rows[0])


# -- the records ----------------------------------------------------------------------------


FEATURE_RECORDS = (
    Feature("multi_token", lambda c: c.max_q_len > 1, "max_q_len > 1", simt=True),
    Feature("window", lambda c: c.window_left >= 0, "window_left"),
    Feature("soft_cap", lambda c: c.logits_soft_cap is not None, "logits_soft_cap"),
    Feature(
        "sinks", lambda c: c.sinks, "sinks",
        arrays=(Array("sinks", check_sinks, "float32", "[num_q_heads]"),),
        refuse_with="sinks must be given: this DecodeAttention was built with sinks=True (a float32 "
                    "[{config.shape.num_q_heads}] array of sink logits; -inf for no sink)",
        refuse_without="sinks given, but this DecodeAttention was built without sinks: build it with sinks=True (a "
                       "kernel without sinks would ignore them)"),
    Feature("out_f32", lambda c: c.out_dtype == dtypes.FLOAT32, "out_dtype float32"),
    Feature(
        "device_scales", lambda c: c.device_scales, "device_scales",
        arrays=(Array("k_scales", check_k_scales, "float32", "[] or [num_kv_heads]", (0, 1), "k_scales_stride"),
                Array("v_scales", check_v_scales, "float32", "[] or [num_kv_heads]", (0, 1), "v_scales_stride")),
        simt=True,
        replaces=("k_scale", "v_scale"),
        refuse_with="this DecodeAttention was built with device_scales=True: k_scales and v_scales must both be given "
                    "(float32 arrays on its device of one value or [{config.shape.num_kv_heads}], one per KV head), "
                    "not k_scale= / v_scale= floats",
        refuse_without="k_scales / v_scales given, but this DecodeAttention was built for host scales: pass k_scale= "
                       "and v_scale= floats, or build it with device_scales=True"),
    Feature(
        "csr", lambda c: c.page_table == "csr", "page_table 'csr'",
        arrays=(Array("kv_indptr", check_kv_indptr, "int32", "[num_seqs + 1]"),
                Array("kv_indices", check_kv_indices, "int32", "[nnz]"),
                Array("kv_last_page_len", check_kv_last_page_len, "int32", "[num_seqs]")),
        simt=True,
        replaces=("block_tables", "seq_lens"),
        refuse_with="this DecodeAttention was built with page_table='csr': pass kv_indptr=, kv_indices= and "
                    "kv_last_page_len= (int32), and no block_tables or seq_lens",
        refuse_without="pass block_tables and seq_lens (this DecodeAttention was built with page_table='dense'; "
                       "FlashInfer's kv_indptr / kv_indices / kv_last_page_len need page_table='csr')"),
)
"""The ``mma`` core's features, in the order spec names list them: multi-token decode
(``max_q_len > 1``: query rows that see different keys), a sliding window, the logits soft-cap,
attention sinks, fp32 output, dequantization scales read on the device, FlashInfer's CSR page
table (the first and the last two the ``simt`` kernels serve too: ``SIMT_FEATURES``)."""

SIMT_FEATURES: frozenset = frozenset(f.name for f in FEATURE_RECORDS if f.simt)
"""The features the ``simt`` kernels serve as well (``multi_token``, ``device_scales``, ``csr``), in
any combination (the packed arm: one query token); a ``simt`` layer asking for any other is
refused (``config.LayerConfig.mma_only``)."""

FEATURE_ARRAYS: tuple[Array, ...] = tuple(a for f in FEATURE_RECORDS for a in f.arrays)
"""Every feature's arrays, in the records' order: ``run``'s feature keywords and the torch op's
last arguments, in this order."""


def simt_features_line() -> str:
    """How a caller asks for each feature the ``simt`` kernels lack, as their refusal lists them
    (``window = window_left, soft_cap = logits_soft_cap, ...``)."""
    return ", ".join(f"{f.name} = {f.asked}" for f in FEATURE_RECORDS if not f.simt)
