"""Compile before serving: every kernel a model's layers need, for a target, into the cubin cache.

``needed_specs`` (pure) says what a ``DecodeAttention`` of each kind of layer compiles
on a target, by asking the rules it runs: ``config.configure``, ``kernels.launchable_config``
(the simt fallback) and ``kernels.specs_for``. ``precompile`` compiles them with NVRTC
(no GPU needed) through the CuPy backend's own lookup (``cupy_backend.cubin_lookup``: the
same file names, under the same inter-process lock), so a construction on a GPU of that
architecture, pointed at the same cache, finds every one: a cache hit.

A construction on a GPU runs the ``mma`` known-answer self-test first (a kernel of its own,
``kernels.SelfTest``), and falls back to ``simt`` where the device disagrees. No device is
here to run it, so both outcomes are compiled: the self-test kernel, the ``mma`` specs,
and, where a failed self-test would make the layer fall back rather than refuse (no
``mma``-only feature), the ``simt`` specs of that fallback. A target whose shared memory
no ``mma`` spec fits (gb10) falls back the way a construction does, deterministically.
"""

from __future__ import annotations

import importlib
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from .cache import cache_root
from .config import ENV_IMPL, configure, impl_chosen, int_in
from .hf_config import HFModel, shard_heads
from .kernels import SelfTest, launchable_config, specs_for
from .plan import LEGACY_MAX_DECODE_SEQS
from .targets import TARGETS, Target, resolve_target_policy

INSTALL = ("pip install 'metrale-attn[cuda12]' (or [cuda13]): the CuPy and NVRTC the serving machine uses, since "
           "the cache key includes the NVRTC version")
SELF_TEST = "the mma self-test (runs before the first mma layer)"


class PrecompileError(RuntimeError):
    """Precompiling cannot be done here: no NVRTC, one too old for the architecture, or a cache
    directory that cannot take the kernels."""


