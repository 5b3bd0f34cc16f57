"""Command line: ``metrale-attn plan`` prints launch geometry, ``metrale-attn precompile``
compiles a model's kernels into the cache before serving, ``metrale-attn check`` proves the
package on this machine's GPU for a model (output against float64, speed against the copy
bandwidth and the peers), ``metrale-attn demo`` runs a batch."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Optional, Sequence

from .cache import cache_root
from .config import ENV_IMPL, configure, impl_chosen
from .kernels import launchable_config
from .models import MODELS
from .plan import LEGACY_MAX_DECODE_SEQS, make_plan, workspace_for
from .policy import parse_gqa_pack
from .precompile import (FEATURE_FLAGS, SHAPE_FLAGS, Layer, Model, Options, PrecompileError, build_all, check_nvrtc,
                         describe_model, layer_shape, not_served, plan_targets, target_for_arch)
from .targets import TARGETS, get_target, resolve_target_policy

SKIPPED_EXIT = 3
"""``metrale-attn precompile``'s exit code when it compiled for some targets and skipped others
that refuse a layer kind of the model, or compiled the model's other layer kinds beside one this
version serves nowhere yet (``--skip-unsupported``: 0)."""



def _batches(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch must be comma-separated ints, got {text!r}") from None
    if not values or min(values) < 0:
        raise argparse.ArgumentTypeError(f"--batch must be comma-separated ints >= 0, got {text!r}")
    return values


def _int_at_least(low: int):
    """An argparse type: an int >= ``low`` (argparse names the flag when it refuses)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low:
            raise argparse.ArgumentTypeError(f"must be an int >= {low}, got {text!r}")
        return value

    return parse


def _on_off(text: str) -> bool:
    value = parse_gqa_pack(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"--gqa-pack must be on or off, got {text!r}")
    return value


def render_plan_table(args: argparse.Namespace) -> str:
    """The target line, then for each layer kind of the model its line (and why it falls back to
    ``simt``, where it does) and one row per batch size."""
    target_policy = resolve_target_policy(get_target(args.target), splitk=args.splitk, gqa_pack=args.gqa_pack)
    model = model_of(args)
    lines = [target_policy.line(), *(model.lines if model.config else ())]
    for n, layer in enumerate(model.layers):
        title = "model" if len(model.layers) == 1 else f"{'layer' if model.config else 'model'} {layer.name}"
        lines += ([""] if n else []) + _plan_rows(args, target_policy, layer, title)
    return "\n".join(lines)


def _plan_rows(args: argparse.Namespace, target_policy, layer: Layer, title: str) -> list[str]:
    """One layer kind's part of ``plan``: its line, why it falls back to simt, its table; or,
    for a shape no target serves yet (``precompile.not_served``), its line and why."""
    unserved = not_served(layer)
    if unserved is not None:
        return [f"{title}: {layer.shape()}: {unserved}"]
    shape = layer_shape(layer)
    max_batch = max(max(args.batch), 1) if args.max_batch is None else args.max_batch
    workspace = workspace_for(target_policy, shape, max_batch=max_batch, max_decode_seqs=args.max_decode_seqs)
    # What the library would run: the flags, else the same environment variables it reads.
    config = configure(shape.num_q_heads, shape.num_kv_heads, shape.head_dim, 16, v_head_dim=shape.v_head_dim,
                       q_dtype=args.q_dtype,
                       kv_dtype=args.kv_dtype, max_batch=max_batch, target_policy=target_policy,
                       max_decode_seqs=args.max_decode_seqs, impl=args.impl, heads_per_cta=args.heads_per_cta,
                       window_left=layer.window_left, logits_soft_cap=layer.logits_soft_cap, sinks=layer.sinks,
                       sm_scale=layer.sm_scale)
    # As DecodeAttention falls back where the target cannot run the mma kernels (no self-test here).
    config, why = launchable_config(config, [], impl_chosen(args.impl, os.environ.get(ENV_IMPL)))
    lines = [
        f"{title}: q_heads={shape.num_q_heads} kv_heads={shape.num_kv_heads} head_dim={shape.head_dim} "
        + (f"v_head_dim={shape.v_head_dim} " if shape.v_head_dim != shape.head_dim else "") + f"max_batch={max_batch}; impl {config.impl}; workspace {workspace.slots} slots x {workspace.slot_floats} "
        f"fp32 = {workspace.nbytes} bytes",
        *([f"impl simt, not mma: {why}"] if why else []),
        "",
        f"{'batch':>6}  {'arm':<10}  {'splits':>6}  {'h/CTA':>5}  {'work items':<28}  {'items':>7}  {'/SM':>6}  "
        f"{'CTAs':>5}  {'ws bytes':>10}",
    ]
    for batch in args.batch:
        plan = make_plan(config, batch, workspace=workspace)
        grids = " + ".join("({},{},{})".format(*g.grid) for g in plan.launches)
        used = plan.slots_used * workspace.slot_floats * 4
        lines.append(
            f"{batch:>6}  {plan.arm:<10}  {plan.num_splits:>6}  {plan.heads_per_cta:>5}  {grids:<28}  "
            f"{plan.items:>7}  {plan.items_per_sm(target_policy.sm_count):>6.2f}  {plan.ctas:>5}  {used:>10}"
        )
    return lines


