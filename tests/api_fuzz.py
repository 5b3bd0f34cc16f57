"""The API fuzz's child process: random constructor and run arguments, valid and invalid,
every feature combination, NumPy arrays and torch tensors through the op, and merge_states.

Each case must end in one of two ways: a ``ValueError``/``TypeError`` before any kernel
launched, or outputs within the bar of the float64 reference. Anything else (another
exception, a launch before a refusal, a NaN, a miss) is a failure that names the case; a
crash kills this process, which ``tests/test_api_fuzz.py`` runs as a child so that a crash
is a failed test, not a dead pytest. Each case is printed before it runs, so the last line
names the one that crashed.

    python tests/api_fuzz.py --examples 40 --seed 1 [--profile default|wide]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import hypothesis
import ml_dtypes
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from metrale_attn import DecodeAttention, merge_states, reference, tolerance  # noqa: E402
from metrale_attn.backends import cpu_backend  # noqa: E402
from metrale_attn.problems import make_problem  # noqa: E402

REFUSALS = (ValueError, TypeError)
LAUNCHES: list = []

_real_launch = cpu_backend._CpuModule.launch


def _counting_launch(self, launch):
    LAUNCHES.append(launch.kernel)
    return _real_launch(self, launch)


cpu_backend._CpuModule.launch = _counting_launch

KV_DTYPES = {"bf16": ml_dtypes.bfloat16, "fp16": np.float16, "fp8_e4m3": ml_dtypes.float8_e4m3fn,
             "fp8_e5m2": ml_dtypes.float8_e5m2}
PROFILES = {
    # The default run's sample: few distinct kernel specs (cached builds), every argument's
    # invalid spellings.
    "default": dict(head_dims=[64], heads=[(4, 2), (2, 2), (4, 1)], kv=["bf16", "fp8_e4m3"], q=["bf16"],
                    q_lens=[1, 2]),
    # The slow run's: every head dim, dtype pair and multi-token length.
    "wide": dict(head_dims=[64, 80, 128, 144, 256], heads=[(4, 2), (2, 2), (4, 1), (6, 1), (8, 2), (16, 2)],
                 kv=list(KV_DTYPES), q=["bf16", "fp16"], q_lens=[1, 2, 3, 8]),
}


CTOR_OPTIONS = {  # argument -> (valid values, invalid values)
    "page_size": ([1, 7, 16, 256], [0, 257, -1, 16.5]),
    "kv_layout": (["NHD", "HND", " hnd "], ["XYZ", ""]),
    "max_batch": ([1, 3, 4], [0, -1, 3.5]),
    "splitk": ([None, "auto", "off", "4", "legacy"], ["bogus", 4]),
    "impl": ([None, "mma", "mma", "mma", "simt"], ["tensor"]),
    "heads_per_cta": ([None, None, 1, 2], [3, 0, True, "2"]),
    "window_left": ([-1, -1, 0, 5, 300, 2**31 - 1], [-2, 2**31]),
    "logits_soft_cap": ([None, None, 0.0, 30.0, 5.0], [-1.0, float("inf"), float("nan"), 3e38, 1e-39]),
    "sinks": ([False, False, True], ["yes", 1]),
    "out_dtype": ([None, None, "float32"], ["int8"]),
    "sm_scale": ([None, None, 0.05, 1.0], [0.0, -1.0, float("nan")]),
    "device_scales": ([False, False, True], ["yes", 1]),
    "lse_base": (["e", "e", 2], [10, "ln"]),
    "page_table": (["dense", "dense", "csr"], ["coo"]),
    "dependent_launch": ([None, None, True, False], ["yes", 1]),
    # values narrower than keys: only MLA's (576, 512), a shape of its own (tests/test_mla.py);
    # here every other spelling must be refused before a launch, whatever the head dim
    "v_head_dim": ([None, None], [0, -1, 2.0, True, "512", 512, 600, float("nan")]),
}
RUN_OPTIONS = {
    # "wrap": a length past 2**31 - 1 (a CSR table at page_size 256 can say it; else seq_lens' largest)
    "bad_length": ([None], [-1, "over", "wrap"]),
    "bad_page": ([None], [-1, "pool", 0x3FFFFFFF]),
    "k_scale": ([1.0, 0.5], [0.0, -1.0, float("nan"), 1e39, True]),
    "v_scale": ([1.0, 2.0], [0.0, float("inf")]),
    "q_dtype": (["same"], ["other"]),
    "out": (["new", "given", "given"], ["read-only", "is q", "wrong dtype", "strided"]),
    "lse": ([None, "given"], ["misaligned", "read-only"]),
    "sinks": (["values", "values"], ["none", "nan", "+inf", "huge", "wrong shape"]),
    # device_scales: the scales' array (one value, or one per KV head, the heads' values apart), or a
    # bad one; a valid call is followed by one of the other shape on the same object
    "scales": (["one", "per head"], ["float64", "wrong length", "floats too"]),
    "torch_layout": (["strided"], ["sparse q", "sparse out"]),  # the torch path's; NumPy has strided arrays only
}


def _pick(draw, options: dict, *, valid_share: int):
    """One value per argument, valid but for at most one (``valid_share`` in ``len(options)
    + valid_share`` cases have none invalid): so that each refusal is reached on its own."""
    bad = draw(st.sampled_from([None] * valid_share + list(options)))
    return {name: draw(st.sampled_from(invalid if name == bad else valid)) for name, (valid, invalid) in options.items()}


@st.composite
def decode_cases(draw, profile: dict):
    heads, kv_heads = draw(st.sampled_from(profile["heads"]))
    shape = {"num_q_heads": ([heads], [3, 0, -4, 2.0, True]), "num_kv_heads": ([kv_heads], [0, 5, None]),
             "head_dim": (profile["head_dims"], [72, 0, 528]), "q_dtype": (profile["q"], ["float32", "int8", None]),
             "kv_dtype": (profile["kv"], ["float32", "int4"]), "max_q_len": (profile["q_lens"], [0, 9])}
    ctor = _pick(draw, {**shape, **CTOR_OPTIONS}, valid_share=24)
    max_batch = ctor["max_batch"] if isinstance(ctor["max_batch"], int) and ctor["max_batch"] > 0 else 1
    max_q = ctor["max_q_len"] if isinstance(ctor["max_q_len"], int) and 1 <= ctor["max_q_len"] <= 8 else 1
    page = ctor["page_size"] if isinstance(ctor["page_size"], int) and 1 <= ctor["page_size"] <= 256 else 16
    run = dict(
        _pick(draw, RUN_OPTIONS, valid_share=6),
        num_seqs=draw(st.integers(0, max_batch + (1 if draw(st.integers(0, 9)) == 0 else 0))),
        q_len=draw(st.integers(1, max_q + (1 if draw(st.integers(0, 9)) == 0 else 0))),
        lengths=draw(st.lists(st.sampled_from([0, 1, 2, 17, 40, 300]), min_size=5, max_size=5)),
        torch=draw(st.booleans()) and _has_torch(),
        page=page,
        seed=draw(st.integers(0, 2**16)),
    )
    return ctor, run


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _problem(attn: DecodeAttention, run: dict):
    """Arrays for ``run`` of ``attn``'s shape (its caches, tables and lengths, any q)."""
    rng = np.random.default_rng(run["seed"])
    n = run["num_seqs"]
    lengths = run["lengths"][:n]
    kv_name = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8", "fp8e5m2": ml_dtypes.float8_e5m2}[attn.kv_dtype]
    p = make_problem(rng, num_seqs=max(n, 1), num_q_heads=attn.shape.num_q_heads, num_kv_heads=attn.shape.num_kv_heads,
                     head_dim=attn.shape.head_dim, page_size=attn.page_size, seq_lens=lengths or [0],
                     kv_dtype=kv_name, q_dtype=attn.q_dtype, layout=attn.kv_layout)
    tables, lens = p.block_tables[:n].copy(), p.seq_lens[:n].copy()
    if n and run["bad_length"] is not None:
        lens[0] = {-1: -1, "over": tables.shape[1] * attn.page_size + 1, "wrap": 2**31 - 1}[run["bad_length"]]
    if n and run["bad_page"] is not None and lens[0] > 0:
        tables[0, 0] = p.k_cache.shape[0] if run["bad_page"] == "pool" else run["bad_page"]
    q = rng.standard_normal((n, run["q_len"], attn.shape.num_q_heads, attn.shape.head_dim))
    q = q[:, 0] if run["q_len"] == 1 and attn.max_q_len == 1 else q
    q_dtype = attn.q_dtype if run["q_dtype"] == "same" else ("fp16" if attn.q_dtype == "bf16" else "bf16")
    q = q.astype(KV_DTYPES[q_dtype])
    return p, q, tables, lens


