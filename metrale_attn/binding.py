"""Binding one call's arguments to its kernels' parameters: the launch ABI, Python side.

Each kernel's parameter list (names, order, C types) is read from its source
(``kernels.kernel_params``): the C signature is the one description of the ABI. Here
``ARGUMENTS`` says where the value of every parameter a kernel may declare comes from,
and a parameter named after a ``LayerConfig`` field takes that field's value (``int
window_left``), so a feature whose kernels read a configured value needs no entry here; a
feature's arrays bring theirs from its record (``features.Array``: the pointer under the
array's name, and the parameter that takes what its checker derives).
A parameter that is neither fails ``kernel_abi`` (and the test that builds every
spec's ABI) before anything launches.

``CallBinder`` turns one call's arrays and scales into launches: it checks each array
(``validation``) unless it is the buffer checked last time, and keeps one template of
typed values per plan, scalars and array ``Layout`` (all a launch may read of each array
but its pointer), so a call with new buffers of the same layouts only fills in pointers. The
template's values are computed from its key alone (``_Values``), so the key is complete by
construction: an array argument added to ``ARRAY_ARGUMENTS`` is in it, whole.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, Callable, NamedTuple, Optional

from .backends import ArrayInfo, Launch
from .config import LN2, LayerConfig
from .kernels import kernel_params, v_in_k_served
from .features import FEATURE_ARRAYS, FEATURE_RECORDS
from .validation import ARRAY_ARGUMENTS, CHECKERS, INPUTS, VECTOR_BYTES, check_together, logit_scales, scales
from .workspace import where

_CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(LayerConfig))

_AT = {name: i for i, name in enumerate(ARRAY_ARGUMENTS)}
_ARRAY_FEATURES = tuple(f for f in FEATURE_RECORDS if f.arrays or f.replaces)

ARGUMENTS: dict[str, Callable[["_Values"], object]] = {
    # the arrays' pointers (a hole filled per call; null for an absent optional one) and the workspace
    **{name: (lambda i: lambda v: v.pointer_or_null(i))(i) for name, i in _AT.items()},
    "workspace": lambda v: v.workspace,
    # their strides, in elements: q (seq, token, head), each cache (page, token, head), a
    # device scale (0: one for the tensor, 1: one per KV head)
    "q_stride_seq": lambda v: v.q_strides[0],
    "q_stride_token": lambda v: v.q_strides[1],
    "q_stride_head": lambda v: v.q_strides[2],
    "k_stride_page": lambda v: v.arrays[_AT["k_cache"]].derived[0],
    "k_stride_token": lambda v: v.arrays[_AT["k_cache"]].derived[1],
    "k_stride_head": lambda v: v.arrays[_AT["k_cache"]].derived[2],
    "v_stride_page": lambda v: v.arrays[_AT["v_cache"]].derived[0],
    "v_stride_token": lambda v: v.arrays[_AT["v_cache"]].derived[1],
    "v_stride_head": lambda v: v.arrays[_AT["v_cache"]].derived[2],
    "block_tables_stride": lambda v: v.arrays[_AT["block_tables"]].strides[0] if v.arrays[_AT["block_tables"]] else 0,
    # what a feature array's checker derives, where its record names a parameter for it (k_scales_stride)
    **{a.derived_parameter: (lambda i: lambda v: v.derived_or_zero(i))(_AT[a.name])
       for a in FEATURE_ARRAYS if a.derived_parameter},
    # the layer
    "num_kv_heads": lambda v: v.config.shape.num_kv_heads,
    "soft_cap": lambda v: v.config.logits_soft_cap or 0.0,  # the kernels fold device scales with it
    "lse_scale": lambda v: LN2 if v.config.lse_base == "e" else 1.0,  # the kernels' lse is in log2 units
    # the plan
    "heads_per_cta": lambda v: v.plan.heads_per_cta,
    "num_splits": lambda v: v.plan.num_splits,
    "q_len": lambda v: v.plan.q_len,
    "items_x": lambda v: v.plan.launches[0].grid[0],  # the attention kernel's grid of work items
    "items_y": lambda v: v.plan.launches[0].grid[1],
    "items_z": lambda v: v.plan.launches[0].grid[2],
    # the host scales, folded (validation.scales, validation.logit_scales)
    "qk_scale": lambda v: v.scalars["qk_scale"],
    "cap_log2": lambda v: v.scalars["cap_log2"],
    "v_scale": lambda v: v.scalars["v_scale"],
}
"""Where each kernel parameter's value comes from, by the name the sources give it (the
layer's own fields, ``page_size`` or ``window_left``, are found by name in ``LayerConfig``)."""
POINTER_ARGUMENTS = ARRAY_ARGUMENTS + ("workspace",)
"""The parameters that are pointers: the arrays of ``run`` and the workspace."""


