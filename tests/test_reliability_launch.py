"""Reliability, round 3, the launch side (issue 30): what a third adversarial review found in
the newest surfaces of ``run`` and construction (CSR lengths, multi-token decode under legacy
split-K, merge_states' alignment, soft-cap folds, torch tensors without strided storage, a
huge max batch). Each test pins one defect; every refusal comes before any launch and names
the argument and what was expected. Defect 1 (the launch cache) is ``test_launch_cache.py``'s."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from metrale_attn import DecodeAttention, merge_states, tolerance
from metrale_attn.cli import main
from metrale_attn.features import FEATURE_ARRAYS, FEATURE_RECORDS
from metrale_attn.policy import SplitkPolicy, num_splits, split_ref_seqs, workspace_slots
from metrale_attn.validation import ARRAY_ARGUMENTS

from support.optional import import_torch
from support.problems import CountingBackend, decoder, pick, problem, run_poisoned, to_csr

CSR = next(f for f in FEATURE_RECORDS if f.name == "csr").arrays  # kv_indptr, kv_indices, kv_last_page_len

H, KV, D = 4, 2, 64


def test_a_csr_sequence_longer_than_an_int32_holds_is_refused_naming_its_length():
    """Defect 2: (pages - 1) * page_size + kv_last_page_len past 2**31 - 1 wrapped the kernels'
    int32 length (zeros and lse -inf, silently); the dense path's seq_lens cannot hold it."""
    backend = CountingBackend()
    attn = DecodeAttention(H, KV, D, 256, q_dtype="bf16", kv_dtype="bf16", max_batch=1, backend=backend,
                           page_table="csr")
    pages = 2**31 // 256 + 1  # (pages - 1) * 256 + 1 = 2**31 + 1 tokens
    q = np.zeros((1, H, D), ml_dtypes.bfloat16)
    cache = np.zeros((1, 256, KV, D), ml_dtypes.bfloat16)
    csr = dict(kv_indptr=np.array([0, pages], np.int32), kv_indices=np.zeros(pages, np.int32),
               kv_last_page_len=np.array([1], np.int32))
    with pytest.raises(ValueError, match=r"kv_indices holds 8388609 pages of 256 tokens, 2147483904 in all: one "
                                         r"sequence of them could pass 2147483647"):
        attn.run(q, cache, cache, **csr)
    assert not backend.launches


def test_a_csr_table_whose_pages_could_hold_a_sequence_past_an_int32_is_refused_where_lengths_are_not_read():
    """The same bound where the host never reads a length (a GPU without check_indices): a sequence
    holds at most every page of kv_indices, so nnz x page_size past 2**31 - 1 is refused by its shape."""

    class DeviceLike(CountingBackend):
        always_check_indices = False  # as on a GPU: the page table's values stay on the device

    backend = DeviceLike()
    attn = DecodeAttention(H, KV, D, 256, q_dtype="bf16", kv_dtype="bf16", max_batch=1, backend=backend,
                           page_table="csr")
    pages = 2**31 // 256 + 1
    q = np.zeros((1, H, D), ml_dtypes.bfloat16)
    cache = np.zeros((1, 256, KV, D), ml_dtypes.bfloat16)
    csr = dict(kv_indptr=np.array([0, pages], np.int32), kv_indices=np.zeros(pages, np.int32),
               kv_last_page_len=np.array([1], np.int32))
    with pytest.raises(ValueError, match=rf"kv_indices holds {pages} pages of 256 tokens, {pages * 256} in all"):
        attn.run(q, cache, cache, **csr)
    assert not backend.launches


# -- defect 3: legacy split-K with multi-token decode ------------------------------------------


@given(st.integers(1, 4096), st.integers(1, 512), st.integers(1, 1024), st.integers(0, 1024), st.integers(1, 8))
def test_the_legacy_workspace_covers_every_multi_token_launch_that_splits(sms, heads, num_seqs, max_decode, q_len):
    """A multi-token call splits as a one-token call of its sequences (legacy reads sequences,
    not rows) and writes a slot per query row: sm_count slots a query token."""
    ref = split_ref_seqs(num_seqs, max_decode)
    splits = num_splits(SplitkPolicy.LEGACY, sms, heads, ref)
    slots = workspace_slots(SplitkPolicy.LEGACY, sms, heads, num_seqs * q_len, ref, q_len)
    if splits > 1:
        assert num_seqs * q_len * heads * splits <= slots == sms * q_len


def test_legacy_split_k_on_gb10_builds_for_two_query_tokens_and_meets_the_bar():
    """Defect 3: GB10's declared default, legacy, with max_q_len=2 and 8 q heads splits 6 ways
    and writes 2 x 8 x 6 = 96 slots a sequence, where the workspace held sm_count = 48:
    WorkspaceTooSmall at construction."""
    p = problem(seed=5, seq_lens=(1, 40), num_q_heads=8, num_kv_heads=2)
    attn = decoder(p, target="gb10", max_q_len=2)
    assert attn.config.target_policy.splitk.kind == "legacy" and attn.plan(1, 2).num_splits == 6
    q = np.random.default_rng(5).standard_normal((1, 2, 8, 64)).astype(p.q.dtype)
    one = pick(p, [1])
    out, lse = run_poisoned(attn, one, q=q)
    ref_out, ref_lse = one.reference(return_lse=True, q=q)
    tolerance.assert_close_to_reference(out, ref_out, v_absmax=one.v_absmax())
    np.testing.assert_allclose(lse, ref_lse, rtol=2e-6, atol=2e-6)


