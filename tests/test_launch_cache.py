"""One object's cached fast path against a fresh object, call by call (issue 30, defect 1).

``DecodeAttention.run`` reuses what it validated and bound for an earlier call (the last
call's launches for the same buffers; a launch template per plan, scalars and array
layouts). A hypothesis state machine drives ONE object through a sequence of calls, each
changing one argument from the call before (the shape or values of device scales, the
batch, the query tokens, the lse, strided views, lengths, a buffer moved to another
address, a refused call in between), and every call's output bytes must be those a fresh
object gives for the same arguments. The machine draws the object's own construction too:
dense or CSR page table, a window, fp32 out, multi-token, device or host scales.

The default run takes a short fixed sample (a few seconds on the CPU backend once its
kernels are cached); the slow step runs longer sequences.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from metrale_attn import DecodeAttention
from metrale_attn.problems import make_problem

from support.optional import import_torch

H, KV, D, PAGE = 4, 2, 64, 4
MAX_BATCH, MAX_LEN = 3, 24
# The objects the machine drives: one per draw. The default profile's two cover the features
# the stateful rules touch (device scales, CSR, a window, fp32 out, multi-token) in two
# kernel builds each; the slow profile adds host scales and plainer layers.
CONSTRUCTIONS = {
    "default": [  # two splits: the split-K arm and its merge, on few CTAs (the CPU backend's time)
        dict(device_scales=True, max_q_len=2, splitk="2"),
        dict(device_scales=True, page_table="csr", window_left=5, out_dtype="float32", max_q_len=2, splitk="2"),
    ],
    "slow": [
        dict(device_scales=True, max_q_len=2, splitk="2"),
        dict(device_scales=True, page_table="csr", window_left=5, out_dtype="float32", max_q_len=2, splitk="2"),
        dict(device_scales=True, max_q_len=2),
        dict(device_scales=True, page_table="csr"),
        dict(device_scales=True, window_left=3, splitk="off"),
        dict(max_q_len=2, page_table="csr"),
        dict(window_left=5, out_dtype="float32", splitk="4"),
    ],
}
# Scale values: per-head ones differ between the heads, so a per-tensor read of a per-head
# array (or the reverse) changes bytes.
SCALES = st.lists(st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0]), min_size=KV, max_size=KV)
MOVABLE = ("q", "k_cache", "v_cache", "page_table", "k_scales", "v_scales", "out", "lse")


def _moved(a: np.ndarray) -> np.ndarray:
    """``a``'s values in a new buffer of the same layout (another address)."""
    return np.array(a, copy=True, order="K")


def _strided(a: np.ndarray, axis: int, pad: int) -> np.ndarray:
    """``a``'s values as a view of a buffer ``pad`` larger along ``axis`` (strides change)."""
    shape = list(a.shape)
    shape[axis] += pad
    wide = np.zeros(shape, a.dtype)
    view = wide[tuple(slice(0, n) for n in a.shape)]
    view[...] = a
    return view


