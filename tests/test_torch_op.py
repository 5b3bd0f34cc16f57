"""``torch.ops.metrale_attn.paged_decode`` on the CPU backend: eager, under
``torch.compile(fullgraph=True)`` (no graph break; the op in the graph; the same bytes as
eager), its fake implementation, and handles. The CUDA graph cases are in test_gpu.py."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from metrale_attn import DecodeAttention

from support.optional import import_torch
from support.problems import check_against_reference, decoder, problem

torch = import_torch()
from metrale_attn.torch_op import decode, from_numpy, to_numpy  # noqa: E402

OP = torch.ops.metrale_attn.paged_decode


def _case(seed=1, **kw):
    p = problem(seed=seed, seq_lens=(0, 1, 37, 300), kv_dtype="fp8", **kw)
    attn = decoder(p, splitk="3")
    return p, attn, tuple(from_numpy(a) for a in (p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens))


def test_the_op_writes_out_and_lse_in_place_like_run():
    p, attn, (q, k, v, bt, sl) = _case()
    out = torch.full(q.shape, float("nan"), dtype=q.dtype)
    lse = torch.full(q.shape[:2], float("nan"))
    assert OP(attn.handle, q, k, v, bt, sl, out, lse, p.k_scale, p.v_scale) is None
    check_against_reference(p, to_numpy(out), to_numpy(lse))
    again = decode(attn, q, k, v, bt, sl, k_scale=p.k_scale, v_scale=p.v_scale)  # the helper, lse left out
    assert again.data_ptr() != out.data_ptr() and torch.equal(again.view(torch.int16), out.view(torch.int16))


def _step(handle, k_scale, v_scale):
    """A decode step as a model writes it: q a strided view of a fused qkv activation, out
    allocated inside, a reshape after."""

    def step(qkv, k, v, bt, sl):
        n = qkv.shape[0]
        q = qkv[:, :4 * 64].view(n, 4, 64)
        out = torch.empty((n, 4, 64), dtype=qkv.dtype)
        lse = torch.empty((n, 4), dtype=torch.float32)
        torch.ops.metrale_attn.paged_decode(handle, q, k, v, bt, sl, out, lse, k_scale, v_scale)
        return out.view(n, 4 * 64), lse

    return step


def _qkv(p):
    qkv = torch.zeros((p.q.shape[0], 4 * 64 + 2 * 2 * 64), dtype=torch.bfloat16)
    qkv[:, :256] = from_numpy(p.q).reshape(p.q.shape[0], -1)
    return qkv


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_decode_step_compiles_with_fullgraph_and_gives_the_eager_bytes(backend):
    torch._dynamo.reset()
    p, attn, (_, k, v, bt, sl) = _case(seed=2)
    qkv = _qkv(p)
    step = _step(attn.handle, p.k_scale, p.v_scale)
    eager_out, eager_lse = step(qkv, k, v, bt, sl)
    compiled = torch.compile(step, fullgraph=True, backend=backend)
    out, lse = compiled(qkv, k, v, bt, sl)
    assert torch.equal(out.view(torch.int16), eager_out.view(torch.int16)) and torch.equal(lse, eager_lse)
    check_against_reference(p, to_numpy(out).reshape(p.q.shape), to_numpy(lse))
    # The next step: new lengths in place, the same compiled code.
    p2 = type(p)(p.q, p.k_cache, p.v_cache, p.block_tables, np.array([0, 1, 40, 290], np.int32), p.k_scale,
                 p.v_scale, p.kv_layout)
    sl.copy_(from_numpy(p2.seq_lens))
    out, lse = compiled(qkv, k, v, bt, sl)
    check_against_reference(p2, to_numpy(out).reshape(p.q.shape), to_numpy(lse))


def test_the_compiled_graph_is_one_graph_that_holds_the_op():
    torch._dynamo.reset()
    p, attn, (_, k, v, bt, sl) = _case(seed=3)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compile(_step(attn.handle, p.k_scale, p.v_scale), fullgraph=True, backend=record)(_qkv(p), k, v, bt, sl)
    assert len(graphs) == 1
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert OP in targets or OP.default in targets


def test_the_fake_implementation_refuses_a_wrong_rank_at_trace_time():
    torch._dynamo.reset()
    p, attn, (q, k, v, bt, sl) = _case(seed=4)

    def bad(q, k, v, bt, sl):
        out = torch.empty(q.shape[0], 4 * 64, dtype=q.dtype)  # flattened: the op wants [n, heads, dim]
        torch.ops.metrale_attn.paged_decode(attn.handle, q, k, v, bt, sl, out, None, 1.0, 1.0)
        return out

    with pytest.raises(Exception, match="q and out must be \\[num_seqs, \\(q_len,\\) num_q_heads, head_dim\\]"):
        torch.compile(bad, fullgraph=True, backend="aot_eager")(q, k, v, bt, sl)


def test_handles_name_live_objects_only():
    p, attn, (q, k, v, bt, sl) = _case(seed=5)
    handle = attn.handle
    assert attn.handle == handle and DecodeAttention.from_handle(handle) is attn
    other = decoder(p)
    assert other.handle != handle
    del attn
    gc.collect()
    with pytest.raises(ValueError, match=f"no live DecodeAttention has handle {handle}"):
        OP(handle, q, k, v, bt, sl, torch.empty_like(q), None, 1.0, 1.0)


def test_the_op_refuses_bad_input_with_runs_errors():
    p, attn, (q, k, v, bt, sl) = _case(seed=6)
    with pytest.raises(ValueError, match="out overlaps q"):
        OP(attn.handle, q, k, v, bt, sl, q, None, 1.0, 1.0)


def test_the_op_schema_names_the_arguments_of_paged_decode_and_of_run_in_order():
    """The schema is written once (torch_op.SCHEMA); the function that implements it, its fake
    and DecodeAttention.run must agree with it on every name, order and default."""
    import inspect

    from metrale_attn import torch_op

    schema = torch.ops.metrale_attn.paged_decode.default._schema
    names = [a.name for a in schema.arguments]
    defaults = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    for fn in (torch_op.paged_decode, torch_op._paged_decode_fake):
        params = inspect.signature(fn).parameters
        assert list(params) == names, fn
        assert {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty} == defaults, fn
    run = inspect.signature(DecodeAttention.run).parameters
    assert set(names) - {"handle"} <= set(run)
    assert all(run[n].default == d for n, d in defaults.items())
    assert [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write] == ["out", "lse"]