def check_decode(ctor: dict, run: dict) -> str:
    """One decode case: ``"refused"``, ``"ok"``, or an AssertionError."""
    try:
        attn = DecodeAttention(backend="cpu", **ctor)
    except REFUSALS:
        return "refused at construction"
    p, q, tables, lens = _problem(attn, run)
    H, D = attn.shape.num_q_heads, attn.shape.head_dim
    out_np_dtype = np.float32 if attn.out_dtype == "float32" else KV_DTYPES[attn.q_dtype]
    out = lse = None
    if run["out"] in ("given", "read-only", "strided", "wrong dtype"):
        shape = q.shape if run["out"] != "strided" else q.shape[:-1] + (2 * D,)
        out = np.full(shape, np.nan, np.int8 if run["out"] == "wrong dtype" else out_np_dtype)
        out = out[..., :D] if run["out"] == "strided" else out
        if run["out"] == "read-only":
            out.flags.writeable = False
    elif run["out"] == "is q":
        out = q
    if run["lse"] is not None:
        raw = np.full(math.prod(q.shape[:-1]) + 1, np.nan, np.float32)
        lse = (raw[1:] if run["lse"] == "misaligned" else raw[:-1]).reshape(q.shape[:-1])
        if run["lse"] == "misaligned":
            lse = np.frombuffer(np.zeros(lse.nbytes + 4, np.uint8).data, np.float32, lse.size, 1).reshape(lse.shape)
        if run["lse"] == "read-only":
            lse.flags.writeable = False
    sinks = None
    if attn.sinks or run["sinks"] != "values":
        sinks = np.linspace(-2, 3, H).astype(np.float32)
        sinks[::3] = -np.inf
        if run["sinks"] == "none":
            sinks = None
        elif run["sinks"] in ("nan", "+inf", "huge"):
            sinks[0] = {"nan": np.nan, "+inf": np.inf, "huge": 3e38}[run["sinks"]]
        elif run["sinks"] == "wrong shape":
            sinks = sinks[:-1] if H > 1 else np.zeros(2, np.float32)
    arrays = (q, p.k_cache, p.v_cache, tables, lens)
    pages = {}
    if attn.page_table == "csr":  # the same pages in FlashInfer's form, corrupted as the dense ones were
        arrays, pages = arrays[:3], _csr(p, tables, lens, attn.page_size, run)
    scales, k_scale, v_scale = _scales(attn, run, run["scales"])
    # torch has no read-only tensors: those cases take the NumPy path
    torch_path = run["torch"] and run["out"] != "read-only" and run["lse"] != "read-only"
    LAUNCHES.clear()
    try:
        if torch_path:
            result = _run_torch(attn, arrays, out, lse, sinks, {**scales, **pages}, run["torch_layout"])
        else:
            result = attn.run(*arrays, out=out, lse=lse, sinks=sinks, return_lse=lse is None, **scales, **pages)
    except REFUSALS as err:
        assert not LAUNCHES, f"refused after {LAUNCHES} launched: {err}"
        return "refused"
    _check_bar(attn, result, q, p, tables, lens, k_scale, v_scale, sinks, f"case {ctor} {run}")
    if attn.device_scales:  # the same object again, with scales of the other shape (one <-> per head)
        other = "per head" if run["scales"] == "one" else "one"
        scales, k_scale, v_scale = _scales(attn, run, other)
        if torch_path:
            result = _run_torch(attn, arrays, None, None, sinks, {**scales, **pages}, run["torch_layout"])
        else:
            result = attn.run(*arrays, sinks=sinks, return_lse=True, **scales, **pages)
        _check_bar(attn, result, q, p, tables, lens, k_scale, v_scale, sinks, f"case {ctor} {run}, then {other} scales")
    return "ok"


