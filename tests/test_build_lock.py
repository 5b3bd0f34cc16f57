"""The inter-process build lock of a cache entry (``metrale_attn.cache.build_lock``): ranks that
miss the same kernel at once compile it once, a killed holder never blocks the next process, a
long wait is logged, and a lock that cannot be had never stops a build."""

from __future__ import annotations

import fcntl
import logging
import os
import pathlib
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from metrale_attn import cache
from metrale_attn.backends import cubin
from metrale_attn.kernels import KernelSpec

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIMT = KernelSpec("splitk", 64, "bf16", "bf16", "simt")  # the cheapest kernel to compile (~0.4 s)


def python(code: str, *args) -> subprocess.Popen:
    """``code`` in a fresh interpreter (the repository's own package), stdout and stderr piped."""
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *map(str, args)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(path: pathlib.Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


RANK = """
    import logging, pathlib, sys, time
    logging.basicConfig(level=logging.DEBUG, stream=sys.stderr, format="%(name)s %(levelname)s %(message)s")
    from metrale_attn import precompile
    from metrale_attn.backends import cupy_backend
    from metrale_attn.targets import TARGETS

    root, go = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
    layer, options = precompile.Layer("layer", 4, 4, 64), precompile.Options(impl="simt")
    precompile.check_nvrtc(["sm_90"])  # load NVRTC before the start, so the ranks meet at the lock
    compile_cubin = cupy_backend.compile_cubin

    def slow(spec, arch):
        time.sleep(1.0)  # hold the lock long enough that every other rank meets it
        return compile_cubin(spec, arch)

    cupy_backend.compile_cubin = slow
    pathlib.Path(sys.argv[3]).write_text("ready")
    while not go.exists():
        time.sleep(0.005)
    for built in precompile.precompile([layer], [TARGETS["hopper"]], options, cache_dir=root):
        print(built.name, built.hit, built.path)
"""


@pytest.mark.slow  # ~5 s on two cores: .ci/run's slow step runs it
def test_four_ranks_precompiling_at_once_compile_each_variant_once(tmp_path):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy) is not installed")
    go = tmp_path / "go"
    ranks = [python(RANK, tmp_path / "cache", go, tmp_path / f"ready{i}") for i in range(4)]
    for i in range(4):
        wait_for(tmp_path / f"ready{i}")
    go.write_text("")
    results = [rank.communicate(timeout=180) for rank in ranks]
    assert all(rank.returncode == 0 for rank in ranks), [err for _, err in results]
    printed = [out.split() for out, _ in results]
    logs = "".join(err for _, err in results)
    assert [line[0] for line in printed] == [SIMT.name] * 4
    assert sorted(line[1] for line in printed) == ["False", "True", "True", "True"]  # one miss, three hits
    assert logs.count(f"compiled {SIMT.name} for sm_90 with NVRTC") == 1
    assert logs.count(f"loaded {SIMT.name} for sm_90 from the cache (hit") == 3
    assert "waiting for another process or thread building" in logs  # they met at the lock
    (path,) = {line[2] for line in printed}
    assert cubin.read_cached(pathlib.Path(path)) is not None  # whole: size, SHA-256 and ELF tables check out


HOLDER = """
    import pathlib, sys, time
    from metrale_attn.backends import cubin

    def build():  # a compile killed halfway: it holds the lock and never returns
        pathlib.Path(sys.argv[2]).write_text("holding")
        time.sleep(300)

    cubin.cached_cubin(pathlib.Path(sys.argv[1]), build)
"""


def test_a_lock_held_by_a_process_that_is_then_killed_does_not_block_the_next_one(tmp_path):
    entry = tmp_path / "cubin" / f"{SIMT.name}_sm_90_test.cubin"
    holder = python(HOLDER, entry, tmp_path / "holding")
    try:
        wait_for(tmp_path / "holding")
        with open(cache.lock_path(entry), "rb") as other, pytest.raises(BlockingIOError):
            fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)  # it really is held
    finally:
        holder.kill()
        holder.communicate(timeout=60)
    assert holder.returncode == -9 and not entry.exists()
    start = time.monotonic()
    with cache.build_lock(entry) as held:
        took = time.monotonic() - start
    assert held and took < cache.LOCK_POLL_S * 2  # no wait at all: the kernel released it with the process
    data = bytes(_whole_cubin())
    assert cubin.cached_cubin(entry, lambda: data) == entry and cubin.read_cached(entry) == data


def _whole_cubin() -> bytes:
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy) is not installed")
    from support.builds import nvrtc_build

    return nvrtc_build(SIMT, "sm_90")[0]


def hold(entry: pathlib.Path, holding: threading.Event, release: threading.Event) -> threading.Thread:
    """A thread holding ``entry``'s lock from ``holding`` until ``release`` (threads exclude
    each other like processes: each opens its own file description)."""

    def run():
        with cache.build_lock(entry) as held:
            assert held
            holding.set()
            release.wait(30)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert holding.wait(30)
    return thread


def test_a_wait_longer_than_a_moment_is_logged_at_info_and_a_short_one_is_not(tmp_path, monkeypatch, caplog):
    entry = tmp_path / "x.cubin"
    with caplog.at_level(logging.DEBUG, logger="metrale_attn"), cache.build_lock(entry, "x for sm_90") as held:
        assert held
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]
    monkeypatch.setattr(cache, "LOCK_WAIT_INFO_S", 0.05)
    holding, release = threading.Event(), threading.Event()
    thread = hold(entry, holding, release)
    threading.Timer(0.4, release.set).start()
    with caplog.at_level(logging.DEBUG, logger="metrale_attn"), cache.build_lock(entry, "x for sm_90") as held:
        assert held
    thread.join(30)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and r.name == "metrale_attn.cache"]
    assert len(infos) == 2, infos
    assert infos[0].startswith(f"waiting for another process building x for sm_90 (lock {entry}.lock, ")
    assert infos[1].startswith("waited ") and infos[1].endswith(" s for another process building x for sm_90")


def test_a_waiter_past_the_timeout_builds_without_the_lock_and_says_so(tmp_path, monkeypatch, caplog):
    entry = tmp_path / "x.cubin"
    monkeypatch.setattr(cache, "LOCK_TIMEOUT_S", 0.2)
    holding, release = threading.Event(), threading.Event()
    thread = hold(entry, holding, release)
    try:
        with caplog.at_level(logging.WARNING, logger="metrale_attn"), cache.build_lock(entry) as held:
            assert not held
    finally:
        release.set()
        thread.join(30)
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "metrale_attn.cache"]
    assert warning.startswith("gave up waiting for the build lock of x.cubin after ")
    assert "a duplicate build at worst" in warning


def test_where_no_lock_file_can_be_made_the_block_runs_without_one(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    entry = blocker / "cubin" / "x.cubin"  # its directory cannot be made, even by root
    with cache.build_lock(entry) as held:
        assert not held
    assert not os.path.exists(cache.lock_path(entry))
