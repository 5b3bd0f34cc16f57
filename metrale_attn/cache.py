"""Where compiled kernels are cached, and how one entry is built once across processes.

The directory: ``$METRALE_ATTN_CACHE_DIR``, else ``$XDG_CACHE_HOME/metrale-attn``, else
``~/.cache/metrale-attn``, one per user and shared by both backends. Entries are named by a
hash of everything that went into them, so a stale entry is never reused and concurrent
writers only race to write the same bytes (each writes a temporary file and renames it
into place).

``build_lock`` is the inter-process lock of one entry: N processes (the ranks of one
server) that miss the same entry at once build it once. The first takes an exclusive
``flock`` on ``<entry>.lock`` beside the entry, builds and writes; the others wait on the
lock, then find the entry whole and load it. ``flock`` belongs to the open file, which the
kernel closes when its process exits however it exits, so a lock left by a killed process
never blocks anyone; a waiter that has waited ``LOCK_TIMEOUT_S`` (a builder hung, or a
child forked without exec still holding the file) builds without the lock, which costs
a duplicate build and never a wrong one. Lock files are empty and stay in place (deleting
one while a process waits on it would let a third process lock a new file and build
beside the holder); removing them while nothing builds is harmless.

Why ours and not ``filelock`` (issue 33 weighed it; it is installed beside torch): this is one
``flock`` loop, and ``filelock.FileLock`` would not make it shorter or the same. What we log
while waiting (DEBUG at the first miss, INFO past ``LOCK_WAIT_INFO_S`` naming the kernel, the
WARNING when we give up) would take three ``acquire`` calls with shrinking timeouts around it.
Where ``flock`` is missing (some network file systems), filelock 4 falls back by default to
a marker file recording its holder, broken only once that holder is seen dead (on the same
host), a second protocol with states of its own, where we build without a lock; turning that
off (``fallback_to_soft=False``) needs filelock 4, whose behaviour differs from the 3.x a
serving environment may pin (torch requires filelock with no version).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import time
from pathlib import Path
from typing import Iterator, Optional

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no inter-process lock, builds may repeat
    fcntl = None

logger = logging.getLogger(__name__)

LOCK_SUFFIX = ".lock"
LOCK_POLL_S = 0.05
"""How often a waiter tries the lock again (seconds): a build takes a second or more."""
LOCK_WAIT_INFO_S = 1.0
"""A waiter still waiting after this many seconds says so at INFO (once), and how long it
waited when it gets the lock."""
LOCK_TIMEOUT_S = 600.0
"""A waiter builds without the lock after this many seconds: far past any one NVRTC or
host-compiler build (seconds), so only a hung or orphaned holder reaches it."""


CACHE_DIR = "METRALE_ATTN_CACHE_DIR"


def cache_root() -> Path:
    """The cache directory (not created here)."""
    root = os.environ.get(CACHE_DIR)
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "metrale-attn") if xdg else os.path.join(Path.home(), ".cache", "metrale-attn")
    return Path(root)


def lock_path(entry: Path) -> Path:
    """The lock file of a cache entry: ``<entry>.lock`` beside it."""
    return entry.with_name(entry.name + LOCK_SUFFIX)


@contextlib.contextmanager
def build_lock(entry: Path, what: Optional[str] = None) -> Iterator[bool]:
    """Hold the inter-process build lock of cache entry ``entry`` (a path) for the ``with``
    block; yields True when held, False when the block runs without it.

    Without it means: the lock file cannot be made (a read-only or full directory, where
    the entry cannot be written either: the caller's fallback takes over), the file
    system has no ``flock``, or ``LOCK_TIMEOUT_S`` passed. The caller looks for the
    entry again inside the block, since the holder it waited for has usually built it.
    ``what`` names the entry in log lines (default: its file name). Threads of one process
    exclude each other too (each opens its own file description)."""
    what = what or entry.name
    fd = _open_lock(lock_path(entry), what)
    if fd is None:
        yield False
        return
    try:
        yield _acquire(fd, lock_path(entry), what)
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)  # explicitly: a forked child may share the open file
        os.close(fd)


def _open_lock(path: Path, what: str) -> Optional[int]:
    """The lock file's descriptor (made if need be), or None where it cannot be opened for
    writing (``flock`` on NFS needs a writable descriptor)."""
    if fcntl is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as err:
        logger.debug("no build lock for %s (%s: %s); building without one", what, path, err.strerror or err)
        return None


def _acquire(fd: int, path: Path, what: str) -> bool:
    """Take the exclusive lock on ``fd``, polling every ``LOCK_POLL_S``; False when the file
    system refuses ``flock`` or ``LOCK_TIMEOUT_S`` passes (the constants are read now, so a
    test may lower them)."""
    start = time.monotonic()
    attempts = 0
    said = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except OSError as err:
            if err.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                logger.debug("no build lock for %s (flock on %s: %s); building without one", what, path,
                             err.strerror or err)
                return False
        attempts += 1
        waited = time.monotonic() - start
        if attempts == 1:
            logger.debug("waiting for another process or thread building %s (lock %s)", what, path)
        if not said and waited >= LOCK_WAIT_INFO_S:
            said = True
            logger.info("waiting for another process building %s (lock %s, %.1f s so far)", what, path, waited)
        if waited >= LOCK_TIMEOUT_S:
            logger.warning("gave up waiting for the build lock of %s after %.0f s (%s); building it without the "
                           "lock (a duplicate build at worst: entries are replaced atomically)", what, waited, path)
            return False
        time.sleep(LOCK_POLL_S)
    waited = time.monotonic() - start
    if waited >= LOCK_WAIT_INFO_S:
        logger.info("waited %.1f s for another process building %s", waited, what)
    return True
