"""Where the ``metrale_attn`` logger tree's records go, and at what level: ``METRALE_ATTN_LOG_LEVEL``,
and under vLLM, vLLM's own handlers.

What the package logs (each module under its own ``metrale_attn.<module>`` logger): at INFO,
a cold compile (``compiling N kernel(s) for sm_90 ...`` before it, ``compiled N kernel(s) ...
in S s`` after), a compile still running after ``attention.SLOW_COMPILE_S``, a wait on
another process's build lock, and each layer's plan (once per layer configuration); at
WARNING, a fallback to the ``simt`` kernels, an unusable cache directory, and a kernel cache
built by another NVRTC version; at DEBUG, every kernel loaded or compiled.

A library prints nothing of its own by default: without ``METRALE_ATTN_LOG_LEVEL`` this
module changes nothing, and Python's last-resort handler shows WARNING and above only.
``METRALE_ATTN_LOG_LEVEL`` (DEBUG, INFO, WARNING, ERROR or CRITICAL in any case, or a
non-negative integer), read once when the package is imported, sets the tree's
level and attaches one handler writing ``metrale_attn: LEVEL message`` lines to stderr. That
handler stands down while the root logger has handlers of its own (the application
configured logging, e.g. ``logging.basicConfig``, before or after the import): the records
then reach those, and are never printed twice. A value that is none of those is a
``ValueError`` naming the variable, at import: an operator who sets it wants the lines it
promises, and a typo that silently logs nothing would leave a cold compile looking like a
hang, the very thing it exists to tell apart.

vLLM configures only its own logger tree (``vllm``: its handler at ``VLLM_LOGGING_LEVEL``,
``propagate=False``), so records of ours would otherwise never show in a server's log.
``follow_vllm`` (called when vLLM loads our plugin and when it imports our backend) forwards
the tree's records to the ``vllm`` logger's handlers, at vLLM's level unless
``METRALE_ATTN_LOG_LEVEL`` says otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Mapping, Optional

ENV_LOG_LEVEL = "METRALE_ATTN_LOG_LEVEL"
LOGGER_NAME = "metrale_attn"
FORMAT = "metrale_attn: %(levelname)s %(message)s"
VLLM_LOGGER_NAME = "vllm"
LEVEL_NAMES = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def parse_level(raw: Optional[str], name: str = ENV_LOG_LEVEL) -> Optional[int]:
    """The logging level ``raw`` spells (a level name in any case, or a non-negative integer);
    None when unset or empty. Anything else is a ValueError naming ``name``."""
    if raw is None or not raw.strip():
        return None
    text = raw.strip()
    if text.upper() in LEVEL_NAMES:
        return getattr(logging, text.upper())
    if text.isascii() and text.isdigit():
        return int(text)
    raise ValueError(f"{name} must be one of {', '.join(LEVEL_NAMES)} (any case) or a non-negative integer, "
                     f"got {raw!r}")


class StderrUnlessConfigured(logging.StreamHandler):
    """The handler ``METRALE_ATTN_LOG_LEVEL`` attaches: writes to stderr (the one current at
    each record, as Python's last-resort handler does) unless the root logger has handlers,
    which are the application's and receive the record anyway."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter(FORMAT))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:  # StreamHandler.__init__ assigns one: stderr is read at each record
        pass

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


class ToVllm(logging.Handler):
    """Hands each record to the ``vllm`` logger's handlers as they are when it is emitted
    (vLLM may configure its logging again later: ``dictConfig`` replaces them), each
    applying its own level and vLLM's format."""

    def emit(self, record: logging.LogRecord) -> None:
        for handler in logging.getLogger(VLLM_LOGGER_NAME).handlers:
            if record.levelno >= handler.level:
                handler.handle(record)


def configure(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """Apply ``METRALE_ATTN_LOG_LEVEL`` (from ``environ``, default ``os.environ``) to the
    ``metrale_attn`` logger: its level, and a ``StderrUnlessConfigured`` handler unless one
    is attached already. Returns the level, or None (unset: nothing changed)."""
    level = parse_level((os.environ if environ is None else environ).get(ENV_LOG_LEVEL))
    if level is None:
        return None
    logger = logging.getLogger(LOGGER_NAME)
    logger.setLevel(level)
    if not any(isinstance(h, (StderrUnlessConfigured, ToVllm)) for h in logger.handlers):
        logger.addHandler(StderrUnlessConfigured())
    return level


def follow_vllm(environ: Optional[Mapping[str, str]] = None) -> bool:
    """Send the ``metrale_attn`` tree's records through vLLM's handlers, when vLLM has
    configured its ``vllm`` logger (``VLLM_CONFIGURE_LOGGING``, the default): one ``ToVllm``
    handler in place of ``StderrUnlessConfigured``, no propagation to the root (vLLM's
    handlers print it: the root's would print it twice), and the level of the ``vllm``
    logger unless ``METRALE_ATTN_LOG_LEVEL`` is set. Idempotent; called again it follows a
    level vLLM changed since. Returns whether it wired anything: with vLLM's logging
    configuration off, our records propagate to the root like any library's."""
    vllm = logging.getLogger(VLLM_LOGGER_NAME)
    if not vllm.handlers:
        return False
    logger = logging.getLogger(LOGGER_NAME)
    for handler in [h for h in logger.handlers if isinstance(h, StderrUnlessConfigured)]:
        logger.removeHandler(handler)
    if not any(isinstance(h, ToVllm) for h in logger.handlers):
        logger.addHandler(ToVllm())
    logger.propagate = False
    level = parse_level((os.environ if environ is None else environ).get(ENV_LOG_LEVEL))
    logger.setLevel(vllm.getEffectiveLevel() if level is None else level)
    return True