def _float_above_zero(text: str) -> float:
    """An argparse type: a finite float > 0."""
    try:
        value = float(text)
    except ValueError:
        value = None
    if value is None or not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def _names(text: str) -> list[str]:
    """An argparse type: comma-separated names (``hopper,b200``)."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"must be one or more comma-separated names, got {text!r}")
    return names


# -- the model: one description for every command ------------------------------------------


def add_model_options(parser: argparse.ArgumentParser, *, plain: bool = False) -> None:
    """``--model``, ``--hf-config`` and ``--tensor-parallel-size``/``--tp``, and one rank's shape and
    features (``--q-heads``... ``--sinks``), as every command that takes a model reads them
    (``model_of``). ``plain``: ``--model`` and ``--tp`` only (one plain layer kind)."""
    group = parser.add_argument_group("the model: --model, --hf-config, or one rank's shape and features"
                                      if not plain else "the model")
    group.add_argument("--model", type=_names, help="comma-separated presets (" + ", ".join(sorted(MODELS)) + ") or "
                       "Q/KV/HEAD_DIM shapes (32/8/128): the whole model's heads")
    if not plain:
        group.add_argument("--hf-config", help="a Hugging Face config.json (heads, head dim, sliding windows, "
                           "soft-cap, sinks, dtype) instead of --model")
    group.add_argument("--tensor-parallel-size", "--tp", type=_int_at_least(1), default=1,
                       help="ranks the heads of --model or --hf-config are split over, as vLLM splits them "
                       "(default 1)")
    if plain:
        return
    group.add_argument("--q-heads", type=_int_at_least(1), help="one rank's q heads")
    group.add_argument("--kv-heads", type=_int_at_least(1), help="one rank's KV heads")
    group.add_argument("--head-dim", type=_int_at_least(1))
    group.add_argument("--window-left", type=_int_at_least(-1),
                       help="sliding window: keys before the current one a token sees (-1: none, default)")
    group.add_argument("--logits-soft-cap", type=_float_above_zero, help="the logits soft-cap (default none)")
    group.add_argument("--sinks", action="store_true", help="attention sinks (run() takes sink logits)")


def model_of(args: argparse.Namespace) -> Model:
    """The model ``add_model_options``' flags describe (``precompile.describe_model``)."""
    flags = {name: getattr(args, name, None) for name in (*SHAPE_FLAGS, *FEATURE_FLAGS)}
    return describe_model(args.model or (), getattr(args, "hf_config", None), args.tensor_parallel_size, **flags)


# -- precompile ----------------------------------------------------------------------------


def _precompile_targets(args: argparse.Namespace) -> list:
    """The targets of ``--target`` or ``--arch`` (exactly one of them)."""
    if (args.target is None) == (args.arch is None):
        raise ValueError("give the GPUs to compile for with --target (" + ", ".join(TARGETS) + ") or --arch "
                         "(" + ", ".join(t.arch for t in TARGETS.values()) + "), one of the two")
    if args.target is not None:
        try:
            return [get_target(name) for name in args.target]
        except ValueError as err:
            raise ValueError(f"--{err}") from None
    return [target_for_arch(arch) for arch in args.arch]


