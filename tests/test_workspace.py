"""One split-K workspace for many layers: sized once for several shapes, passed to every
layer's object, refused when too small, and one lock per workspace when shared."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from metrale_attn import DecodeAttention, workspace_bytes

from support.optional import import_torch
from support.problems import check_against_reference, decoder, problem, run_poisoned

SHAPES = [(4, 2, 64), (8, 2, 128), (4, 4, 64)]  # (q heads, kv heads, head_dim) of three layer kinds


def _problem(shape, seed):
    h, kv, d = shape
    return problem(seed=seed, num_q_heads=h, num_kv_heads=kv, head_dim=d, seq_lens=(300, 7, 0))


def _layer(shape, workspace=None, **options):
    h, kv, d = shape
    return DecodeAttention(h, kv, d, 16, q_dtype="bf16", kv_dtype="bf16", max_batch=3, backend="cpu", splitk="4",
                           workspace=workspace, **options)


def test_workspace_bytes_is_the_largest_need_among_the_shapes():
    needs = [_layer(s).workspace_nbytes for s in SHAPES]
    assert workspace_bytes(SHAPES, max_batch=3, backend="cpu", splitk="4") == max(needs)
    assert needs[1] == 3 * 8 * 4 * (128 + 2) * 4  # rows x q heads x splits slots of head_dim + 2 fp32
    assert workspace_bytes([(4, 2, 64)], max_batch=3, backend="cpu", splitk="off") == DecodeAttention(
        4, 2, 64, 16, q_dtype="bf16", kv_dtype="bf16", max_batch=3, backend="cpu", splitk="off").workspace_nbytes


def test_layers_of_several_shapes_share_one_workspace_and_get_the_bytes_of_private_ones():
    ws = np.empty(workspace_bytes(SHAPES, max_batch=3, backend="cpu", splitk="4"), np.uint8)
    layers = [_layer(SHAPES[i % 3], ws) for i in range(6)]  # six layers, two of each shape, one allocation
    assert all(layer.workspace is ws for layer in layers)
    assert len({id(layer._group) for layer in layers}) == 1
    for step in range(2):
        for i, layer in enumerate(layers):
            p = _problem(SHAPES[i % 3], seed=10 * step + i)
            out, lse = run_poisoned(layer, p)
            alone = run_poisoned(_layer(SHAPES[i % 3]), p)
            assert out.tobytes() == alone[0].tobytes() and lse.tobytes() == alone[1].tobytes()
            check_against_reference(p, out, lse)


def test_a_workspace_too_small_is_refused_with_both_sizes():
    need = _layer(SHAPES[1]).workspace_nbytes
    with pytest.raises(ValueError, match=rf"workspace too small: it has {need - 16} bytes, but this DecodeAttention "
                                         rf"needs {need} bytes .*metrale_attn.workspace_bytes"):
        _layer(SHAPES[1], np.empty(need - 16, np.uint8))


def _read_only(n):
    a = np.empty(n, np.uint8)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("make, match", [
    (lambda n: _read_only(n), "workspace must be writable"),
    (lambda n: np.empty(n + 16, np.uint8)[1:n + 1], "workspace must start on a 16-byte boundary"),
    (lambda n: np.empty(2 * n, np.uint8)[::2], "workspace must be a dense array"),
    (lambda n: [0.0] * n, "workspace must be a NumPy array or a torch CPU tensor"),
], ids=["read-only", "misaligned", "strided", "a-list"])
def test_a_workspace_that_cannot_hold_partials_is_refused_naming_why(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        _layer(SHAPES[0], make(_layer(SHAPES[0]).workspace_nbytes))


def test_a_torch_tensor_serves_as_a_workspace_and_another_objects_workspace_may_be_passed_on():
    torch = import_torch()
    ws = torch.empty(workspace_bytes(SHAPES, max_batch=3, backend="cpu", splitk="4"), dtype=torch.uint8)
    a = _layer(SHAPES[1], ws)
    b = _layer(SHAPES[0], a.workspace)
    assert a._group is b._group
    for layer, shape in ((a, SHAPES[1]), (b, SHAPES[0])):
        p = _problem(shape, seed=3)
        check_against_reference(p, *run_poisoned(layer, p))


def test_an_output_inside_the_shared_workspace_is_refused():
    ws = np.zeros(workspace_bytes(SHAPES, max_batch=3, backend="cpu", splitk="4"), np.uint8)
    layer = _layer(SHAPES[0], ws)
    p = _problem(SHAPES[0], seed=4)
    out = ws[-p.q.nbytes:].view(p.q.dtype).reshape(p.q.shape)
    with pytest.raises(ValueError, match="out overlaps the split-K workspace"):
        layer.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, out=out)


def test_overlapping_workspaces_share_a_lock_and_one_bridging_two_groups_is_refused():
    n = _layer(SHAPES[0]).workspace_nbytes
    buf = np.empty(4 * n, np.uint8)
    a = _layer(SHAPES[0], buf[:n])
    b = _layer(SHAPES[0], buf[2 * n:3 * n])
    assert a._group is not b._group  # disjoint: independent
    c = _layer(SHAPES[0], buf[n // 2:n // 2 + n])  # overlaps a's: a's group
    assert c._group is a._group
    with pytest.raises(ValueError, match="overlaps the workspaces of 2 groups"):
        _layer(SHAPES[0], buf[n:n + 2 * n])


def test_threads_calling_objects_that_share_a_workspace_are_serialized_by_its_lock():
    """Two layers of one shared workspace called from several threads at once: without a
    per-workspace lock one call's merge reads another's partials."""
    ws = np.empty(workspace_bytes(SHAPES[:1], max_batch=3, backend="cpu", splitk="4"), np.uint8)
    layers = [_layer(SHAPES[0], ws) for _ in range(2)]
    problems = [_problem(SHAPES[0], seed=20 + i) for i in range(8)]
    alone = [run_poisoned(_layer(SHAPES[0]), p) for p in problems]
    together: list = [None] * len(problems)
    start = threading.Barrier(len(problems))

    def call(i):
        start.wait()
        together[i] = run_poisoned(layers[i % 2], problems[i])

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for (out, lse), (ref_out, ref_lse) in zip(together, alone):
        assert out.tobytes() == ref_out.tobytes() and lse.tobytes() == ref_lse.tobytes()


def test_decoder_helper_still_builds_a_private_workspace():
    p = _problem(SHAPES[0], seed=5)
    attn = decoder(p, splitk="4")
    assert attn.workspace.nbytes == attn.workspace_nbytes > 0