PER_HEAD = np.array([1.0, 2.0, 0.5, 4.0, 0.25, 3.0, 1.5, 0.75], np.float32)
"""Per-KV-head scale factors: the heads' values apart, so a per-head array read as one value (or
the reverse) misses the bar."""


def _scales(attn, run: dict, shape: str):
    """``run()``'s scale arguments for ``shape`` (``run["scales"]``'s spellings), and the scales the
    reference takes: host floats, or the device arrays' fp32 values (one, or one per KV head)."""
    k_scale, v_scale = float(run["k_scale"]), float(run["v_scale"])
    if not attn.device_scales:
        return dict(k_scale=run["k_scale"], v_scale=run["v_scale"]), k_scale, v_scale
    n_kv = attn.shape.num_kv_heads
    length = {"one": 1, "per head": n_kv, "float64": n_kv, "wrong length": n_kv + 1, "floats too": 1}[shape]
    factors = PER_HEAD[np.arange(length) % len(PER_HEAD)]
    with np.errstate(over="ignore", invalid="ignore"):
        k_scales, v_scales = np.float32(k_scale) * factors, np.float32(v_scale) * factors[::-1]
    dtype = np.float64 if shape == "float64" else np.float32
    scales = dict(k_scales=k_scales.astype(dtype), v_scales=v_scales.astype(dtype))
    if shape == "floats too":
        scales.update(k_scale=2.0)
    if length == 1:  # what the kernels read
        return scales, float(k_scales[0]), float(v_scales[0])
    return scales, k_scales.astype(np.float64), v_scales.astype(np.float64)