def test_precompile_for_gb10_with_two_query_tokens_plans_every_layer(capsys):
    code = main(["precompile", "--target", "gb10", "--q-heads", "8", "--kv-heads", "2", "--head-dim", "128",
                 "--max-q-len", "2", "--dry-run"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "multi_token" in out and "WorkspaceTooSmall" not in out + err


def test_a_max_batch_whose_workspace_count_saturates_is_refused_naming_max_batch_not_shown_as_a_size(capsys):
    """The policy counts slots in saturating unsigned 32 bits: a billion sequences reported
    "the workspace holds 4294967295 slots", a saturated count shown as a size."""
    with pytest.raises(ValueError, match=r"max_batch=1000000000 is too large: .* = 128000000000 split-K workspace "
                                         r"slots, past the 4294967295"):
        DecodeAttention(8, 2, 128, 16, q_dtype="bf16", kv_dtype="bf16", max_batch=10**9, backend="cpu",
                        target="hopper", splitk="auto")
    code = main(["precompile", "--target", "hopper", "--q-heads", "8", "--kv-heads", "2", "--head-dim", "128",
                 "--max-batch", "1000000000", "--dry-run"])
    err = capsys.readouterr().err
    assert code != 0 and "max_batch=1000000000 is too large" in err and "holds 4294967295" not in err


# -- defect 7: merge_states' alignment -------------------------------------------------------


def _misaligned(like: np.ndarray, by: int = 1) -> np.ndarray:
    """A copy of ``like`` ``by`` bytes past an aligned address (NumPy allows unaligned arrays)."""
    raw = np.zeros(like.nbytes + 16, np.uint8)
    view = raw[by:by + like.nbytes].view(like.dtype).reshape(like.shape)
    view[...] = like
    return view


@pytest.mark.parametrize("argument", ["v_a", "s_a", "v_b", "s_b", "out", "lse"])
def test_a_merge_states_argument_off_its_element_boundary_is_refused_naming_it_before_the_launch(argument):
    """Defect 7: only the CPU shim refused a misaligned state at launch; a GPU would fault."""
    rng = np.random.default_rng(7)
    arrays = dict(v_a=rng.standard_normal((3, 64)).astype(ml_dtypes.bfloat16),
                  s_a=rng.standard_normal(3).astype(np.float32),
                  v_b=rng.standard_normal((3, 64)).astype(ml_dtypes.bfloat16),
                  s_b=rng.standard_normal(3).astype(np.float32),
                  out=np.empty((3, 64), ml_dtypes.bfloat16), lse=np.empty(3, np.float32))
    arrays[argument] = _misaligned(arrays[argument])
    backend = CountingBackend()
    with pytest.raises(ValueError, match=f"^{argument} must start on a (2|4)-byte boundary"):
        merge_states(**arrays, backend=backend)
    assert not backend.launches
    for name in ("s_a", "s_b", "lse"):  # 2 bytes off: still off a float32's 4-byte boundary
        if name == argument:
            arrays[argument] = _misaligned(arrays[argument], 2)
            with pytest.raises(ValueError, match=f"^{argument} must start on a 4-byte boundary"):
                merge_states(**arrays, backend=backend)


# -- defect 8: a soft-cap no call can fold ---------------------------------------------------


@pytest.mark.parametrize("cap", [3e38, 2.4e38, 1e-38, 1e-40, 1e-45])
def test_a_soft_cap_whose_base_2_fold_is_no_normal_fp32_is_refused_at_construction_and_by_precompile(cap, capsys):
    """Defect 8: cap x log2(e) past FLT_MAX (or below its smallest normal) was accepted, and then
    every run() was refused."""
    with pytest.raises(ValueError, match=r"^logits_soft_cap = .*cap \* log2\(e\)"):
        DecodeAttention(H, KV, D, 16, q_dtype="bf16", kv_dtype="bf16", max_batch=1, backend="cpu",
                        logits_soft_cap=cap)
    code = main(["precompile", "--target", "hopper", "--q-heads", "4", "--kv-heads", "2", "--head-dim", "64",
                 "--logits-soft-cap", repr(cap), "--dry-run"])
    assert code != 0 and "logits_soft_cap = " in capsys.readouterr().err


@pytest.mark.parametrize("cap", [2.3e38, 1.2e-38 * 1.0001])
def test_a_soft_cap_whose_fold_is_a_normal_fp32_builds(cap):
    DecodeAttention(H, KV, D, 16, q_dtype="bf16", kv_dtype="bf16", max_batch=1, backend="cpu", logits_soft_cap=cap)


# -- defect 9: torch tensors without strided storage -----------------------------------------


def _torch_call(argument: str):
    """A valid call through ``run``'s torch path that takes ``argument`` (the object built with
    what makes it one: sinks, device scales, a CSR table), as keyword arguments of torch CPU
    tensors, with its object on a counting backend."""
    from metrale_attn.torch_op import from_numpy

    torch = import_torch()
    options = dict(sinks=argument == "sinks", device_scales=argument in ("k_scales", "v_scales"),
                   page_table="csr" if argument.startswith("kv_") else "dense")
    p = problem(seed=9, seq_lens=(3, 20))
    backend = CountingBackend()
    attn = decoder(p, backend=backend, **options)
    call = dict(q=from_numpy(p.q), k_cache=from_numpy(p.k_cache), v_cache=from_numpy(p.v_cache),
                out=from_numpy(np.empty_like(p.q)), lse=torch.empty(p.q.shape[:-1]))
    if options["page_table"] == "csr":
        call.update({a.name: torch.from_numpy(t) for a, t in zip(CSR, to_csr(p))})
    else:
        call.update(block_tables=torch.from_numpy(p.block_tables), seq_lens=torch.from_numpy(p.seq_lens))
    if options["sinks"]:
        call["sinks"] = torch.zeros(4)
    if options["device_scales"]:
        call.update(k_scales=torch.ones(1), v_scales=torch.ones(1))
    return attn, backend, call


@pytest.mark.parametrize("layout", ["sparse", "mkldnn"])
@pytest.mark.parametrize("argument", ARRAY_ARGUMENTS)
def test_a_torch_tensor_without_strided_storage_is_refused_naming_its_argument_by_run_and_by_the_op(argument, layout):
    """Defect 9: a sparse or mkldnn tensor failed with torch's bare "Cannot access data pointer"
    from run(), and through the op with "Could not run ... with arguments from the 'SparseCPU'
    backend"; neither named the argument."""
    torch = import_torch()
    attn, backend, call = _torch_call(argument)
    tensor = call[argument]
    call[argument] = tensor.to_sparse() if layout == "sparse" else tensor.float().to_mkldnn()
    with pytest.raises(TypeError, match=f"^{argument} must be a strided \\(dense\\) torch tensor"):
        attn.run(**call)
    op_args = {name: call.get(name) for name in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "out", "lse")}
    with pytest.raises(TypeError, match=f"^{argument} must be a strided \\(dense\\) torch tensor"):
        torch.ops.metrale_attn.paged_decode(attn.handle, *op_args.values(), 1.0, 1.0,
                                            *(call.get(a.name) for a in FEATURE_ARRAYS))
    assert not backend.launches


def test_the_vllm_options_refuse_an_unfoldable_soft_cap_by_the_same_rule():
    from metrale_attn.integrations.vllm import options

    assert options.soft_cap(30) == 30.0 and options.soft_cap(0) is None
    with pytest.raises(ValueError, match=r"^logits_soft_cap = 3e\+38: .*cap \* log2\(e\)"):
        options.soft_cap(3e38)


@pytest.mark.parametrize("num_seqs, q_len, named", [(True, 1, "num_seqs"), (1, True, "q_len"), (1.0, 1, "num_seqs"),
                                                     (1, 1.5, "q_len"), (1, "2", "q_len")])
def test_decode_attention_plan_refuses_a_count_that_is_no_int_naming_it(num_seqs, q_len, named):
    """Counts are validated as DecodeAttention validates them: True found 1's memoized plan, and
    1.5 query tokens made a plan."""
    attn = DecodeAttention(H, KV, D, 16, q_dtype="bf16", kv_dtype="bf16", max_batch=2, backend="cpu", max_q_len=2)
    attn.plan(1, 1)
    with pytest.raises(TypeError, match=f"^{named} must be an int"):
        attn.plan(num_seqs, q_len)
    assert attn.plan(np.int64(2), np.int32(2)).q_len == 2


@pytest.mark.parametrize("options", [dict(sm_scale=1e-300), dict(sm_scale=1e300),
                                     dict(sm_scale=1e-70, logits_soft_cap=1e10)])
def test_an_sm_scale_no_k_scale_can_fold_is_refused_at_construction_naming_it(options):
    """The rule behind defect 8: a value that can only fail at run time is checked at
    construction as far as it is known there. No normal fp32 k_scale brings sm_scale * log2(e)
    x k_scale (or sm_scale / cap x k_scale) into fp32's normal range, so every run() was refused."""
    with pytest.raises(ValueError, match=r"^sm_scale = .* is a normal fp32 value for no normal fp32 k_scale"):
        DecodeAttention(H, KV, D, 16, q_dtype="bf16", kv_dtype="bf16", max_batch=1, backend="cpu", **options)


def test_an_sm_scale_some_k_scale_can_fold_builds_and_runs_with_that_k_scale():
    p = problem(seed=8, seq_lens=(5, 20))
    attn = decoder(p, sm_scale=1e-70)
    out = attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, k_scale=1e38)
    assert np.isfinite(out.astype(np.float32)).all()
