"""``metrale_attn.serving.ModelAttention``: one model's layers over one torch workspace, the
object the example decode loop and the vLLM backend both decode through."""

from __future__ import annotations

import numpy as np
import pytest

from support.optional import import_torch
from support.problems import problem

torch = import_torch()

from metrale_attn import tolerance, workspace_bytes  # noqa: E402
from metrale_attn.serving import ModelAttention  # noqa: E402
from metrale_attn.torch_op import from_numpy, to_numpy  # noqa: E402


def test_the_workspace_is_sized_for_the_largest_reserved_shape_and_every_layer_shares_it():
    model = ModelAttention("cpu", max_batch=8, max_q_len=2)
    model.reserve(4, 2, 64)
    model.reserve(8, 2, 128)
    model.reserve(4, 4, 64)
    assert model.workspace_nbytes == workspace_bytes([(4, 2, 64), (8, 2, 128), (4, 4, 64)], max_batch=8, max_q_len=2,
                                                     backend="cpu")
    workspace = model.allocate()
    assert isinstance(workspace, torch.Tensor) and workspace.dtype == torch.uint8
    assert workspace.numel() == model.workspace_nbytes and model.allocate() is workspace
    a = model.layer(4, 2, 64, 16, q_dtype="bfloat16", kv_dtype="bfloat16")
    b = model.layer(8, 2, 128, 16, q_dtype="bfloat16", kv_dtype="fp8_e4m3", window_left=31)
    assert a.workspace is workspace and b.workspace is workspace and model.layers == [a, b]
    assert a.max_q_len == b.max_q_len == 2 and b.window_left == 31


def test_a_shape_needing_more_workspace_is_refused_once_a_layer_is_built_on_it():
    model = ModelAttention("cpu", max_batch=4)
    model.layer(4, 2, 64, 16, q_dtype="bfloat16", kv_dtype="bfloat16")
    model.reserve(4, 2, 64)  # the same need: nothing moves
    with pytest.raises(ValueError, match="reserve every layer shape before building the first layer"):
        model.reserve(32, 2, 128)


def test_a_larger_shape_reserved_before_any_layer_replaces_an_unused_workspace():
    model = ModelAttention("cpu", max_batch=4)
    model.reserve(4, 2, 64)
    small = model.allocate()
    model.reserve(16, 2, 128)
    assert model.allocate() is not small and model.allocate().numel() == model.workspace_nbytes > small.numel()


def test_decode_through_the_op_meets_the_bar_on_torch_tensors():
    p = problem(seed=3, seq_lens=(0, 1, 37, 300), num_q_heads=8, num_kv_heads=2)
    model = ModelAttention("cpu", max_batch=4)
    attn = model.layer(8, 2, 64, 16, q_dtype=p.q.dtype, kv_dtype=p.k_cache.dtype)
    out = torch.full(p.q.shape, float("nan"), dtype=torch.bfloat16)
    args = [from_numpy(a) for a in (p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens)]
    assert ModelAttention.decode(attn.handle, *args, out) is out
    tolerance.assert_close_to_reference(to_numpy(out), p.reference(), v_absmax=p.v_absmax())
    assert not to_numpy(out)[0].astype(np.float32).any()  # seq_len 0: zeros


@pytest.mark.filterwarnings("ignore:.*576, 512.*has no mma kernel:RuntimeWarning")
def test_an_mla_layer_reserves_and_shares_the_workspace_by_its_v_head_dim():
    model = ModelAttention("cpu", max_batch=4)
    attn = model.layer(16, 1, 576, 16, q_dtype="bfloat16", kv_dtype="bfloat16", v_head_dim=512)
    assert model.workspace_nbytes == workspace_bytes([(16, 1, 576, 512)], max_batch=4, backend="cpu")
    assert attn.workspace is model.allocate() and attn.config.shape.v_head_dim == 512