def _check_bar(attn, result, q, p, tables, lens, k_scale, v_scale, sinks, what: str) -> None:
    """A call's outputs within the bar of the float64 reference, lse included."""
    out, lse = result
    if not isinstance(out, np.ndarray):
        from metrale_attn.torch_op import to_numpy

        out, lse = to_numpy(out), to_numpy(lse)
    features = dict(sm_scale=attn.sm_scale, window_left=attn.window_left, logits_soft_cap=attn.logits_soft_cap,
                    sinks=sinks)
    ref, ref_lse = reference.paged_decode(q, p.k_cache, p.v_cache, tables, lens, kv_layout=attn.kv_layout,
                                          k_scale=k_scale, v_scale=v_scale, return_lse=True, **features)
    q_len = q.shape[1] if q.ndim == 4 else 1
    v_absmax = reference.max_abs_v_read(p.v_cache, tables, lens, kv_layout=attn.kv_layout,
                                        v_scale=v_scale, window_left=attn.window_left, q_len=q_len)
    logits = reference.max_abs_logit(q, p.k_cache, tables, lens, kv_layout=attn.kv_layout, sm_scale=attn.sm_scale,
                                     k_scale=k_scale, logits_soft_cap=attn.logits_soft_cap, sinks=sinks,
                                     window_left=attn.window_left)  # also bounds the lse check's tolerance
    tolerance.assert_close_to_reference(np.asarray(out), ref, v_absmax=v_absmax, logit_absmax=logits, what=what)
    if attn.lse_base == "2":  # base 2: the natural lse is that times ln 2
        lse = np.asarray(lse, np.float64) * math.log(2.0)
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite), "lse: the empty rows, exactly"
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=2e-6, atol=2e-6 * (1 + logits))