def run_precompile(args: argparse.Namespace, out=print) -> int:
    """``metrale-attn precompile``: plan every target (each refusal said, naming the target and
    the layer kind), then compile for those that take every layer kind, ``--jobs`` at a time.
    Exits ``SKIPPED_EXIT`` when a target was skipped (0 with ``--skip-unsupported``); a model no
    target takes is an error."""
    model = model_of(args)
    targets = _precompile_targets(args)
    q_dtype = args.q_dtype or model.dtype or "bfloat16"
    options = Options(q_dtype=q_dtype, kv_dtype=args.kv_dtype, max_batch=args.max_batch, max_q_len=args.max_q_len,
                      out_dtype=args.out_dtype, page_size=args.page_size, splitk=args.splitk, gqa_pack=args.gqa_pack,
                      impl=args.impl, heads_per_cta=args.heads_per_cta, max_decode_seqs=args.max_decode_seqs)
    plans, refusals = plan_targets(model.layers, targets, options, sm_count=args.sm_count)
    unserved = [r for r in refusals if r.everywhere]
    refusals = [r for r in refusals if not r.everywhere]
    # The layer kinds came from the file: say which, as hf_config's own refusals do.
    from_file = f" (layer kinds from --hf-config {model.config})" if model.config else ""
    if not plans and unserved:
        raise unserved[0].error_type("; ".join(r.line() + from_file for r in unserved + refusals))
    if not plans:
        raise refusals[0].error_type("; ".join(r.line() + from_file for r in refusals))
    where = "--q-dtype" if args.q_dtype else ("the config's dtype" if model.dtype else "the default")
    lines = [*model.lines, f"dtypes: q {q_dtype} ({where}), KV {args.kv_dtype or q_dtype}"
             f"{'' if args.kv_dtype else ' (as q; --kv-dtype to change)'}; max_batch {args.max_batch}, "
             f"max_q_len {args.max_q_len}"]
    root = Path(args.cache_dir) if args.cache_dir else cache_root()
    version = None if args.dry_run else check_nvrtc(p.target.arch for p in plans)
    for line in lines:
        out(line)
    for refusal in unserved:
        out(f"not served: {refusal.line()}{from_file}; the model's other layer kinds are planned below")
    for target in targets:
        for plan in (p for p in plans if p.target.name == target.name):
            out(f"{plan.target.arch}: {plan.defaults_line}")
            for note in plan.notes:
                out(f"  {note}")
            for needed in plan.needed if args.dry_run else ():
                out(f"  {needed.name}  [{needed.why}]")
        for refusal in (r for r in refusals if r.target.name == target.name):
            out(f"{target.arch}: skipped: {refusal.line()}{from_file}")
    arches = ", ".join(p.target.arch for p in plans)
    count = sum(len(p.needed) for p in plans)
    if args.dry_run:
        out(f"would compile {count} kernel(s) for {arches} (dry run: nothing compiled)")
    else:
        jobs = min(args.jobs, count) or 1
        out(f"compiling {count} kernel(s), {jobs} at a time, each said as it is done:")
        start = time.perf_counter()
        built = build_all(plans, root, jobs=args.jobs, on_built=lambda b: out(b.line()))
        failed = next((b for b in built if b.error), None)
        if failed is not None:
            raise PrecompileError(failed.error)
        misses = sum(not b.hit for b in built)
        out(f"precompiled {len(built)} kernel(s) for {arches} with NVRTC {version} into {root / 'cubin'}: {misses} "
            f"compiled, {len(built) - misses} already cached, {time.perf_counter() - start:.1f} s ({jobs} "
            f"process{'es' if jobs > 1 else ''})")
    code = 0
    if unserved:
        code = 0 if args.skip_unsupported else SKIPPED_EXIT
        out(f"{len(unserved)} layer kind(s) of the model not served (above): its other kinds are ready; exit {code}"
            + (" (--skip-unsupported)" if args.skip_unsupported else " (--skip-unsupported to exit 0)"))
    if refusals:
        skipped = list(dict.fromkeys(f"{r.target.name} ({r.target.arch})" for r in refusals))
        code = 0 if args.skip_unsupported else SKIPPED_EXIT
        out(f"skipped {', '.join(skipped)}: a layer kind of the model is refused there (above); exit {code}"
            + (" (--skip-unsupported)" if args.skip_unsupported else " (--skip-unsupported to exit 0)"))
    if args.cache_dir and not args.dry_run:
        out(f"serve with METRALE_ATTN_CACHE_DIR={root} (the same NVRTC version: the cache key holds it) to find them")
    return code


