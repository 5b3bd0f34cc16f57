"""Decode problems and what serves them: a problem (metrale_attn.problems), the ``DecodeAttention``
that fits it, a NaN-poisoned run on any backend, the check against the float64 reference under
the one bar, each arm's options, a ``LayerConfig`` for plan tests, and a CPU backend that counts
what it loads and launches."""

from __future__ import annotations

import numpy as np

from metrale_attn import DecodeAttention, tolerance
from metrale_attn.backends.cpu_backend import CpuBackend
from metrale_attn.config import LayerConfig, ModelShape
from metrale_attn.problems import Problem, make_problem
from metrale_attn.targets import TargetPolicy

from support.backends import to_backend, to_host

ARM_OPTIONS = {
    "unpacked": dict(splitk="off", gqa_pack=False),
    "splitk": dict(splitk="auto", gqa_pack=False),
    "gqa_packed": dict(splitk="off", gqa_pack=True),
}


def layer_config(target_policy: TargetPolicy, shape: ModelShape, *, max_batch: int, page_size: int = 16, q_dtype="bf16",
                 kv_dtype="bf16", **fields) -> LayerConfig:
    """A ``LayerConfig`` for plan tests (its fields taken as valid, as ``configure`` leaves them)."""
    return LayerConfig(shape, page_size, q_dtype, kv_dtype, max_batch, target_policy, **fields)


def problem(*, seed=0, num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, seq_lens=(0, 1, 37),
            kv_dtype="bf16", q_dtype="bf16", layout="NHD", **kwargs) -> Problem:
    """A seeded ``Problem`` (``make_problem``), small by default: 4 query heads on 2 KV heads,
    head dim 64, pages of 16 tokens, sequences of 0, 1 and 37 tokens."""
    return make_problem(
        np.random.default_rng(seed), num_seqs=len(seq_lens), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, page_size=page_size, seq_lens=list(seq_lens), kv_dtype=kv_dtype, q_dtype=q_dtype,
        layout=layout, **kwargs)


def decoder(p: Problem, *, max_batch=None, backend="cpu", **options) -> DecodeAttention:
    """The ``DecodeAttention`` of ``p``'s heads, head dim, page size, dtypes and layout, for
    ``max_batch`` sequences (``p``'s batch by default), on ``backend`` (a name or a backend)."""
    return DecodeAttention(
        p.q.shape[1], p.k_cache.shape[2] if p.kv_layout == "NHD" else p.k_cache.shape[1], p.q.shape[2],
        p.k_cache.shape[1] if p.kv_layout == "NHD" else p.k_cache.shape[2],
        q_dtype=p.q.dtype, kv_dtype=p.k_cache.dtype, kv_layout=p.kv_layout,
        max_batch=max_batch or max(len(p.seq_lens), 1), backend=backend,
        **({"v_head_dim": p.v_cache.shape[-1]} if p.v_cache.shape[-1] != p.q.shape[-1] else {}), **options)


def run_poisoned(attn: DecodeAttention, p: Problem, *, q=None, out_dtype=None, csr=False, **kwargs):
    """Run with out and lse pre-filled with NaN, so anything the kernel fails to write shows.
    ``q`` replaces the problem's (multi-token: ``[num_seqs, q_len, heads, head_dim]``);
    ``csr``: the page table comes in ``kwargs`` (``kv_indptr``, ...), not the problem's; the
    problem's scales go as host floats, or as device arrays to a layer built with
    ``device_scales``; on the CPU backend the arrays are the problem's own, on the device
    copies (outputs copied back)."""
    q = p.q if q is None else q
    be = attn.backend
    out = to_backend(be, np.full(q.shape[:-1] + p.v_cache.shape[-1:], np.nan, dtype=out_dtype or q.dtype))
    lse = to_backend(be, np.full(q.shape[:-1], np.nan, dtype=np.float32))
    arrays = [to_backend(be, a) for a in (q, p.k_cache, p.v_cache) + (() if csr else (p.block_tables, p.seq_lens))]
    if attn.config.device_scales:  # the problem's scales as float32 arrays on the device (one, or one per KV head)
        scales = {f"{kv}_scales": np.atleast_1d(np.asarray(s, np.float32)) for kv, s in (("k", p.k_scale),
                                                                                         ("v", p.v_scale))}
    else:
        scales = dict(k_scale=p.k_scale, v_scale=p.v_scale)
    kwargs = {name: to_backend(be, x) if isinstance(x, np.ndarray) else x for name, x in {**scales, **kwargs}.items()}
    attn.run(*arrays, out=out, lse=lse, **kwargs)
    return to_host(out), to_host(lse)