def argument_source(name: str) -> Optional[str]:
    """``"call"`` for a parameter ``ARGUMENTS`` binds, ``"config"`` for one named after a
    ``LayerConfig`` field, None for a parameter nothing binds."""
    if name in ARGUMENTS:
        return "call"
    return "config" if name in _CONFIG_FIELDS else None


def kernel_abi(spec) -> dict[str, tuple]:
    """Per kernel of ``spec``: ``((parameter name, NumPy scalar type or None for a pointer), ...)``,
    refusing a parameter no value is bound to."""
    abi = {}
    for kernel, params in kernel_params(spec).items():
        unbound = [p.name for p in params if argument_source(p.name) is None]
        if unbound:
            raise RuntimeError(f"kernel {kernel} ({spec.name}) declares {', '.join(unbound)}, which nothing binds: "
                               "name it after a LayerConfig field or add it to binding.ARGUMENTS")
        abi[kernel] = tuple((p.name, None if p.is_pointer else p.numpy_type) for p in params)
    return abi


class _Seen:
    """One array argument as last checked: its fingerprint and the rows it was checked
    for, the array (kept alive: a fingerprint may stand for its pointer by ``id``), its
    description, byte range, what its checker derived, its launch pointer, and its
    ``Layout`` with the binder's number for it (``CallBinder._layout_number``)."""

    __slots__ = ("fingerprint", "rows", "array", "info", "span", "derived", "pointer", "layout", "number")

    def __init__(self, fingerprint, rows, array, info, span, derived, pointer, layout, number):
        self.fingerprint, self.rows, self.array, self.info = fingerprint, rows, array, info
        self.span, self.derived, self.pointer = span, derived, pointer
        self.layout, self.number = layout, number


class BoundCall:
    """A validated call: the fingerprints and scales it was validated for, its launches
    ``((module, Launch), ...)``, what the index check reads, and its arguments (kept
    alive with the launches' pointers)."""

    __slots__ = ("prints", "k_scale", "v_scale", "launches", "num_pages", "max_pages", "q_len", "seen",
                 "workspace_span")

    def __init__(self, prints, k_scale, v_scale, launches, num_pages, max_pages, q_len, seen, workspace_span):
        self.prints, self.k_scale, self.v_scale, self.launches = prints, k_scale, v_scale, launches
        self.num_pages, self.max_pages, self.q_len, self.seen = num_pages, max_pages, q_len, seen
        self.workspace_span = workspace_span  # the shared workspace's bytes the arrays were checked against


class Layout(NamedTuple):
    """All that a launch may read of one array argument but its pointer: its strides,
    element type and device, and what its checker derived from it (a checker turns the
    array's shape into what a launch needs of it: out's rows, a cache's strides in
    (page, token, head) order, a scale's stride 0 or 1). A launch template's key holds
    it (``CallBinder._launches``). Not the extents: the plan holds the call's geometry
    (batch, query tokens), and a checker refuses any other shape, so ``kv_indices`` of
    another length every step reuses its template."""

    strides: tuple
    dtype: Any
    itemsize: int
    device: Optional[int]
    derived: Any

    @classmethod
    def of(cls, info: ArrayInfo, derived) -> "Layout":
        return cls(info.strides, info.dtype, info.itemsize, info.device, derived)


class Hole(NamedTuple):
    """Where a template leaves the pointer of ``ARRAY_ARGUMENTS[index]``, filled per call."""

    index: int


