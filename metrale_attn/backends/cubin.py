"""Cubins whole: checked as ELF files, cached on disk.

What it owns: the ELF64 checks (``check_cubin``: a cubin's tables, sections and segments all
lie inside it) and the on-disk cache of cubins with their sidecars. Ours, since no library
checks a cubin's ELF extent or keeps such a cache. The bytes come from NVRTC whole through
cuda-bindings (``backends.nvrtc``); the check catches a short one, such as CuPy's
``getCUBIN`` returns (one byte short of its own header's claims, which ``nvdisasm`` refuses:
"invalid ELF file").

A cached cubin is written with a sidecar ``<file>.json`` holding its size and
SHA-256 (and what built it: the architecture and the NVRTC version); ``read_cached``
accepts a file only when size and hash match and its ELF tables lie inside it, so a
truncated, empty or overwritten entry is rebuilt instead of loaded. A missing entry is
built under its inter-process lock (``cache.build_lock``): ranks starting at once compile
it once. ``warn_other_nvrtc`` reads the sidecars to say, once, that a cache was filled by
another NVRTC version (every entry's key includes it, so all of them miss).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import struct
import tempfile
import warnings
from pathlib import Path

from ..cache import build_lock

logger = logging.getLogger(__name__)

ELF_MAGIC = b"\x7fELF"
_ELF64_HEADER = struct.Struct("<16sHHIQQQIHHHHHH")  # e_ident .. e_shstrndx
_ELF64_SECTION = struct.Struct("<IIQQQQIIQQ")  # sh_name .. sh_entsize
_ELF64_SEGMENT = struct.Struct("<IIQQQQQQ")  # p_type .. p_align
_SHT_NOBITS = 8


class CubinError(ValueError):
    """Bytes that are not a complete cubin (ELF64) file."""


def elf_extent(data: bytes) -> int:
    """The number of bytes the ELF64 file ``data`` claims: the end of the furthest of
    its program-header table, section-header table, sections and segments.
    Raises ``CubinError`` when ``data`` has no ELF64 little-endian header."""
    if len(data) < _ELF64_HEADER.size or data[:4] != ELF_MAGIC or data[4] != 2 or data[5] != 1:
        raise CubinError(f"not an ELF64 little-endian file ({len(data)} bytes, starts {data[:6]!r})")
    (_, _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _) = _ELF64_HEADER.unpack_from(data)
    end = max(_ELF64_HEADER.size, phoff + phnum * phentsize, shoff + shnum * shentsize)
    for i in range(shnum):
        at = shoff + i * shentsize
        if at + _ELF64_SECTION.size <= len(data):
            _, sh_type, _, _, offset, size, *_ = _ELF64_SECTION.unpack_from(data, at)
            if sh_type != _SHT_NOBITS:
                end = max(end, offset + size)
    for i in range(phnum):
        at = phoff + i * phentsize
        if at + _ELF64_SEGMENT.size <= len(data):
            _, _, offset, _, _, filesz, _, _ = _ELF64_SEGMENT.unpack_from(data, at)
            end = max(end, offset + filesz)
    return end


def check_cubin(data: bytes) -> None:
    """Raise ``CubinError`` unless ``data`` is an ELF64 file whose tables, sections
    and segments all lie inside it."""
    end = elf_extent(data)
    if end > len(data):
        raise CubinError(f"ELF file is {len(data)} bytes but its headers describe {end} bytes")


def kernel_register_counts(data: bytes) -> dict[str, int]:
    """Registers per kernel as the cubin records them (``EIATTR_REGCOUNT`` entries of
    ``.nv.info``), keyed by kernel name: a check on ptxas's ``-v`` report."""
    check_cubin(data)
    header = _ELF64_HEADER.unpack_from(data)
    shoff, shentsize, shnum, shstrndx = header[6], header[11], header[12], header[13]
    sections = [_ELF64_SECTION.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]

    def c_string(offset: int) -> str:
        return data[offset:data.index(b"\0", offset)].decode()

    names = sections[shstrndx][4]
    symtab = next(s for s in sections if s[1] == 2)  # SHT_SYMTAB
    strtab = sections[symtab[6]][4]  # sh_link: its string table
    symbols = [struct.unpack_from("<IBBHQQ", data, symtab[4] + i * 24) for i in range(symtab[5] // 24)]
    counts = {}
    for section in sections:
        if c_string(names + section[0]) != ".nv.info":
            continue
        body, at = data[section[4]:section[4] + section[5]], 0
        while at + 4 <= len(body):
            fmt, attr, size = body[at], body[at + 1], struct.unpack_from("<H", body, at + 2)[0]
            if fmt != 0x04:  # EIFMT_SVAL carries a size; the other formats are 4 bytes in all
                at += 4
                continue
            if attr == 0x2F and size == 8:  # EIATTR_REGCOUNT: (symbol index, registers)
                symbol, registers = struct.unpack_from("<II", body, at + 4)
                counts[c_string(strtab + symbols[symbol][0])] = registers
            at += 4 + size
    return counts


# --------------------------------------------------------------------------------------
# The on-disk cache
# --------------------------------------------------------------------------------------


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + ".json")


def read_cached(path: Path) -> bytes | None:
    """The cached cubin at ``path`` if it is whole: its size and SHA-256 match the
    sidecar written with it, and its ELF tables lie inside it; else None."""
    try:
        meta = json.loads(_sidecar(path).read_text(encoding="utf-8"))
        data = path.read_bytes()
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("size") != len(data):
        return None
    if meta.get("sha256") != hashlib.sha256(data).hexdigest():
        return None
    try:
        check_cubin(data)
    except CubinError:
        return None
    return data


def _write_atomically(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_cached(path: Path, data: bytes, built_by: dict | None = None) -> None:
    """Write ``data`` to ``path``, then its sidecar (size, SHA-256, and ``built_by``'s
    fields: ``arch``, ``nvrtc``), each atomically: a reader sees either a matching pair or
    a mismatch it rebuilds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomically(path, data)
    meta = {**(built_by or {}), "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    _write_atomically(_sidecar(path), (json.dumps(meta) + "\n").encode())


_fallback_dir: Path | None = None


def fallback_dir(unwritable: Path, err: OSError) -> Path:
    """This process's private temporary cubin directory, made (and warned about) once."""
    global _fallback_dir
    if _fallback_dir is None:
        _fallback_dir = Path(tempfile.mkdtemp(prefix="metrale-attn-cubin-"))
        message = (f"metrale-attn: cubin cache {unwritable} is not writable ({err}); caching cubins in "
                   f"{_fallback_dir} for this process only (set METRALE_ATTN_CACHE_DIR to a writable directory)")
        logger.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return _fallback_dir


def is_cached(path: Path) -> bool:
    """Whether ``cached_cubin(path, ...)`` would find a whole cubin rather than build one."""
    return read_cached(path) is not None or (_fallback_dir is not None
                                             and read_cached(_fallback_dir / path.name) is not None)


def cached_cubin(path: Path, build, what: str | None = None, built_by: dict | None = None) -> Path:
    """The path of a whole cached cubin named ``path.name``: ``path`` itself when it
    holds one (validated); else ``build()``'s bytes written there, or, where that
    directory cannot be written, into this process's private temporary directory.

    A miss builds under the entry's inter-process lock (``cache.build_lock``; ``what``
    names it in the log), so processes missing the same entry at once build it once:
    the others wait, then find it here. A hit takes no lock (a read-only cache a
    container ships is read as it is). ``built_by`` goes into the sidecar (``write_cached``)."""
    if read_cached(path) is not None:
        return path
    if _fallback_dir is not None and read_cached(_fallback_dir / path.name) is not None:
        return _fallback_dir / path.name
    with build_lock(path, what):
        if read_cached(path) is not None:  # built by the process this one waited for
            return path
        data = build()
        check_cubin(data)
        try:
            write_cached(path, data, built_by)
            return path
        except OSError as err:
            spare = fallback_dir(path.parent, err) / path.name
            write_cached(spare, data, built_by)
            return spare


def nvrtc_label(version) -> str:
    """``(12, 9)`` -> ``"12.9"``: how the sidecars and the messages spell an NVRTC version."""
    return ".".join(str(part) for part in version)


_nvrtc_checked: set[tuple[Path, str]] = set()


def warn_other_nvrtc(directory: Path, arch: str, version) -> set[str]:
    """Once per process per ``(directory, arch)``: when the cubins of ``arch`` cached in
    ``directory`` were all built by other NVRTC versions than ``version`` (this process's),
    warn (a RuntimeWarning and a WARNING record) naming them and this one, since every kernel
    will then be compiled again. Returns those other versions (empty: nothing to say). Only
    sidecars that record their NVRTC (``write_cached``'s ``built_by``) are read; reading stops
    at the first entry this version built."""
    directory = Path(directory)
    if (directory, arch) in _nvrtc_checked:
        return set()
    _nvrtc_checked.add((directory, arch))
    mine, others = nvrtc_label(version), set()
    try:
        sidecars = sorted(directory.glob(f"*_{arch}_*.cubin.json"))
    except OSError:
        return set()
    for sidecar in sidecars:
        try:
            built = json.loads(sidecar.read_text(encoding="utf-8")).get("nvrtc")
        except (OSError, ValueError, AttributeError):
            continue
        if built == mine:
            return set()
        if isinstance(built, str):
            others.add(built)
    if others:
        message = (f"metrale-attn: the kernel cache {directory} holds {arch} cubins built by NVRTC "
                   f"{', '.join(sorted(others))} and none by this environment's NVRTC {mine}: the cache key includes "
                   "the NVRTC version, so every kernel will be compiled again here (run metrale-attn precompile in "
                   "this environment, or serve with the NVRTC the cache was built with)")
        logger.warning("%s", message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    return others