class OneObjectAgainstAFreshOne(RuleBasedStateMachine):
    """Each rule changes one argument and calls; the invariant compares the bytes."""

    profile = "default"

    def __init__(self):
        super().__init__()
        self.attn = None

    @initialize(which=st.integers(0, 99), seed=st.integers(0, 2**16))
    def build(self, which, seed):
        constructions = CONSTRUCTIONS[self.profile]
        self.options = constructions[which % len(constructions)]
        rng = np.random.default_rng(seed)
        self.p = make_problem(rng, num_seqs=MAX_BATCH, num_q_heads=H, num_kv_heads=KV, head_dim=D, page_size=PAGE,
                              seq_lens=[MAX_LEN] * MAX_BATCH, kv_dtype="fp8", q_dtype="bf16")
        self.rng = rng
        self.attn = self._fresh()
        self.k_cache, self.v_cache = self.p.k_cache, self.p.v_cache
        self.batch, self.q_len, self.four_d = 2, 1, False
        self.lens = [MAX_LEN, 5, 9][:self.batch]
        self.q_pad = 0
        self.scales_per_head, self.k_values, self.v_values = False, [0.5, 0.5], [2.0, 2.0]
        self.host = (0.5, 2.0)
        self.want_lse = True
        self._new_q()
        self._new_page_table()
        self._new_scales()
        self._new_outputs()
        self.refused = None

    def _fresh(self) -> DecodeAttention:
        return DecodeAttention(H, KV, D, PAGE, q_dtype="bf16", kv_dtype="fp8", max_batch=MAX_BATCH, backend="cpu",
                               **self.options)

    @property
    def device_scales(self) -> bool:
        return self.options.get("device_scales", False)

    # -- the arrays of a call, rebuilt only where a rule changed them ------------------------

    def _new_q(self):
        four = self.four_d or self.q_len > 1
        shape = (self.batch, self.q_len, H, D) if four else (self.batch, H, D)
        q = self.rng.standard_normal(shape).astype(self.p.q.dtype)
        self.q = _strided(q, -2, self.q_pad) if self.q_pad else q

    def _new_page_table(self):
        n, lens = self.batch, np.array(self.lens[:self.batch], np.int32)
        if self.options.get("page_table") != "csr":
            self.page_table = dict(block_tables=self.p.block_tables[:n].copy(), seq_lens=lens)
            return
        pages = [-(-int(x) // PAGE) for x in lens]
        indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
        indices = np.concatenate([self.p.block_tables[s, :k] for s, k in enumerate(pages)] + [np.zeros(0, np.int32)])
        last = np.array([int(x) - (k - 1) * PAGE if k else 0 for x, k in zip(lens, pages)], np.int32)
        self.page_table = dict(kv_indptr=indptr, kv_indices=indices.astype(np.int32), kv_last_page_len=last)

    def _new_scales(self):
        if not self.device_scales:
            self.scales = dict(k_scale=self.host[0], v_scale=self.host[1])
            return
        n = KV if self.scales_per_head else 1
        self.scales = dict(k_scales=np.array(self.k_values[:n], np.float32),
                           v_scales=np.array(self.v_values[:n], np.float32))

    def _new_outputs(self):
        rows = self.q.shape[:-1]
        dtype = np.float32 if self.options.get("out_dtype") == "float32" else self.p.q.dtype
        self.out = np.empty(rows + (D,), dtype)
        self.lse = np.empty(rows, np.float32) if self.want_lse else None

    def _arguments(self, out, lse) -> dict:
        return dict(q=self.q, k_cache=self.k_cache, v_cache=self.v_cache, out=out, lse=lse,
                    return_lse=True, **self.page_table, **self.scales)

    # -- the rules: one argument changes, then the call ---------------------------------------

    @rule(per_head=st.booleans(), k=SCALES, v=SCALES)
    def scales_change_shape_or_values(self, per_head, k, v):
        if not self.device_scales:
            self.host = (k[0], v[-1])
        self.scales_per_head, self.k_values, self.v_values = per_head, k, v
        self._new_scales()

    @rule(k=SCALES)
    def device_scales_change_in_place(self, k):
        if self.device_scales:  # the same buffer, new values: the kernels read them at run time
            self.scales["k_scales"][...] = k[:self.scales["k_scales"].size]

    @rule(batch=st.integers(0, MAX_BATCH))
    def batch_changes(self, batch):
        self.batch = batch
        self.lens = (self.lens + [MAX_LEN, 3, 1])[:MAX_BATCH]
        self._new_q()
        self._new_page_table()
        self._new_outputs()

    @rule(q_len=st.integers(1, 2), four_d=st.booleans())
    def query_tokens_change(self, q_len, four_d):
        self.q_len = min(q_len, self.options.get("max_q_len", 1))
        self.four_d = four_d and self.options.get("max_q_len", 1) > 1
        self._new_q()
        self._new_outputs()

    @rule(lens=st.lists(st.integers(0, MAX_LEN), min_size=MAX_BATCH, max_size=MAX_BATCH))
    def lengths_change(self, lens):
        self.lens = lens
        self._new_page_table()

    @rule(want=st.booleans())
    def lse_given_or_not(self, want):
        self.want_lse = want
        self._new_outputs()

    @rule(pad=st.sampled_from([0, 1, 2]))
    def q_strides_change(self, pad):
        self.q_pad = pad
        self._new_q()

    @rule(pad=st.sampled_from([0, 1]), axis=st.sampled_from([0, 2]))
    def cache_strides_change(self, pad, axis):
        self.k_cache = _strided(self.p.k_cache, axis, pad) if pad else self.p.k_cache
        self.v_cache = _strided(self.p.v_cache, axis, pad) if pad else self.p.v_cache

    @rule(which=st.sampled_from(MOVABLE))
    def a_buffer_moves(self, which):
        if which in ("q", "k_cache", "v_cache"):
            setattr(self, which, _moved(getattr(self, which)))
        elif which == "page_table":
            self.page_table = {name: _moved(a) for name, a in self.page_table.items()}
        elif which in self.scales and isinstance(self.scales[which], np.ndarray):
            self.scales[which] = _moved(self.scales[which])
        elif which == "out":
            self.out = np.empty_like(self.out)
        elif which == "lse" and self.lse is not None:
            self.lse = np.empty_like(self.lse)

    @rule(kind=st.sampled_from(["out dtype", "scales dtype", "scales length", "lse shape"]))
    def a_refused_call_in_between(self, kind):
        """A call both objects refuse leaves nothing behind that the next call reuses."""
        args = self._arguments(self.out, self.lse)
        if kind == "out dtype":
            args["out"] = np.empty(self.out.shape, np.float16)
        elif kind == "lse shape":
            args["lse"] = np.empty(self.out.shape[:-1] + (2,), np.float32)
        elif self.device_scales and kind == "scales dtype":
            args["k_scales"] = self.scales["k_scales"].astype(np.float64)
        elif self.device_scales:
            args["v_scales"] = np.ones(KV + 1, np.float32)
        else:
            args["k_scale"] = -1.0
        for attn in (self.attn, self._fresh()):
            with pytest.raises(ValueError):
                attn.run(**args)

    # -- every step: the object's bytes are a fresh object's ---------------------------------

    @invariant()
    def the_bytes_are_a_fresh_objects(self):
        if self.attn is None:
            return
        self.out[...] = np.nan
        if self.lse is not None:
            self.lse[...] = np.nan
        out, lse = self.attn.run(**self._arguments(self.out, self.lse))
        fresh_out, fresh_lse = self._fresh().run(**self._arguments(np.full_like(self.out, np.nan), None))
        assert out is self.out
        assert out.tobytes() == fresh_out.tobytes(), "out differs from a fresh object's"
        assert lse.tobytes() == fresh_lse.tobytes(), "lse differs from a fresh object's"
        assert not np.isnan(out.astype(np.float32)).any()


def _run(profile: str, examples: int, steps: int) -> None:
    machine = type(f"OneObjectAgainstAFreshOne_{profile}", (OneObjectAgainstAFreshOne,), {"profile": profile})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=examples, stateful_step_count=steps, deadline=None, database=None, derandomize=True,
        suppress_health_check=list(HealthCheck), print_blob=True))