def run_check_command(args: argparse.Namespace, out=print) -> int:
    """``metrale-attn check``: the model's layers, then ``check.run_check``."""
    from .check import CheckOptions, compile_kernels, run_check
    from .check.cells import parse_cells, parse_points
    from .check.run import resolve_backend

    named = parse_cells(args.cells, args.tensor_parallel_size) if args.cells is not None else ()
    described = any(getattr(args, name, None) not in (None, False) for name in ("model", "hf_config", *SHAPE_FLAGS))
    cells = ", ".join(f"{n.layer.name}:{n.kv_dtype}:{n.batch}x{n.context}" for n in named)
    if named and not described:  # --cells alone: the check is those cells
        layers, label = (), cells
    else:
        model = model_of(args)
        layers, label = model.layers, model.label + (f" + {cells}" if named else "")
    options = CheckOptions(tuple(layers), label, Path(args.out), kv_dtypes=tuple(args.kv_dtype),
                           impls=tuple(args.impl), points=parse_points(args.points), backend=args.backend,
                           cap_s=args.cap_s, jobs=args.jobs, correctness=not args.no_correctness,
                           deadline_s=args.deadline_s, flashinfer_status=args.flashinfer_status, named=named)
    if args.compile_only:
        if resolve_backend(options.backend) != "cupy":
            out("metrale-attn check --compile-only: no GPU here; the CPU backend builds its modules as it runs")
            return 0
        compile_kernels(options, say=out)
        return 0
    code, _ = run_check(options, say=out)
    return code