def _csr(p, tables, lens, page_size: int, run: dict) -> dict:
    """``tables``/``lens`` as FlashInfer's CSR arrays, with ``run``'s corruption (a length past
    its pages, a wild page id) applied to them."""
    n = len(lens)
    counts = [min(-(-max(int(x), 0) // page_size), tables.shape[1]) for x in lens]
    if n and run["bad_length"] == -1:
        counts[0] = 1  # a page whose count is -1 (the dense table's negative length)
    indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    indices = np.concatenate([tables[s, :c] for s, c in enumerate(counts)] + [np.zeros(0, np.int32)]).astype(np.int32)
    last = np.array([int(x) - (c - 1) * page_size if c else 0 for x, c in zip(lens, counts)], np.int32)
    if n and run["bad_length"] == "wrap" and page_size == 256:  # (pages - 1) * 256 + 256 = 2**31 + 256 tokens
        pages = 2**31 // page_size + 1
        indptr = np.concatenate([[0], pages + np.cumsum(counts[1:], dtype=np.int64)]).astype(np.int32)
        indices = np.concatenate([np.zeros(pages, np.int32), indices[counts[0]:]])
        last[0] = page_size
    elif n and run["bad_length"] is not None:
        last[0] = -1 if run["bad_length"] == -1 else page_size + 1
    return dict(kv_indptr=indptr, kv_indices=indices, kv_last_page_len=last)


def _run_torch(attn, arrays, out, lse, sinks, scales, layout="strided"):
    """The same call through ``torch.ops.metrale_attn.paged_decode`` on torch CPU tensors
    (``layout``: ``"sparse q"`` or ``"sparse out"`` passes that tensor in sparse storage)."""
    import torch

    from metrale_attn.torch_op import from_numpy

    q, k, v, bt, sl = (from_numpy(a) if isinstance(a, np.ndarray) and a.flags.writeable else a
                       for a in arrays + (None,) * (5 - len(arrays)))
    if out is None:
        out = np.full(arrays[0].shape, np.nan, np.float32 if attn.out_dtype == "float32" else arrays[0].dtype)
    if lse is None:
        lse = np.full(arrays[0].shape[:-1], np.nan, np.float32)
    t_out, t_lse = from_numpy(out), from_numpy(lse)
    t_sinks = None if sinks is None else torch.from_numpy(sinks)
    t_k, t_v, t_ip, t_ix, t_lp = (None if scales.get(name) is None else torch.from_numpy(scales[name])
                                  for name in ("k_scales", "v_scales", "kv_indptr", "kv_indices", "kv_last_page_len"))
    if layout == "sparse q":
        q = q.to_sparse()
    elif layout == "sparse out":
        t_out = t_out.to_sparse()
    torch.ops.metrale_attn.paged_decode(attn.handle, q, k, v, bt, sl, t_out, t_lse, scales.get("k_scale", 1.0),
                                        scales.get("v_scale", 1.0), t_sinks, t_k, t_v, t_ip, t_ix, t_lp)
    return t_out, t_lse


@st.composite
def merge_cases(draw):
    return dict(shape=draw(st.sampled_from([(0, 4), (3, 2), (2, 3, 1)])), head_dim=draw(st.sampled_from([8, 64, 65])),
                dtype=draw(st.sampled_from(["float32", "bf16", "fp16"])), empty=draw(st.sampled_from([0, 0.3, 1])),
                out=draw(st.sampled_from(["new", "given", "given", "read-only", "wrong shape", "overlaps v_a"])),
                misaligned=draw(st.sampled_from([None] * 6 + ["v_a", "s_b", "lse"])),  # one byte off its boundary
                seed=draw(st.integers(0, 2**16)))


def _misaligned(like: np.ndarray) -> np.ndarray:
    """``like``'s values one byte past an aligned address (NumPy allows unaligned arrays)."""
    raw = np.zeros(like.nbytes + 16, np.uint8)
    view = raw[1:1 + like.nbytes].view(like.dtype).reshape(like.shape)
    view[...] = like
    return view


def check_merge(case: dict) -> str:
    rng = np.random.default_rng(case["seed"])
    dtype = {"float32": np.float32, "bf16": ml_dtypes.bfloat16, "fp16": np.float16}[case["dtype"]]
    shape = case["shape"] + (case["head_dim"],)
    v_a, v_b = (rng.standard_normal(shape).astype(dtype) for _ in range(2))
    s_a, s_b = (rng.standard_normal(case["shape"]).astype(np.float32) * 5 for _ in range(2))
    s_a[rng.random(case["shape"]) < case["empty"]] = -np.inf
    out = None
    if case["out"] in ("given", "read-only"):
        out = np.full(shape, np.nan, dtype)
        out.flags.writeable = case["out"] == "given"
    elif case["out"] == "wrong shape":
        out = np.zeros(shape[:-1] + (shape[-1] + 1,), dtype)
    elif case["out"] == "overlaps v_a":
        out = v_a
    lse_given = None
    if case["misaligned"] == "v_a":
        v_a = _misaligned(v_a)
    elif case["misaligned"] == "s_b":
        s_b = _misaligned(s_b)
    elif case["misaligned"] == "lse":
        lse_given = _misaligned(np.empty(case["shape"], np.float32))
    LAUNCHES.clear()
    try:
        merged, lse = merge_states(v_a, s_a, v_b, s_b, out=out, lse=lse_given)
    except REFUSALS as err:
        assert not LAUNCHES, f"refused after a launch: {err}"
        return "refused"
    ref, ref_lse = reference.merge_states(v_a, s_a, v_b, s_b)
    v_absmax = max(float(np.abs(v_a.astype(np.float64)).max(initial=0)),
                   float(np.abs(v_b.astype(np.float64)).max(initial=0)))
    tolerance.assert_close_to_reference(merged, ref, v_absmax=v_absmax, logit_absmax=10.0, what=f"merge {case}")
    finite = np.isfinite(ref_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], ref_lse[finite], rtol=2e-6, atol=2e-6)
    return "ok"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=40)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", choices=sorted(PROFILES), default="default")
    args = parser.parse_args(argv)
    tally: dict = {}
    # A fixed seed (the same cases on every run of that seed), generated without the
    # derandomized mode's bias towards the simplest cases; shrunk when one fails.
    fuzz = settings(max_examples=args.examples, deadline=None, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck), phases=[Phase.generate, Phase.shrink])
    seeded = hypothesis.seed(args.seed)

    @seeded
    @fuzz
    @given(decode_cases(PROFILES[args.profile]))
    def decode(case):
        print(f"decode {case}", flush=True)
        verdict = check_decode(*case)
        tally[verdict] = tally.get(verdict, 0) + 1

    @seeded
    @fuzz
    @given(merge_cases())
    def merge(case):
        print(f"merge {case}", flush=True)
        verdict = check_merge(case)
        tally["merge " + verdict] = tally.get("merge " + verdict, 0) + 1

    decode()
    merge()
    print(f"FUZZ OK {sorted(tally.items())}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
