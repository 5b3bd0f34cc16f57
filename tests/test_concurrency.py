"""One DecodeAttention shared by threads (CPU backend) and by streams (the GPU's rule, with fake streams)."""

from __future__ import annotations

import threading
import warnings

import pytest

from metrale_attn.attention import StreamReuseWarning
from metrale_attn.backends.cpu_backend import CpuBackend

from support.problems import check_against_reference, decoder, problem


def test_threads_sharing_one_object_get_the_bytes_each_call_gets_alone():
    """The split kernel and the merge of one call share the object's workspace: two threads
    once interleaved them and read each other's partials (6 of 12 outputs wrong)."""
    problems = [problem(seed=s, seq_lens=(300, 700), head_dim=64, page_size=16) for s in range(12)]
    attn = decoder(problems[0], splitk="4")
    assert attn.plan(2).arm == "splitk"
    alone = [attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, return_lse=True) for p in problems]
    together: list = [None] * len(problems)
    start = threading.Barrier(len(problems))

    def call(i):
        p = problems[i]
        start.wait()
        together[i] = attn.run(p.q, p.k_cache, p.v_cache, p.block_tables, p.seq_lens, return_lse=True)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for p, (out, lse), (ref_out, ref_lse) in zip(problems, together, alone):
        assert out.tobytes() == ref_out.tobytes() and lse.tobytes() == ref_lse.tobytes()
        check_against_reference(p, out, lse)


class _Stream:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"<stream {self.name}>"


class FakeStreams(CpuBackend):
    """The CPU backend with the GPU's stream hooks: ``use`` picks the launch stream, ``busy``
    says which streams still have work queued; ``asked`` records every busy query."""

    def __init__(self):
        super().__init__()
        self.stream, self.busy, self.asked = _Stream("A"), set(), []

    def use(self, name):
        self.stream = _Stream(name) if name != self.stream.name else self.stream

    def current_stream(self):
        return self.stream

    def stream_busy(self, previous, current):
        self.asked.append((previous.name, current.name))
        return previous.name in self.busy


P = problem(seq_lens=(30, 300), head_dim=64, page_size=16)


def _run(attn):
    return attn.run(P.q, P.k_cache, P.v_cache, P.block_tables, P.seq_lens)


def test_a_second_stream_launching_while_the_first_is_busy_warns():
    be = FakeStreams()
    attn = decoder(P, backend=be, splitk="3")
    _run(attn)
    be.busy = {"A"}
    be.use("B")
    with pytest.warns(StreamReuseWarning, match=r"stream <stream B> while stream <stream A>.*one stream at a time"):
        _run(attn)
    assert be.asked == [("A", "B")]


def test_a_second_stream_after_the_first_has_finished_does_not_warn():
    be = FakeStreams()
    attn = decoder(P, backend=be, splitk="3")
    _run(attn)
    be.use("B")
    with warnings.catch_warnings():
        warnings.simplefilter("error", StreamReuseWarning)
        _run(attn)
    assert be.asked == [("A", "B")]


def test_launching_on_the_same_stream_again_never_asks_whether_a_stream_is_busy():
    """The hot path, and every launch of a graph captured on one stream: no driver query."""
    be = FakeStreams()
    attn = decoder(P, backend=be, splitk="3")
    be.busy = {"A"}
    for _ in range(3):
        _run(attn)
    assert be.asked == []


class _CupyStream:
    """What CupyBackend.stream_busy reads of a CuPy stream; counts the driver queries."""

    def __init__(self, ptr, capturing=False, done=True):
        self.ptr, self.capturing, self._done, self.queries = ptr, capturing, done, 0

    def is_capturing(self):
        return self.capturing

    @property
    def done(self):
        self.queries += 1
        return self._done


@pytest.mark.parametrize(
    "previous, current, busy",
    [
        (dict(done=False), dict(), True),
        (dict(done=True), dict(), False),
        (dict(done=False), dict(capturing=True), False),  # capturing: nothing runs now
        (dict(done=False, capturing=True), dict(), False),  # querying it would end its capture
    ],
    ids=["busy", "finished", "current-capturing", "previous-capturing"],
)
def test_the_cupy_backend_asks_the_driver_only_when_neither_stream_is_capturing(previous, current, busy):
    pytest.importorskip("cupy")
    from metrale_attn.backends.cupy_backend import CupyBackend

    a, b = _CupyStream(1, **previous), _CupyStream(2, **current)
    assert CupyBackend().stream_busy(a, b) is busy
    assert a.queries == (0 if a.capturing or b.capturing else 1)
    assert CupyBackend().stream_busy(a, _CupyStream(1)) is False  # the same handle: the same stream