class _Values:
    """What ``ARGUMENTS`` reads a value from: the layer and the workspace pointer (fixed for a
    binder), and a template's key: the plan, the folded scalars and each array's ``Layout``
    (None: absent). An array's pointer reads as its ``Hole``: nothing else of a call can
    reach a value, so a template's key holds everything its values depend on."""

    __slots__ = ("config", "plan", "arrays", "scalars", "workspace", "null", "q_strides")

    def __init__(self, config, plan, arrays: tuple, scalars: dict, workspace, null):
        self.config, self.plan, self.arrays, self.scalars, self.workspace, self.null = (
            config, plan, arrays, scalars, workspace, null)
        qs = arrays[0].strides
        self.q_strides = qs[:3] if len(qs) == 4 else (qs[0], 0, qs[1])  # (seq, token, head)

    def pointer_or_null(self, index: int):
        return self.null if self.arrays[index] is None else Hole(index)

    def derived_or_zero(self, index: int):
        layout = self.arrays[index]
        return 0 if layout is None else layout.derived


_ABSENT = ()
"""The fingerprint of an absent optional array (``lse=None``)."""
_MAX_TEMPLATES = 64
_MAX_LAYOUTS = 256


class CallBinder:
    """One layer's calls turned into launches.

    ``modules``: ``(arm, row_tiles, multi_token) -> (spec, module)``; ``abi``: ``(spec name,
    kernel) -> kernel_abi`` (a feature may add parameters to a kernel of one name); ``plan``: the layer's memoized ``plan(num_seqs, q_len)``; ``group``: the
    ``SharedWorkspace`` (its byte range is what inputs may not overlap); ``block``: the
    attention kernels' and the merge's block sizes (an ``mma`` spec's attention kernel takes
    its tiling's, ``KernelSpec.threads``).
    """

    def __init__(self, config: LayerConfig, backend, device, modules: dict, abi: dict, plan, group,
                 workspace_pointer, block: tuple[int, int]):
        self.config, self.backend, self.device = config, backend, device
        self._modules, self._abi, self._plan, self._group = modules, abi, plan, group
        self._workspace, self._block = workspace_pointer, block
        self._seen: list = [None] * len(ARRAY_ARGUMENTS)  # per argument: the last buffer checked (_Seen)
        self.last: Optional[BoundCall] = None  # the last validated call, reused for the same buffers and scales
        self._templates: dict = {}  # (plan, scalars, layout numbers) -> per kernel typed values and pointer holes
        self._layouts: dict = {}  # Layout -> its number (_layout_number)
        self._numbers = itertools.count()

    def bind(self, arrays: tuple, k_scale, v_scale) -> BoundCall:
        """The launches of a call of ``arrays`` (``ARRAY_ARGUMENTS`` in order; ``sinks`` and
        ``lse`` may be None): the last call's when every array is the same buffer (the
        backend's ``fingerprint``), the scales are the same floats and no layer joined the
        workspace since; else every check of every argument (``validate``)."""
        fingerprint = self.backend.fingerprint
        prints = tuple(_ABSENT if a is None else fingerprint(a) for a in arrays)
        last = self.last
        if (last is not None and last.prints == prints and last.k_scale == k_scale and last.v_scale == v_scale
                and type(k_scale) is float and type(v_scale) is float  # noqa: E721  (True == 1.0: types too)
                and last.workspace_span is self._group.span):  # no layer joined the workspace since
            return last
        call = self.validate(arrays, prints, k_scale, v_scale)
        self.last = call if None not in prints else None
        return call

    def rows(self, q) -> tuple[int, ...]:
        """out's leading dims for ``q``, after checking it."""
        return self._checked(0, q, self.backend.fingerprint(q), None).derived

    def validate(self, arrays: tuple, prints: tuple, k_scale, v_scale) -> BoundCall:
        """Check a call's arguments and build its launches: every check of every argument.

        Each array is described and checked by its checker (``validation.CHECKERS``)
        unless it is the buffer the same argument was checked as last time (``prints``:
        the backend's fingerprints; None: unknown, check); then the checks across arrays
        run, and the scalars'.
        """
        config = self.config
        q_seen = self._checked(0, arrays[0], prints[0], None)
        rows = q_seen.derived  # out's leading dims: (num_seqs, num_q_heads) or (num_seqs, q_len, num_q_heads)
        self._refuse_mismatch(arrays, k_scale, v_scale)
        seen = [q_seen] + [None if a is None else self._checked(i, a, prints[i], rows)
                           for i, a in enumerate(arrays[1:], 1)]
        span = [None if x is None else x.span for x in seen]
        k, v, bt = seen[_AT["k_cache"]], seen[_AT["v_cache"]], seen[_AT["block_tables"]]  # bt: None for CSR
        check_together(k.info, v.info, (span[_AT["out"]], span[_AT["lse"]]), tuple(span[:len(INPUTS)]),
                       self._group.span)
        k_scale, v_scale = scales(config.sm_scale, k_scale, v_scale)
        qk_scale, cap_log2 = logit_scales(config, k_scale)
        scalars = dict(qk_scale=qk_scale, cap_log2=cap_log2, v_scale=v_scale)
        num_seqs, q_len = rows[0], (rows[1] if len(rows) == 3 else 1)
        plan = self._plan(num_seqs, q_len)
        v_in_k = self._v_in_k(k, v)
        launches = self._launches(plan, seen, scalars, v_in_k) if num_seqs else ()
        return BoundCall(prints, k_scale, v_scale, launches, k.info.shape[0], None if bt is None else bt.info.shape[1],
                         q_len, seen, self._group.span)

    def _v_in_k(self, k: "_Seen", v: "_Seen") -> bool:
        """Whether this call's ``v_cache`` is ``k_cache``'s first ``v_head_dim`` dims, so a layer
        with values narrower than keys (MLA) reads V from K's registers (its ``v_in_k`` spec):
        the same data pointer, dtype, device and (page, token, head) strides. Decided from the
        arrays' descriptions only, never their data; anything else reads V on its own."""
        if not v_in_k_served(self.config) or k.layout.strides[-1:] != v.layout.strides[-1:]:
            return False
        return (k.info.ptr == v.info.ptr and k.derived == v.derived and k.layout.dtype == v.layout.dtype
                and k.layout.device == v.layout.device)

    def _refuse_mismatch(self, arrays: tuple, k_scale, v_scale) -> None:
        """A feature's arrays given exactly when the layer has it, and what they replace left out
        (``features.Feature.refusal``), before any array is described."""
        call = dict(zip(ARRAY_ARGUMENTS, arrays), k_scale=k_scale, v_scale=v_scale)
        for feature in _ARRAY_FEATURES:
            why = feature.refusal(self.config, call)
            if why:
                raise ValueError(why)

    def _checked(self, index: int, array, fingerprint, rows) -> _Seen:
        """``array`` (argument ``ARRAY_ARGUMENTS[index]``) described and checked, or what
        was found of it last time when it is the same buffer checked for the same rows.

        A new buffer of the argument's last layout (the fingerprint past its first item:
        shape, strides, dtype, device, writability) at an address that moved by a multiple
        of ``VECTOR_BYTES`` gets the last verdict of its checker without running it: the
        checkers read an array's address only modulo ``VECTOR_BYTES`` (alignment).
        Everything else about it is read anew."""
        seen = self._seen[index]
        backend = self.backend
        if fingerprint is not None and seen is not None and seen.rows == rows:
            if seen.fingerprint == fingerprint:
                return seen
            if seen.fingerprint[1:] == fingerprint[1:]:
                info = backend.moved(seen.info, array)
                shift = info.ptr - seen.info.ptr
                if shift % VECTOR_BYTES == 0:
                    span = None if seen.span is None else (seen.span[0] + shift, seen.span[1] + shift)
                    seen = _Seen(fingerprint, rows, array, info, span, seen.derived, backend.pointer(array, info),
                                 seen.layout, seen.number)  # the same layout: only the pointer moved
                    self._seen[index] = seen
                    return seen
        info = backend.describe(array, ARRAY_ARGUMENTS[index])
        if info.device != self.device:
            raise ValueError(f"{ARRAY_ARGUMENTS[index]} must be on the device this DecodeAttention was built on "
                             f"({where(self.device)}), got {where(info.device)}")
        derived = CHECKERS[index](self.config, info, rows)
        layout = Layout.of(info, derived)
        seen = _Seen(fingerprint, rows, array, info, info.byte_range(), derived, backend.pointer(array, info), layout,
                     self._layout_number(layout))
        self._seen[index] = seen if fingerprint is not None else None
        return seen

    def _layout_number(self, layout: Layout) -> int:
        """A number for ``layout``, the same while it is remembered and never given to another
        layout (a counter: forgetting, past ``_MAX_LAYOUTS``, only costs a template miss), so
        a template's key holds a small int per array instead of hashing its layout per call."""
        number = self._layouts.get(layout)
        if number is None:
            if len(self._layouts) >= _MAX_LAYOUTS:
                self._layouts.clear()
            number = self._layouts[layout] = next(self._numbers)
        return number

    def _launches(self, plan, seen: list, scalars: dict, v_in_k: bool = False) -> tuple:
        """``plan``'s launches ``((module, Launch), ...)``, each with the parameters its
        source declares, by name.

        Built once per key as a template: each kernel's typed values (NumPy scalars of the
        ABI's types) with a hole per array pointer; a call of the same key only fills the
        holes. The key is what ``_template`` reads, and all it reads besides what is fixed
        for this binder (the layer, the modules, the workspace): the plan (memoized for the
        layer's life, so its ``id`` names it), the folded scalars and every array's
        ``Layout`` (strides, dtype, device, what its checker derived; by its number, which
        names one layout for the binder's life): complete by construction, so a template is
        reused only for a call it would be built alike for."""
        key = (id(plan), v_in_k, *scalars.values(), *[None if x is None else x.number for x in seen])
        template = self._templates.get(key)
        if template is None:
            if len(self._templates) >= _MAX_TEMPLATES:  # strides of many cache views: start over
                self._templates.clear()
            arrays = tuple(None if x is None else x.layout for x in seen)
            template = self._templates[key] = self._template(plan, arrays, scalars, v_in_k)
        launches = []
        for module, kernel, grid, block, shared, values, holes, dependent in template:
            values = values.copy()
            for j, index in holes:
                values[j] = seen[index].pointer
            launches.append((module, Launch(kernel, grid, block, shared, tuple(values), dependent)))
        return tuple(launches)

    def _template(self, plan, arrays: tuple, scalars: dict, v_in_k: bool = False) -> tuple:
        """Per kernel of ``plan``: ``(module, kernel, grid, block, shared bytes, values,
        holes, dependent)``; ``holes`` are ``(position, argument index)`` of the array pointers;
        ``dependent``: the ``mma`` merge, whose kernel waits for the attention grid on the
        device, is its programmatic dependent unless the layer turned that off. A function
        of its arguments (the key's parts: ``arrays`` the ``Layout`` of each array) and of
        what is fixed for this binder only."""
        spec, module = self._modules[(plan.arm, plan.row_tiles, plan.q_len > 1) + (("v_in_k",) if v_in_k else ())]
        values_of = _Values(self.config, plan, arrays, scalars, self._workspace, self.backend.pointer(None))
        template = []
        for i, grid in enumerate(plan.launches):
            abi = self._abi[spec.name, grid.kernel]
            values = []
            for name, typ in abi:
                value = ARGUMENTS[name](values_of) if name in ARGUMENTS else getattr(self.config, name)
                values.append(value if typ is None or isinstance(value, Hole) else typ(value))
            holes = tuple((j, value.index) for j, value in enumerate(values) if isinstance(value, Hole))
            for j, _ in holes:  # filled per call; the template keeps no array alive
                values[j] = None
            if i == 0:  # the attention kernel: its spec's block (mma: the tiling's warps)
                block, shared = (spec.threads, 1, 1), spec.shared_bytes
                dependent = False
            else:  # the merge
                block, shared = (self._block[1], 1, 1), 0
                dependent = self.config.impl == "mma" and self.config.dependent_launch
            template.append((module, grid.kernel, plan.launch_grid(i), block, shared, values, holes, dependent))
        return tuple(template)
