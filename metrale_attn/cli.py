"""Command line: ``metrale-attn plan`` prints launch geometry, ``metrale-attn demo`` runs a batch."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from dataclasses import replace

from .config import ENV_IMPL, ModelShape, configure, impl_chosen
from .kernels import smem_refusal
from .plan import make_plan, workspace_for
from .policy import parse_gqa_pack
from .targets import TARGETS, get_target, resolve_defaults

MODELS: dict[str, ModelShape] = {
    "qwen3.8-27b": ModelShape(24, 4, 256),  # the GQA-pack width: 24 = 4 x 6 at head_dim 256
    "llama-3-8b": ModelShape(32, 8, 128),
    "llama-3-70b": ModelShape(64, 8, 128),
}


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


def _shape(args: argparse.Namespace) -> ModelShape:
    given = (args.q_heads, args.kv_heads, args.head_dim)
    if args.model:
        base = MODELS[args.model]
        preset = (base.num_q_heads, base.num_kv_heads, base.head_dim)
        return ModelShape(*(p if g is None else g for g, p in zip(given, preset)))  # a flag given wins over the preset
    missing = [flag for flag, value in zip(("--q-heads", "--kv-heads", "--head-dim"), given) if value is None]
    if missing:
        raise ValueError(f"give --model or all of --q-heads, --kv-heads, --head-dim (missing {', '.join(missing)})")
    return ModelShape(*given)


def render_plan_table(args: argparse.Namespace) -> str:
    """The target line and one row per batch size."""
    defaults = resolve_defaults(get_target(args.target), splitk=args.splitk, gqa_pack=args.gqa_pack)
    shape = _shape(args)
    max_batch = max(max(args.batch), 1) if args.max_batch is None else args.max_batch
    workspace = workspace_for(defaults, shape, max_batch=max_batch, max_decode_seqs=args.max_decode_seqs)
    # What the library would run: the flags, else the same environment variables it reads.
    config = configure(shape.num_q_heads, shape.num_kv_heads, shape.head_dim, 16, q_dtype=args.q_dtype,
                       kv_dtype=args.kv_dtype, max_batch=max_batch, defaults=defaults,
                       max_decode_seqs=args.max_decode_seqs, impl=args.impl, heads_per_cta=args.heads_per_cta)
    if config.impl == "mma" and not impl_chosen(args.impl, os.environ.get(ENV_IMPL)) and smem_refusal(config):
        config = replace(config, impl="simt")  # as DecodeAttention falls back: no mma kernel fits the target
    impl = config.impl
    lines = [
        defaults.line(),
        f"model: q_heads={shape.num_q_heads} kv_heads={shape.num_kv_heads} head_dim={shape.head_dim} "
        f"max_batch={max_batch}; impl {impl}; workspace {workspace.slots} slots x {workspace.slot_floats} fp32 = "
        f"{workspace.nbytes} bytes",
        "",
        f"{'batch':>6}  {'arm':<10}  {'splits':>6}  {'h/CTA':>5}  {'grids':<28}  {'CTAs':>7}  {'waves':>6}  "
        f"{'ws bytes':>10}",
    ]
    for batch in args.batch:
        plan = make_plan(config, batch, workspace=workspace)
        grids = " + ".join("({},{},{})".format(*g.grid) for g in plan.launches)
        used = plan.slots_used * workspace.slot_floats * 4
        lines.append(
            f"{batch:>6}  {plan.arm:<10}  {plan.num_splits:>6}  {plan.heads_per_cta:>5}  {grids:<28}  "
            f"{plan.ctas:>7}  {plan.waves(defaults.sm_count):>6.2f}  {used:>10}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="metrale-attn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    plan = sub.add_parser("plan", help="print the launch geometry for a model shape on a target")
    plan.add_argument("--target", default="hopper", choices=sorted(TARGETS))
    plan.add_argument("--model", choices=sorted(MODELS), help="a preset shape (flags below override it)")
    plan.add_argument("--q-heads", type=_int_at_least(1))
    plan.add_argument("--kv-heads", type=_int_at_least(1))
    plan.add_argument("--head-dim", type=_int_at_least(1))
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

    demo = sub.add_parser("demo", help="run a mixed decode batch on the best backend and check it")
    demo.add_argument("--backend", choices=["cupy", "cpu"], help="default: cupy with a GPU, else cpu")
    demo.add_argument("--target", choices=sorted(TARGETS), help="default: detected, or hopper on the CPU")
    demo.add_argument("--seed", type=_int_at_least(0), default=0)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            print(render_plan_table(args))
            return 0
        from .demo import run_demo

        return run_demo(backend=args.backend, target=args.target, seed=args.seed)
    except ValueError as err:
        print(f"metrale-attn {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