@dataclass(frozen=True)
class Layer:
    """One kind of attention layer as one ``DecodeAttention`` sees it: one rank's heads, and
    its features (``DecodeAttention``'s keyword arguments). ``name`` labels it in the output."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    window_left: int = -1
    logits_soft_cap: Optional[float] = None
    sinks: bool = False


@dataclass(frozen=True)
class Options:
    """What every layer of the model shares: ``DecodeAttention``'s other keyword arguments
    that decide its specs (``page_size`` decides none, and is only checked)."""

    q_dtype: str = "bfloat16"
    kv_dtype: Optional[str] = None  # None: q_dtype
    max_batch: int = 256
    max_q_len: int = 1
    out_dtype: Optional[str] = None
    page_size: int = 16
    splitk: Optional[str] = None
    gqa_pack: Optional[bool] = None
    impl: Optional[str] = None
    heads_per_cta: Optional[int] = None
    max_decode_seqs: int = LEGACY_MAX_DECODE_SEQS


@dataclass(frozen=True)
class Needed:
    """A kernel to compile, and why: the layer kinds that need it, or the self-test."""

    spec: object  # kernels.KernelSpec or kernels.SelfTest
    why: str

    @property
    def name(self) -> str:
        return self.spec.name


@dataclass(frozen=True)
class TargetPlan:
    """What one target needs: its resolved defaults' line, the kernels, and what a construction
    there would say (a deterministic fallback)."""

    target: Target
    defaults_line: str
    needed: tuple[Needed, ...]
    notes: tuple[str, ...]


@dataclass(frozen=True)
class Built:
    """One kernel in the cache: where, whether it was there already, the seconds it took."""

    arch: str
    name: str
    why: str
    hit: bool
    seconds: float
    path: Path

    def line(self) -> str:
        return f"  {'hit' if self.hit else 'miss':<4}  {self.seconds:6.2f} s  {self.name}  [{self.why}]"


def layers_of(model: HFModel, tensor_parallel: int = 1) -> list[Layer]:
    """One ``Layer`` per layer kind of a Hugging Face model (``hf_config.load``), with one
    rank's heads at ``tensor_parallel`` ranks (``hf_config.shard_heads``: an int >= 1, else a
    ValueError naming it)."""
    q_heads, kv_heads = shard_heads(model.num_q_heads, model.num_kv_heads, tensor_parallel)
    return [Layer(kind.name, q_heads, kv_heads, model.head_dim, kind.window_left, kind.logits_soft_cap, kind.sinks)
            for kind in model.kinds]


def target_for_arch(arch: str) -> Target:
    """The target compiled for ``arch`` (``sm_90``): the one whose compute capability it names."""
    spelled = str(arch).strip().lower()
    for target in TARGETS.values():
        if target.arch == spelled:
            return target
    known = ", ".join(f"{t.arch} ({t.name})" for t in TARGETS.values())
    raise ValueError(f"--arch must name a target's architecture: one of {known}; got {arch!r}")


def needed_specs(layers: Sequence[Layer], target: Target, options: Options = Options(), *,
                    sm_count: Optional[int] = None, environ=None) -> TargetPlan:
    """Every kernel a ``DecodeAttention`` of each of ``layers`` compiles on ``target`` (with
    ``sm_count`` SMs, default the table's; a GPU's own count is what a construction uses),
    resolved against ``environ`` (default ``os.environ``) as a construction resolves its
    options: both outcomes of the self-test (see the module's docstring). A value the
    kernels refuse is a ValueError naming the argument and the layer; ``sm_count`` is an
    int >= 1 (the split-K policy divides work by it)."""
    env = os.environ if environ is None else environ
    if sm_count is not None:
        target = replace(target, sm_count=int_in("sm_count", sm_count, 1))
    target_policy = resolve_target_policy(target, splitk=options.splitk, gqa_pack=options.gqa_pack, environ=environ)
    chosen = impl_chosen(options.impl, env.get(ENV_IMPL))
    found: dict[str, tuple[object, list[str]]] = {}
    notes: list[str] = []

    def need(spec, why: str) -> None:
        whys = found.setdefault(spec.name, (spec, []))[1]
        if why not in whys:
            whys.append(why)

    for layer in layers:
        try:
            config = configure(layer.num_q_heads, layer.num_kv_heads, layer.head_dim, options.page_size,
                               q_dtype=options.q_dtype, kv_dtype=options.kv_dtype or options.q_dtype,
                               max_batch=options.max_batch, target_policy=target_policy, out_dtype=options.out_dtype,
                               max_decode_seqs=options.max_decode_seqs, impl=options.impl,
                               heads_per_cta=options.heads_per_cta, max_q_len=options.max_q_len,
                               window_left=layer.window_left, logits_soft_cap=layer.logits_soft_cap,
                               sinks=layer.sinks, environ=env)
            if config.impl == "mma":
                need(SelfTest(), SELF_TEST)
            launchable, why = launchable_config(config, [], chosen)  # the self-test agrees
            if why:
                notes.append(f"{layer.name}: {why}; using impl='simt' instead, as a construction there does")
            for spec in specs_for(launchable).values():
                need(spec, layer.name)
            if launchable.impl == "mma" and not launchable.mma_only:  # it would fall back, not refuse
                fallback, _ = launchable_config(config, ["(a failed self-test)"], chosen)
                for spec in specs_for(fallback).values():
                    need(spec, f"simt fallback of {layer.name}, if the device fails the self-test")
        except (ValueError, TypeError) as err:
            raise type(err)(f"{layer.name} ({layer.num_q_heads} q heads, {layer.num_kv_heads} KV heads, head_dim "
                            f"{layer.head_dim}) on {target.name}: {err}") from None
    needed = tuple(Needed(spec, ", ".join(whys)) for spec, whys in found.values())
    return TargetPlan(target, target_policy.line(), needed, tuple(notes))


def check_nvrtc(arches: Iterable[str]) -> str:
    """NVRTC's version, where it is installed and compiles for every one of ``arches``; else a
    ``PrecompileError`` naming what to install."""
    try:
        nvrtc = importlib.import_module("cupy_backends.cuda.libs.nvrtc")
    except ImportError as err:
        raise PrecompileError(f"precompile compiles with NVRTC through CuPy, which is not installed ({err}): "
                              f"{INSTALL}") from None
    try:
        version = nvrtc.getVersion()
        supported = set(nvrtc.getSupportedArchs())
    except Exception as err:  # CuPy present, its NVRTC library not loadable
        raise PrecompileError(f"NVRTC cannot be loaded ({type(err).__name__}: {err}): {INSTALL}") from None
    missing = [arch for arch in arches if int(arch[3:]) not in supported]
    if missing:
        raise PrecompileError(f"NVRTC {version[0]}.{version[1]} cannot compile for {', '.join(missing)}: "
                              "pip install 'nvidia-cuda-nvrtc-cu12>=12.9' (or 'nvidia-cuda-nvrtc>=13' with "
                              "cupy-cuda13x), the same on the serving machine")
    return f"{version[0]}.{version[1]}"


def build(plan: TargetPlan, cache_dir: Optional[Path] = None,
          on_built: Optional[Callable[[Built], None]] = None) -> list[Built]:
    """Compile (or find) every kernel of ``plan`` into ``cache_dir`` (the directory
    ``METRALE_ATTN_CACHE_DIR`` names; default the package's cache), one after another,
    calling ``on_built`` with each as it is done. A directory that holds every kernel may
    be read-only; one that cannot take a missing kernel is a ``PrecompileError``."""
    from .backends.cupy_backend import cubin_lookup  # needs CuPy: check_nvrtc first

    root = Path(cache_dir) if cache_dir is not None else cache_root()
    arch = plan.target.arch
    done = []
    for needed in plan.needed:
        start = time.perf_counter()
        found = cubin_lookup(needed.spec, arch, root)
        if found.path.parent != root / "cubin":  # the lookup fell back to a private directory: gone at exit
            raise PrecompileError(f"{unwritable_cache(root / 'cubin', found.path.name)} (the kernel went to "
                                  f"{found.path.parent} for this process only)")
        built = Built(arch, needed.name, needed.why, found.compile_s is None, time.perf_counter() - start, found.path)
        done.append(built)
        if on_built is not None:
            on_built(built)
    return done


def unwritable_cache(cubin_dir: Path, name: str) -> str:
    """What keeps the kernel file ``name`` out of ``cubin_dir``, as the file system shows it
    after the write failed: a directory where the entry (or its ``.json`` sidecar) goes, a file
    where a directory goes, or a directory without write permission."""
    for path in (cubin_dir / name, cubin_dir / f"{name}.json"):
        if path.is_dir():
            return f"cannot write the kernel into the cache: {path} is a directory where the cache keeps a file; " \
                   "remove it"
    existing = next((p for p in (cubin_dir, *cubin_dir.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        return (f"cannot make the cache directory {cubin_dir}: {existing} is a file, not a directory; give --cache-dir "
                "a directory")
    if existing is not None and not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot write the cache directory {cubin_dir}: {existing} is not writable; give a writable --cache-dir"
    return f"cannot write the kernel into the cache directory {cubin_dir} (the warning above has the error)"


def precompile(layers: Sequence[Layer], targets: Sequence[Target], options: Options = Options(), *,
               cache_dir: Optional[Path] = None, sm_count: Optional[int] = None,
               on_built: Optional[Callable[[Built], None]] = None) -> list[Built]:
    """Compile every kernel ``layers`` need on each of ``targets`` into ``cache_dir`` (default:
    the package's cache, where ``DecodeAttention`` looks), without a GPU. Returns what was
    built or found, in order; a second call finds them all (every one a hit). The steps are
    ``needed_specs`` for every target (so any refusal comes first), ``check_nvrtc``, then
    ``build`` each; ``metrale-attn precompile`` runs the same steps, printing between them."""
    plans = [needed_specs(layers, t, options, sm_count=sm_count) for t in targets]  # every refusal first
    check_nvrtc(t.arch for t in targets)
    return [built for plan in plans for built in build(plan, cache_dir, on_built)]