def test_one_object_called_with_one_argument_changed_at_a_time_gives_a_fresh_objects_bytes_every_call():
    _run("default", examples=12, steps=8)


@pytest.mark.slow
def test_one_object_called_with_one_argument_changed_at_a_time_gives_a_fresh_objects_bytes_on_long_sequences():
    _run("slow", examples=100, steps=25)


def test_a_device_scales_object_called_with_per_tensor_then_per_head_scales_gives_a_fresh_objects_bytes():
    """Defect 1: both scale shapes have strides (1,); the launch read the first call's stride
    (0: one value) for per-head scales, and in the other order read past a one-value array."""
    p = make_problem(np.random.default_rng(3), num_seqs=2, num_q_heads=H, num_kv_heads=KV, head_dim=D,
                     page_size=PAGE, seq_lens=[5, 20], kv_dtype="fp8", q_dtype="bf16")
    one = dict(k_scales=np.array([0.5], np.float32), v_scales=np.array([2.0], np.float32))
    per_head = dict(k_scales=np.array([0.5, 3.0], np.float32), v_scales=np.array([2.0, 0.25], np.float32))

    def fresh():
        return DecodeAttention(H, KV, D, PAGE, q_dtype="bf16", kv_dtype="fp8", max_batch=2, backend="cpu",
                               device_scales=True)

    def call(attn, scales):
        return attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, return_lse=True, **scales)

    def call_op(attn, scales):  # the same call through torch.ops.metrale_attn.paged_decode
        torch = import_torch()
        from metrale_attn.torch_op import from_numpy, to_numpy

        out, lse = from_numpy(np.full_like(p.q, np.nan)), torch.full(p.q.shape[:-1], float("nan"))
        torch.ops.metrale_attn.paged_decode(
            attn.handle, *(from_numpy(a) for a in (p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)), out, lse,
            1.0, 1.0, None, *(torch.from_numpy(scales[name]) for name in ("k_scales", "v_scales")))
        return to_numpy(out), to_numpy(lse)

    for run in (call, call_op):
        for first, second in ((one, per_head), (per_head, one)):
            attn = fresh()
            run(attn, first)
            got, want = run(attn, second), run(fresh(), second)
            assert [a.tobytes() for a in got] == [a.tobytes() for a in want], run.__name__


def test_every_array_argument_reaches_the_binder_by_name_has_a_checker_and_is_in_the_ops_schema(monkeypatch):
    """The cache keys (the fingerprints, the templates' layouts) range over ``ARRAY_ARGUMENTS``:
    an array argument of ``run`` that is not there, or arrives at another position, would be
    bound without being keyed. ``run`` passes each by its name, in that order."""
    import inspect

    from metrale_attn.binding import ARGUMENTS
    from metrale_attn.validation import ARRAY_ARGUMENTS, CHECKERS

    assert len(CHECKERS) == len(ARRAY_ARGUMENTS) and set(ARRAY_ARGUMENTS) <= set(ARGUMENTS)
    assert set(ARRAY_ARGUMENTS) <= set(inspect.signature(DecodeAttention.run).parameters)
    attn = DecodeAttention(H, KV, D, PAGE, q_dtype="bf16", kv_dtype="bf16", max_batch=1, backend="cpu")
    seen = []

    class Stop(Exception):
        pass

    def bind(arrays, k_scale, v_scale):
        seen.append(arrays)
        raise Stop

    monkeypatch.setattr(attn._binder, "bind", bind)
    sentinels = {name: object() for name in ARRAY_ARGUMENTS}
    with pytest.raises(Stop):
        attn.run(**sentinels)
    assert seen == [tuple(sentinels[name] for name in ARRAY_ARGUMENTS)]
    import_torch()
    from metrale_attn import torch_op

    assert all(f" {name}" in torch_op.SCHEMA for name in ARRAY_ARGUMENTS)