def _demo_layer(args: argparse.Namespace) -> Optional[Layer]:
    """The one plain layer kind ``demo`` runs: ``--model``'s (one model), or None for the demo's own."""
    if not args.model:
        if args.tensor_parallel_size != 1:
            raise ValueError("--tensor-parallel-size splits the heads of --model; give --model too")
        return None
    if len(args.model) != 1:
        raise ValueError(f"--model: the demo runs one model, got {len(args.model)} ({', '.join(args.model)})")
    return model_of(args).layers[0]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metrale-attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the launch geometry for a model shape on a target")
    plan.add_argument("--target", default="hopper", choices=sorted(TARGETS))
    add_model_options(plan)
    plan.add_argument("--batch", type=_batches, default=[1, 8, 64], help="comma-separated batch sizes")
    plan.add_argument("--max-batch", type=_int_at_least(1), help="workspace rows (default: the largest batch)")
    plan.add_argument("--max-decode-seqs", type=_int_at_least(0), default=1,
                      help="floor of legacy's reference batch (default 1)")
    plan.add_argument("--splitk", help="override: auto, legacy, off or a split count")
    plan.add_argument("--gqa-pack", type=_on_off, help="override: on or off")
    plan.add_argument("--impl", help="mma (tensor cores, default) or simt (the first CUDA-core kernels)")
    plan.add_argument("--heads-per-cta", type=int, help="override the rule: a divisor of the group size up to 16")
    plan.add_argument("--q-dtype", default="bfloat16", help="q and out: bfloat16 (default) or float16")
    plan.add_argument("--kv-dtype", default="bfloat16", help="the KV cache: bfloat16 (default), float16, fp8_e4m3 "
                      "or fp8_e5m2")

    pre = sub.add_parser("precompile", help="compile every kernel a model needs for a GPU, without one, into the "
                         "cache (or --cache-dir)", description="Compile every kernel spec DecodeAttention builds "
                         "for a model's layers on a target, with NVRTC (no GPU needed), into the cubin cache a "
                         "later construction finds. Safe to run from several processes at once.")
    where = pre.add_argument_group("where")
    where.add_argument("--target", type=_names, help="comma-separated: " + ", ".join(TARGETS))
    where.add_argument("--arch", type=_names, help="comma-separated, instead of --target: "
                       + ", ".join(t.arch for t in TARGETS.values()))
    where.add_argument("--sm-count", type=_int_at_least(1), help="the GPU's SM count (default: the target's; "
                       "the split-K policy reads it)")
    where.add_argument("--cache-dir", help="the cache root to fill (what METRALE_ATTN_CACHE_DIR names at serving "
                       "time; default: the package's cache)")
    where.add_argument("--dry-run", action="store_true", help="list the kernels without compiling (needs no NVRTC)")
    where.add_argument("-j", "--jobs", type=_int_at_least(1), default=os.cpu_count() or 1,
                       help="NVRTC compiles at a time, each in a process of its own (default: the cores)")
    where.add_argument("--skip-unsupported", action="store_true", help="exit 0 when a target that refuses a layer "
                       "kind of the model was skipped (default: exit %d; the other targets are compiled either way)"
                       % SKIPPED_EXIT)
    add_model_options(pre)
    serve = pre.add_argument_group("how it is served (DecodeAttention's arguments)")
    serve.add_argument("--q-dtype", help="q and out: bfloat16 or float16 (default: the config's dtype, else "
                       "bfloat16)")
    serve.add_argument("--kv-dtype", help="the KV cache: bfloat16, float16, fp8_e4m3 or fp8_e5m2 (default: q's)")
    serve.add_argument("--out-dtype", help="float32 for fp32 outputs (default: q's)")
    serve.add_argument("--page-size", type=_int_at_least(1), default=16, help="tokens per page (checked; no kernel "
                       "depends on it)")
    serve.add_argument("--max-batch", type=_int_at_least(1), default=256,
                       help="the most sequences one call takes (vLLM: max_num_seqs; default 256)")
    serve.add_argument("--max-q-len", type=_int_at_least(1), default=1,
                       help="query tokens per sequence (1 + speculative tokens; default 1)")
    serve.add_argument("--max-decode-seqs", type=_int_at_least(0), default=LEGACY_MAX_DECODE_SEQS,
                       help="floor of legacy's reference batch (default %(default)s)")
    serve.add_argument("--splitk", help="override: auto, legacy, off or a split count")
    serve.add_argument("--gqa-pack", type=_on_off, help="override: on or off")
    serve.add_argument("--impl", help="mma (default) or simt")
    serve.add_argument("--heads-per-cta", type=int, help="override the rule: a divisor of the group size up to 16")

    check = sub.add_parser("check", help="prove the package on this GPU for a model: every arm against float64, "
                           "speed against the copy bandwidth and the peers; a report in --out",
                           description="Build every kernel the model's layers need, check each arm's output and "
                           "lse against the float64 reference (the 1-ulp bar), time batch 1, 16, 64 x 4k and 1 x "
                           "32k against the copy bandwidth with PyTorch SDPA and FlashInfer beside ours where "
                           "installed, and write report.md, report.json and report.png. Exits 1 when a check of "
                           "ours fails. Without a GPU: the correctness half, on the CPU backend.")
    add_model_options(check)
    check.add_argument("--kv-dtype", type=_names, default=["bf16"], help="comma-separated: bf16 (default), fp8 "
                       "(e4m3, a per-tensor scale)")
    check.add_argument("--impl", type=_names, default=["mma", "sdpa", "flashinfer"],
                       help="comma-separated, run in this order whatever the order given: mma (ours, default), "
                       "simt (our reference kernels), sdpa, flashinfer (default: mma,sdpa,flashinfer)")
    check.add_argument("--points", default="1x4096,16x4096,64x4096,1x32768",
                       help="timing points BATCHxCONTEXT (default %(default)s)")
    check.add_argument("--cells", help="cells beyond --model x --kv-dtype x --points, each its layer's correctness "
                       "cells and one timing cell: MODEL:KV:BATCHxCONTEXT items separated by commas, MODEL a --model "
                       "preset or shape (deepseek-v3:bf16:64x4096,16/1/576/512:bf16:1x32768); alone, the check is "
                       "those cells")
    check.add_argument("--backend", choices=["auto", "cupy", "cpu"], default="auto",
                       help="auto (default): the GPU where CuPy sees one, else the CPU backend (correctness only)")
    check.add_argument("--out", default="metrale_attn_check", help="the report's folder (default %(default)s)")
    check.add_argument("--cap-s", type=_float_above_zero, default=300.0,
                       help="each implementation's process is stopped after this many seconds (default 300)")
    check.add_argument("-j", "--jobs", type=_int_at_least(1), default=os.cpu_count() or 1,
                       help="NVRTC compiles at a time (default: the cores)")
    check.add_argument("--no-correctness", action="store_true", help="time only (the correctness cells skipped)")
    check.add_argument("--compile-only", action="store_true", help="compile the kernels the check needs into the "
                       "cache and stop (a GPU: its architecture and SM count decide them)")
    check.add_argument("--deadline-s", type=_float_above_zero, help="every implementation's process done within "
                       "this many seconds, the time left shared among those still to run")
    check.add_argument("--flashinfer-status", help=argparse.SUPPRESS)  # the benchmark harness's JIT prewarm status

    demo = sub.add_parser("demo", help="run a mixed decode batch on the best backend and check it")
    demo.add_argument("--backend", choices=["cupy", "cpu"], help="default: cupy with a GPU, else cpu")
    demo.add_argument("--target", choices=sorted(TARGETS), help="default: detected, or hopper on the CPU")
    demo.add_argument("--seed", type=_int_at_least(0), default=0)
    add_model_options(demo, plain=True)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            print(render_plan_table(args))
            return 0
        if args.command == "precompile":
            return run_precompile(args, out=lambda line: print(line, flush=True))
        if args.command == "check":
            return run_check_command(args, out=lambda line: print(line, flush=True))
        from .demo import run_demo

        return run_demo(backend=args.backend, target=args.target, seed=args.seed, layer=_demo_layer(args))
    except (ValueError, TypeError, PrecompileError) as err:
        print(f"metrale-attn {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
