"""Build a fixed, broad sample of mma specs with NVRTC (no GPU needed) and write each cubin
and its SHA-256, so that a source edit meant to move no instruction can be checked against
the commit before it:

    git worktree add --detach /tmp/base <commit>
    PYTHONPATH=/tmp/base python -m benchmarks.cubin_identity /tmp/cubins-base
    python -m benchmarks.cubin_identity /tmp/cubins-new
    python -m benchmarks.cubin_identity --compare /tmp/cubins-base /tmp/cubins-new

The sample (``sample()``): every ``kernels.all_specs()`` mma spec for sm_90 whose index is
a multiple of ``--every`` (arms, dtypes, head dims, row tiles, each feature alone and all of
them), plus specs for sm_80, sm_100 and sm_120 (their own shared memory, so other warp
counts and rings), every ``--every``-th simt spec and two ``merge_states`` kernels (they
share pd_common.cuh, pd_convert.cuh and pd_splitk.cuh). A cubin already in the output
folder is kept (a run resumes). Reads only ``kernels.KernelSpec`` and ``kernels.all_specs``, so it runs
against older checkouts too. ``-j`` compiles in parallel processes.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
from concurrent.futures import ProcessPoolExecutor

# (arch, smem per block): the targets' shared memory (targets.py)
OTHER_ARCHS = (("sm_80", 163 * 1024), ("sm_100", 227 * 1024), ("sm_120", 99 * 1024))


def _pin_sources():
    """Read kernels_cu/ of the checkout metrale_attn was imported from: an editable install
    maps ``metrale_attn.kernels_cu`` (and any module the checkout lacks) to its own checkout,
    whatever PYTHONPATH says. Patches the module whose ``read_source`` the specs use."""
    import pathlib
    import sys

    from metrale_attn import kernels

    root = pathlib.Path(kernels.__file__).resolve().parent.parent
    module = sys.modules[kernels.read_source.__module__] if hasattr(kernels, "read_source") else None
    if module is None:  # kernels imports inline only: the module that defines it
        module = sys.modules[kernels.inline.__module__]
    if pathlib.Path(module.__file__).resolve().parent.parent != root:
        raise RuntimeError(f"{module.__name__} comes from {module.__file__}, not from {root}")
    folder = root / "kernels_cu"
    module._source_dir = lambda: folder
    module.read_source.cache_clear()
    return folder


def sample(every: int):
    from metrale_attn import kernels

    every_spec = kernels.all_specs()
    mma = [s for s in every_spec if s.impl == "mma"]
    out = [(s, "sm_90") for i, s in enumerate(mma) if i % every == 0 or s.features]
    out += [(s, "sm_90") for i, s in enumerate(s for s in every_spec if s.impl == "simt") if i % every == 0]
    out += [(kernels.MergeStates(a, b), "sm_90") for a, b in (("bf16", "bf16"), ("float32", "fp16"))]
    KernelSpec = kernels.KernelSpec
    for arch, smem in OTHER_ARCHS:
        for arm, hd, q, kv, rt, feats in (
            ("unpacked", 128, "bf16", "bf16", 2, ()),
            ("splitk", 256, "fp16", "bf16", 1, ("window", "sinks", "soft_cap")),
            ("gqa_packed", 256, "bf16", "fp16", 1, ()),
            ("splitk", 192, "bf16", "fp8" if arch != "sm_80" else "bf16", 1, ("multi_token", "out_f32")),
            ("unpacked", 96, "fp16", "fp16", 2, ("device_scales", "csr")),
        ):
            out.append((KernelSpec(arm, hd, q, kv, "mma", rt, frozenset(feats), smem_limit=smem), arch))
    return out


def _build(job):
    spec, arch, outdir = job
    _pin_sources()
    from metrale_attn.backends.cupy_backend import nvrtc_compile

    name = f"{spec.name}-{arch}"
    path = os.path.join(outdir, name + ".cubin")
    if os.path.exists(path):  # a run resumed (or widened): keep what is there
        with open(path, "rb") as f:
            return name, hashlib.sha256(f.read()).hexdigest()
    cubin = nvrtc_compile(spec, arch)[0]
    with open(path, "wb") as f:
        f.write(cubin)
    return name, hashlib.sha256(cubin).hexdigest()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("-j", type=int, default=2)
    ap.add_argument("--compare", action="store_true", help="compare two output dirs' sha256.txt")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (dict(line.split() for line in open(os.path.join(d, "sha256.txt"))) for d in args.dirs)
        same = [n for n in a if b.get(n) == a[n]]
        print(f"{len(same)} of {len(a)} identical; differ: {sorted(set(a) - set(same))}; "
              f"only in the second: {sorted(set(b) - set(a))}")
        return 0 if len(same) == len(a) == len(b) else 1
    outdir = args.dirs[0]
    print(f"sources: {_pin_sources()}")
    os.makedirs(outdir, exist_ok=True)
    jobs = [(s, arch, outdir) for s, arch in sample(args.every)]
    with ProcessPoolExecutor(args.j) as pool:
        results = sorted(pool.map(_build, jobs))
    with open(os.path.join(outdir, "sha256.txt"), "w") as f:
        f.writelines(f"{n} {h}\n" for n, h in results)
    print(f"{len(results)} cubins in {outdir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
