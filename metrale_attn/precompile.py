"""Compile before serving: every kernel a model's layers need, for a target, into the cubin cache;
and the model every command describes (``describe_model``: ``--model``, ``--hf-config``, a shape).

``needed_specs`` (pure) says what a ``DecodeAttention`` of each kind of layer compiles
on a target, by asking the rules it runs: ``config.configure``, ``kernels.launchable_config``
(the simt fallback) and ``kernels.specs_for``; ``plan_targets`` does so for several targets,
each layer kind a target refuses a ``Refusal``. ``build_all`` compiles them with NVRTC
(no GPU needed), in parallel processes, through the CuPy backend's own lookup
(``cupy_backend.cubin_lookup``: the same file names, under the same inter-process lock), so a
construction on a GPU of that architecture, pointed at the same cache, finds every one: a
cache hit. ``precompile`` runs the steps; ``metrale-attn precompile`` and ``metrale-attn
check`` compile through ``build_all``.

A construction on a GPU runs the ``mma`` known-answer self-test first (a kernel of its own,
``kernels.SelfTest``), and falls back to ``simt`` where the device disagrees. No device is
here to run it, so both outcomes are compiled: the self-test kernel, the ``mma`` specs,
and, where a failed self-test would make the layer fall back rather than refuse (no
``mma``-only feature), the ``simt`` specs of that fallback. A target whose shared memory
no ``mma`` spec fits, or a head dim wider than the ``mma`` core's (512: Gemma 4's global
layers), falls back the way a construction does, deterministically (a layer of that head dim
needs no self-test: a construction does not run it).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

from .cache import cache_root
from .config import ENV_IMPL, HEAD_DIMS, NARROW_V_SHAPES, SIMT_ONLY_HEAD_DIMS, ModelShape, configure, impl_chosen, int_in
from . import hf_config
from .hf_config import HFModel, shard_heads
from .kernels import SelfTest, launchable_config, mma_shape_refusal, specs_for
from .models import model_shape
from .plan import LEGACY_MAX_DECODE_SEQS
from .targets import TARGETS, Target, resolve_target_policy

INSTALL = ("pip install 'metrale-attn[cuda12]' (or [cuda13]): the cuda-bindings, NVRTC and CuPy the serving machine "
           "uses, since the cache key includes the NVRTC version")
SELF_TEST = "the mma self-test (runs before the first mma layer)"


class PrecompileError(RuntimeError):
    """Precompiling cannot be done here: no NVRTC, one too old for the architecture, or a cache
    directory that cannot take the kernels."""


@dataclass(frozen=True)
class Layer:
    """One kind of attention layer as one ``DecodeAttention`` sees it: one rank's heads, and
    its features (``DecodeAttention``'s keyword arguments). ``name`` labels it in the output.
    ``v_head_dim`` (None: ``head_dim``), ``sm_scale`` (None: ``1 / sqrt(head_dim)``), ``k_eq_v``
    and ``v_in_k`` are ``hf_config.LayerKind``'s: what the layer is, whether or not this version
    serves it (``not_served`` says)."""

    name: str
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    window_left: int = -1
    logits_soft_cap: Optional[float] = None
    sinks: bool = False
    v_head_dim: Optional[int] = None
    sm_scale: Optional[float] = None
    k_eq_v: bool = False
    v_in_k: bool = False

    def shape(self) -> str:
        """``32 q heads, 8 KV heads, head_dim 128`` (and ``v_head_dim V`` where values are narrower)."""
        narrow = f", v_head_dim {self.v_head_dim}" if self.v_head_dim not in (None, self.head_dim) else ""
        return f"{self.num_q_heads} q heads, {self.num_kv_heads} KV heads, head_dim {self.head_dim}{narrow}"


def layer_shape(layer: Layer) -> ModelShape:
    """The layer's heads and widths as a ``ModelShape`` (a served shape: ``not_served`` is None)."""
    return ModelShape(layer.num_q_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim)


def v_head_dim_of(layer: Layer) -> int:
    """The layer's value (and output) width: ``v_head_dim``, or ``head_dim`` where None."""
    return layer.head_dim if layer.v_head_dim is None else layer.v_head_dim


def not_served(layer: Layer) -> Optional[str]:
    """Why no target of this version serves ``layer``'s shape, whatever the options (None: a
    target may): values narrower than keys other than MLA's absorbed (576, 512) over one latent
    KV head (``config.NARROW_V_SHAPES``, the simt kernels'), or a head dim past the mma core's
    widest, 256, other than the simt kernels' 512 (Gemma 4's global layers, whose V comes from
    K's projection and is cached apart, as wide as K). Said
    with what the layer is (MLA's absorbed latent head, Gemma 4's V from K's projection), so a
    reader knows which model part waits."""
    v_head_dim = v_head_dim_of(layer)
    if v_head_dim == layer.head_dim and (layer.head_dim <= max(HEAD_DIMS) or layer.head_dim in SIMT_ONLY_HEAD_DIMS):
        return None
    if (layer.head_dim, v_head_dim) in NARROW_V_SHAPES and layer.num_kv_heads == 1:
        return None
    what = f"head_dim {layer.head_dim}" + (f" with v_head_dim {v_head_dim}" if v_head_dim != layer.head_dim else "")
    if layer.v_in_k:
        what += f" (multi-head latent attention, absorbed: V is the first {v_head_dim} dims of each K row)"
    elif layer.k_eq_v:
        what += " (V from K's projection)"
    wide = ", ".join(map(str, SIMT_ONLY_HEAD_DIMS))
    narrow = ", ".join(f"({k}, {v})" for k, v in NARROW_V_SHAPES)
    return (f"{what}: not served yet; this version serves head dims {min(HEAD_DIMS)} to {max(HEAD_DIMS)} and {wide} "
            f"(simt) with values as wide as the keys, and (head_dim, v_head_dim) {narrow} over one KV head (simt)")


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
    """One kernel in the cache: where, whether it was there already, the seconds it took; or
    why it could not be built."""

    arch: str
    name: str
    why: str
    hit: bool
    seconds: float
    path: Optional[Path]
    error: str = ""  # why it could not be built (then ``path`` is None)

    def line(self) -> str:
        state = "FAIL" if self.error else ("hit" if self.hit else "miss")
        return (f"  {state:<4}  {self.seconds:6.2f} s  {self.arch}  {self.name}  [{self.why}]"
                + (f": {self.error}" if self.error else ""))


def layers_of(model: HFModel, tensor_parallel: int = 1) -> list[Layer]:
    """One ``Layer`` per layer kind of a Hugging Face model (``hf_config.load``), with one
    rank's heads at ``tensor_parallel`` ranks (``hf_config.shard_heads``: an int >= 1, else a
    ValueError naming it)."""
    layers = []
    for kind in model.kinds:
        kv_heads, head_dim, v_head_dim = model.shape_of(kind)
        kv_key = "num_key_value_heads" if kind.num_kv_heads is None else "num_global_key_value_heads"
        q, kv = shard_heads(model.num_q_heads, kv_heads, tensor_parallel, kv_key)
        layers.append(Layer(kind.name, q, kv, head_dim, kind.window_left, kind.logits_soft_cap, kind.sinks,
                            v_head_dim if v_head_dim != head_dim else None, kind.sm_scale, kind.k_eq_v, kind.v_in_k))
    return layers


@dataclass(frozen=True)
class Model:
    """A model as every command takes it (``describe_model``): one rank's layer kinds, a label,
    the lines that describe it, its served dtype (None: not said) and the config file it came
    from (None: from the flags)."""

    label: str
    layers: tuple[Layer, ...]
    lines: tuple[str, ...]
    dtype: Optional[str] = None
    config: Optional[str] = None


SHAPE_FLAGS = {"q_heads": "--q-heads", "kv_heads": "--kv-heads", "head_dim": "--head-dim"}
FEATURE_FLAGS = {"window_left": "--window-left", "logits_soft_cap": "--logits-soft-cap", "sinks": "--sinks"}


def describe_model(models: Sequence[str] = (), hf_config_path: Optional[str] = None, tensor_parallel: int = 1,
                   **flags) -> Model:
    """The model of the command line: ``--model NAME[,NAME...]`` (presets of ``models.MODELS`` or
    ``Q/KV/HEAD_DIM``, the whole model's heads), ``--hf-config FILE``, or one rank's layer from
    ``flags`` (``q_heads``, ``kv_heads``, ``head_dim``; and ``window_left``, ``logits_soft_cap``,
    ``sinks``, which also apply to ``--model``'s layers), with the heads of the first two split
    over ``tensor_parallel`` ranks. A combination that does not describe one model is a
    ValueError naming the flags."""
    shape = {name: flags.get(name) for name in SHAPE_FLAGS}
    given = [SHAPE_FLAGS[name] for name, value in shape.items() if value is not None]
    features = [FEATURE_FLAGS[name] for name in FEATURE_FLAGS if flags.get(name) not in (None, False)]
    window = -1 if flags.get("window_left") is None else flags["window_left"]
    cap, sinks = flags.get("logits_soft_cap"), bool(flags.get("sinks"))
    if models and hf_config_path is not None:
        raise ValueError("--model and --hf-config both describe the model: give one of the two")
    if hf_config_path is not None:
        if given or features:
            raise ValueError(f"--hf-config gives the shape and the features; drop {', '.join(given + features)} (or "
                             "give the shape and features without --hf-config)")
        model = hf_config.load(hf_config_path)
        layers = layers_of(model, tensor_parallel)
        lines = [f"model: {model.source} ({model.model_type or 'no model_type'}): {model.num_q_heads} q heads, "
                 f"{model.num_kv_heads} KV heads, head_dim {model.head_dim}; one rank of {tensor_parallel}: "
                 f"{layers[0].num_q_heads} q heads, {layers[0].num_kv_heads} KV heads",
                 "layer kinds: " + ", ".join(kind.describe() for kind in model.kinds)]
        if len({layer.shape() for layer in layers}) > 1:  # kinds of their own shape: each rank's said
            lines += [f"  {layer.name}, one rank: {layer.shape()}" for layer in layers]
        lines += [f"  from the config: {note}" for note in model.notes]
        return Model(f"{model.source} ({model.model_type or 'no model_type'}, TP {tensor_parallel})", tuple(layers),
                     tuple(lines), model.dtype, hf_config_path)
    described = [f"window_left {window}"] if window >= 0 else []
    described += [f"logits_soft_cap {cap:g}"] if cap is not None else []
    described += ["sinks"] if sinks else []
    features_text = f"; {', '.join(described)}" if described else ""
    if models:
        if given:
            raise ValueError(f"--model gives the shape; drop {', '.join(given)} (or give the shape without --model)")
        layers, lines = [], []
        for name in models:
            whole = model_shape(name)
            q, kv = shard_heads(whole.num_q_heads, whole.num_kv_heads, tensor_parallel)
            layers.append(preset_layer(name, whole, q, kv, window, cap, sinks))
            rank = f"; one rank of {tensor_parallel}: {q} q heads, {kv} KV heads" if tensor_parallel != 1 else ""
            lines.append(f"model: {name}: {whole.num_q_heads} q heads, {whole.num_kv_heads} KV heads, head_dim "
                         f"{whole.head_dim}{narrow_text(whole)}{rank}{features_text}")
        label = ", ".join(models) + (f" (TP {tensor_parallel})" if tensor_parallel != 1 else "")
        return Model(label, tuple(layers), tuple(lines))
    if tensor_parallel != 1:
        raise ValueError("--tensor-parallel-size splits the heads of --model or --hf-config; --q-heads and --kv-heads "
                         "are already one rank's")
    missing = [flag for name, flag in SHAPE_FLAGS.items() if shape[name] is None]
    if missing:
        raise ValueError(f"give --model, --hf-config or all of --q-heads, --kv-heads, --head-dim (missing "
                         f"{', '.join(missing)})")
    q, kv, d = shape["q_heads"], shape["kv_heads"], shape["head_dim"]
    return Model(f"{q}/{kv}/{d}", (Layer("layer", q, kv, d, window, cap, sinks),),
                 (f"model: {q} q heads, {kv} KV heads, head_dim {d} (one rank's){features_text}",))


def preset_layer(name: str, whole, q: int, kv: int, window: int = -1, cap: Optional[float] = None,
                 sinks: bool = False) -> Layer:
    """The ``Layer`` of a ``--model`` shape (``models.model_shape``) at one rank's ``q``/``kv`` heads.
    Values narrower than keys are MLA's absorbed decode (the only such shape served), whose V is
    the first ``v_head_dim`` dims of each K row: ``v_in_k``, as ``--hf-config`` maps such a model."""
    narrow = whole.v_head_dim != whole.head_dim
    return Layer(name, q, kv, whole.head_dim, window, cap, sinks, whole.v_head_dim if narrow else None,
                 v_in_k=narrow)


def narrow_text(whole) -> str:
    """``, v_head_dim 512 (V the first 512 dims of each K row)`` for a narrow-value shape, else empty."""
    if whole.v_head_dim == whole.head_dim:
        return ""
    return f", v_head_dim {whole.v_head_dim} (V the first {whole.v_head_dim} dims of each K row)"


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
    kernels refuse is a ValueError naming the argument and the layer (the first layer
    refused; ``plan_targets`` reports every one); ``sm_count`` is an int >= 1 (the split-K
    policy divides work by it)."""
    plan, refused = _plan_target(layers, target, options, sm_count, environ)
    if refused:
        first = refused[0]
        raise first.error_type(first.line())
    return plan


@dataclass(frozen=True)
class Refusal:
    """A layer kind a target cannot take, and why (the kernels' own refusal, naming the argument)."""

    target: Optional[Target]  # None: ``everywhere``
    layer: Layer
    why: str
    error_type: type = ValueError
    everywhere: bool = False  # no target of this version serves the layer (``not_served``)

    def line(self) -> str:
        """``full (32 q heads, 4 KV heads, head_dim 64) on a100: ...``: the error ``needed_specs``
        raises (no target named where none serves it)."""
        where = "" if self.everywhere else f" on {self.target.name}"
        return f"{self.layer.name} ({self.layer.shape()}){where}: {self.why}"


def plan_targets(layers: Sequence[Layer], targets: Sequence[Target], options: Options = Options(), *,
                 sm_count: Optional[int] = None, environ=None) -> tuple[list[TargetPlan], list[Refusal]]:
    """``needed_specs`` of every target that takes every one of ``layers``, and every refusal of
    the others (each target, each layer kind it refuses, why): a target that refuses a layer
    kind cannot serve the model, so nothing is compiled for it. A layer kind no target serves
    (``not_served``: a shape this version has no kernel for) is refused once, ``everywhere``,
    and the targets are planned for the model's other kinds, so they are ready beside it."""
    unserved = [layer for layer in layers if not_served(layer) is not None]
    refusals = [Refusal(None, layer, not_served(layer), everywhere=True) for layer in unserved]
    layers = [layer for layer in layers if layer not in unserved]
    plans = []
    for target in targets if layers else ():
        plan, refused = _plan_target(layers, target, options, sm_count, environ)
        if refused:
            refusals += refused
        else:
            plans.append(plan)
    return plans, refusals


def _plan_target(layers: Sequence[Layer], target: Target, options: Options, sm_count: Optional[int],
                 environ) -> tuple[TargetPlan, list[Refusal]]:
    """``needed_specs``' plan of ``target`` and the layers it refuses (the plan is whole only
    where none is refused)."""
    env = os.environ if environ is None else environ
    if sm_count is not None:
        target = replace(target, sm_count=int_in("sm_count", sm_count, 1))
    target_policy = resolve_target_policy(target, splitk=options.splitk, gqa_pack=options.gqa_pack, environ=environ)
    chosen = impl_chosen(options.impl, env.get(ENV_IMPL))
    found: dict[str, tuple[object, list[str]]] = {}
    notes: list[str] = []
    refused: list[Refusal] = []

    def need(spec, why: str) -> None:
        whys = found.setdefault(spec.name, (spec, []))[1]
        if why not in whys:
            whys.append(why)

    for layer in layers:
        if not_served(layer) is not None:
            refused.append(Refusal(None, layer, not_served(layer), everywhere=True))
            continue
        try:
            config = configure(layer.num_q_heads, layer.num_kv_heads, layer.head_dim, options.page_size,
                               v_head_dim=layer.v_head_dim, q_dtype=options.q_dtype, kv_dtype=options.kv_dtype or options.q_dtype,
                               max_batch=options.max_batch, target_policy=target_policy, out_dtype=options.out_dtype,
                               max_decode_seqs=options.max_decode_seqs, impl=options.impl,
                               heads_per_cta=options.heads_per_cta, max_q_len=options.max_q_len,
                               window_left=layer.window_left, logits_soft_cap=layer.logits_soft_cap,
                               sinks=layer.sinks, sm_scale=layer.sm_scale, environ=env)
            launchable, why = launchable_config(config, [], chosen)  # the self-test agrees
            specs = [(spec, layer.name) for spec in specs_for(launchable).values()]
            if launchable.impl == "mma" and not launchable.mma_only:  # it would fall back, not refuse
                fallback, _ = launchable_config(config, ["(a failed self-test)"], chosen)
                specs += [(spec, f"simt fallback of {layer.name}, if the device fails the self-test")
                          for spec in specs_for(fallback).values()]
        except (ValueError, TypeError) as err:
            refused.append(Refusal(target, layer, str(err), type(err)))
            continue
        if config.impl == "mma" and mma_shape_refusal(config) is None:  # as a construction runs it
            need(SelfTest(), SELF_TEST)
        if why:
            notes.append(f"{layer.name}: {why}; using impl='simt' instead, as a construction there does")
        for spec, who in specs:
            need(spec, who)
    needed = tuple(Needed(spec, ", ".join(whys)) for spec, whys in found.values())
    return TargetPlan(target, target_policy.line(), needed, tuple(notes)), refused


def check_nvrtc(arches: Iterable[str]) -> str:
    """NVRTC's version, where it is installed and compiles for every one of ``arches``; else a
    ``PrecompileError`` naming what to install."""
    from .backends import nvrtc

    try:
        version = nvrtc.version()
        supported = set(nvrtc.supported_archs())
    except ImportError as err:
        raise PrecompileError(f"precompile compiles with NVRTC through cuda-bindings, which is not installed "
                              f"({err.__cause__ or err}): {INSTALL}") from None
    except Exception as err:  # the binding present, its NVRTC library not loadable
        raise PrecompileError(f"NVRTC cannot be loaded ({type(err).__name__}: {err}): {INSTALL}") from None
    missing = [arch for arch in arches if int(arch[3:]) not in supported]
    if missing:
        raise PrecompileError(f"NVRTC {version[0]}.{version[1]} cannot compile for {', '.join(missing)}: "
                              "pip install 'nvidia-cuda-nvrtc-cu12>=12.9' (or 'nvidia-cuda-nvrtc>=13' with "
                              "cupy-cuda13x), the same on the serving machine")
    return f"{version[0]}.{version[1]}"


def build_all(plans: Sequence[TargetPlan], cache_dir: Optional[Path] = None, *, jobs: int = 1,
              on_built: Optional[Callable[[Built], None]] = None, keep_going: bool = False) -> list[Built]:
    """Compile (or find) every kernel of ``plans`` into ``cache_dir`` (the directory
    ``METRALE_ATTN_CACHE_DIR`` names; default the package's cache), ``jobs`` at a time: one in
    this process and ``jobs - 1`` in processes of their own (spawned: NVRTC starts fresh
    in each), all taking the next kernel as they finish one, so this process compiles while the
    others start (a spawned process spends about a second importing before its first kernel).
    Processes, not threads: NVRTC has been seen to serialize the compiles of one process's threads
    (NVIDIA forum reports on CUDA 11.8 and 12.3), and a process of its own contains a crash. Calls
    ``on_built`` with each as it is done (in the order they finish, one call at a time).
    Returns them in the plans' order. A kernel that cannot be built is a ``Built`` whose
    ``error`` says why; unless ``keep_going``, none is started after it. A directory that holds
    every kernel may be read-only."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    todo = [(plan.target.arch, needed, root) for plan in plans for needed in plan.needed]
    jobs = min(int_in("jobs", jobs, 1), max(len(todo), 1))
    done: dict[int, Built] = {}
    lock = threading.Lock()
    queue = iter(enumerate(todo))
    stopped = False

    def take() -> Optional[tuple[int, tuple[str, Needed, Path]]]:
        with lock:
            return None if stopped else next(queue, None)

    def finish(index: int, built: Built) -> None:
        nonlocal stopped
        with lock:
            done[index] = built
            if on_built is not None:
                on_built(built)
            stopped = stopped or (bool(built.error) and not keep_going)

    def here() -> None:
        while (item := take()) is not None:
            finish(item[0], _build_one(item[1]))

    if jobs == 1:
        here()
        return [done[i] for i in sorted(done)]
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    def there(pool: ProcessPoolExecutor) -> None:
        while (item := take()) is not None:
            index, job = item
            try:
                built = pool.submit(_build_one, job).result()
            except Exception as err:  # noqa: BLE001 - the process died (a crash in NVRTC): said as its kernel's error
                finish(index, Built(job[0], job[1].name, job[1].why, False, 0.0, None, f"{type(err).__name__}: {err}"))
                return  # the pool is broken: this process compiles the rest
            finish(index, built)

    with ProcessPoolExecutor(max_workers=jobs - 1, mp_context=multiprocessing.get_context("spawn")) as pool:
        feeders = [threading.Thread(target=there, args=(pool,), daemon=True) for _ in range(jobs - 1)]
        for feeder in feeders:
            feeder.start()
        here()
        for feeder in feeders:
            feeder.join()
    return [done[i] for i in sorted(done)]


def _build_one(job: tuple[str, Needed, Path]) -> Built:
    """One kernel into the cache (``build_all``'s unit of work, in this process or a pool's):
    an error is returned in the ``Built``, as a pool's process must return it."""
    from .backends.cupy_backend import cubin_lookup  # needs cuda-bindings and NVRTC: check_nvrtc first

    arch, needed, root = job
    start = time.perf_counter()
    try:
        found = cubin_lookup(needed.spec, arch, root)
        if found.path.parent != root / "cubin":  # the lookup fell back to a private directory: gone at exit
            raise PrecompileError(f"{unwritable_cache(root / 'cubin', found.path.name)} (the kernel went to "
                                  f"{found.path.parent} for this process only)")
    except Exception as err:  # noqa: BLE001 - returned, named by its kernel
        error = str(err) if isinstance(err, PrecompileError) else f"{type(err).__name__}: {err}"
        return Built(arch, needed.name, needed.why, False, time.perf_counter() - start, None, error)
    return Built(arch, needed.name, needed.why, found.compile_s is None, time.perf_counter() - start, found.path)


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
               cache_dir: Optional[Path] = None, sm_count: Optional[int] = None, jobs: int = 1,
               on_built: Optional[Callable[[Built], None]] = None) -> list[Built]:
    """Compile every kernel ``layers`` need on each of ``targets`` into ``cache_dir`` (default:
    the package's cache, where ``DecodeAttention`` looks), without a GPU, ``jobs`` processes
    at a time. Returns what was built or found, in order; a second call finds them all (every
    one a hit). The steps are ``needed_specs`` for every target (so any refusal comes first),
    ``check_nvrtc``, then ``build_all``; a kernel that could not be built is a
    ``PrecompileError`` naming why. ``metrale-attn precompile`` runs the same steps, printing
    between them, and compiles for the targets that take the model where others refuse it."""
    plans = [needed_specs(layers, t, options, sm_count=sm_count) for t in targets]  # every refusal first
    check_nvrtc(t.arch for t in targets)
    built = build_all(plans, cache_dir, jobs=jobs, on_built=on_built)
    failed = next((b for b in built if b.error), None)
    if failed is not None:
        raise PrecompileError(failed.error)
    return built