def check_against_reference(p: Problem, out, lse, sm_scale=None):
    """``out`` within the bar of the float64 reference (the near-zero allowance from the
    problem's max|V| and max|s|), ``lse`` -inf for empty rows and within 2e-6 elsewhere."""
    ref_out, ref_lse = p.reference(return_lse=True, sm_scale=sm_scale)
    tolerance.assert_close_to_reference(out, ref_out, v_absmax=p.v_absmax(),
                                        logit_absmax=lambda: p.logit_absmax(sm_scale=sm_scale))
    empty = p.seq_lens == 0
    assert np.all(np.isneginf(lse[empty]))
    np.testing.assert_allclose(lse[~empty], ref_lse[~empty], rtol=2e-6, atol=2e-6)


def pick(p: Problem, rows) -> Problem:
    """``p``'s sequences ``rows`` (in that order, repeats allowed) over the same caches."""
    rows = list(rows)
    return Problem(p.q[rows], p.k_cache, p.v_cache, p.block_tables[rows], p.seq_lens[rows], p.k_scale, p.v_scale,
                   p.kv_layout)


def check_bytes_free_of_heads_per_cta_company_and_position(p: Problem, backend, warps: int, **options) -> None:
    """Every ``heads_per_cta`` of 1..16 gives one set of bytes, within the bar; a layer of 5
    sequences gives those bytes again, and each sequence its own, alone or among others at
    any position. ``warps``: what every spec the layer compiles runs (its tiling's W)."""
    from metrale_attn.kernels import specs_for

    first = None
    for h in (1, 2, 4, 8, 16):
        attn = decoder(p, backend=backend, heads_per_cta=h, **options)
        assert attn.plan(5).heads_per_cta == h and {v.tiling.warps for v in specs_for(attn.config).values()} == {warps}
        got = run_poisoned(attn, p)
        if first is None:
            check_against_reference(p, *got)
            first = got
        assert [a.tobytes() for a in got] == [a.tobytes() for a in first], h
    attn = decoder(p, backend=backend, max_batch=5, **options)
    assert [a.tobytes() for a in run_poisoned(attn, p)] == [a.tobytes() for a in first]
    for rows in ([3], [4, 3], [1, 3, 0], [0, 2, 4, 1, 3]):
        out, lse = run_poisoned(attn, pick(p, rows))
        for at, r in enumerate(rows):
            assert out[at].tobytes() == first[0][r].tobytes() and lse[at].tobytes() == first[1][r].tobytes(), rows


def check_features_within_bar_and_on_fewer_persistent_ctas(attn: DecodeAttention, p: Problem, q, sink_values,
                                                           monkeypatch, **options) -> None:
    """``attn`` (built from ``p`` with ``options``: a window, sinks, several query tokens; ``q``
    and ``sink_values`` the call's) is
    within the bar of the float64 reference, lse included, and a layer of the same options
    on 3 persistent CTAs, fewer than its items so that each walks several, gives the same bytes."""
    full = run_poisoned(attn, p, q=q, sinks=sink_values)
    ref_out, ref_lse = p.reference(return_lse=True, q=q, window_left=options["window_left"], sinks=sink_values)
    tolerance.assert_close_to_reference(full[0], ref_out, v_absmax=p.v_absmax())
    neg = np.isneginf(ref_lse)
    assert np.all(np.isneginf(full[1][neg]))
    np.testing.assert_allclose(full[1][~neg], ref_lse[~neg], rtol=2e-6, atol=2e-6)
    monkeypatch.setattr("metrale_attn.plan.persistent_ctas", lambda tiling, target: 3)
    few = decoder(p, backend=attn.backend, **options)
    assert few.plan(4).items > 3
    assert [a.tobytes() for a in run_poisoned(few, p, q=q, sinks=sink_values)] == [a.tobytes() for a in full]


class CountingBackend(CpuBackend):
    """A CPU backend that records every spec it loads and every launch (and so proves a
    refusal launched nothing): ``launches`` the kernels' names, ``launched`` the ``Launch``es."""

    def __init__(self):
        super().__init__()
        self.launches = []
        self.launched = []
        self.loaded = []

    def load(self, spec):
        self.loaded.append(spec.name)
        module, names, launched = super().load(spec), self.launches, self.launched

        class Counting:
            def launch(self, launch):
                names.append(launch.kernel)
                launched.append(launch)
                module.launch(launch)

        return Counting()


def to_csr(p: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``p``'s page table in FlashInfer's CSR form ``(kv_indptr, kv_indices, kv_last_page_len)``,
    int32: each sequence's used pages, in order, one sequence after another (written here
    independently of the library's own conversion)."""
    page_size = p.k_cache.shape[1] if p.kv_layout == "NHD" else p.k_cache.shape[2]
    pages = [-(-int(n) // page_size) for n in p.seq_lens]
    indptr = np.concatenate([[0], np.cumsum(pages)]).astype(np.int32)
    indices = np.concatenate([p.block_tables[s, :n] for s, n in enumerate(pages)] + [np.zeros(0, np.int32)])
    last = np.array([int(n) - (k - 1) * page_size if k else 0 for n, k in zip(p.seq_lens, pages)], np.int32)
    return indptr, indices.astype(np.int32), last
