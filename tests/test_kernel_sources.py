"""Kernel sources: inlining, constants read back from the CUDA text, and NVRTC compiles without a GPU."""

import pathlib
import re

import pytest
from support.builds import ARCHES, arch_matrix, needs_nvrtc, nvrtc_build, nvrtc_ptx, spec_matrix, spill_frames

from metrale_attn import policy
from metrale_attn.kernels import FEATURES, KernelSpec, all_specs, kernel_params
from metrale_attn.sources import (
    SOURCE_FILES,
    KernelSourceError,
    inline,
    parse_kernel_params,
    read_define,
    read_source,
    source_constants,
    source_names,
)
from metrale_attn.config import IMPLS
from metrale_attn.plan import ARMS, KERNELS
from metrale_attn.targets import TARGETS

"""Every target's architecture, from the one table (sm_90, sm_100, sm_103, sm_121): each
is the exact sm_XY the backend compiles for on that target's device."""


def test_headers_are_inlined_with_line_directives_naming_the_real_files():
    text = KernelSpec("splitk", 128, "bf16", "fp8").source()
    assert '#include "' not in text
    assert text.startswith('#line 1 "kernels_cu/decode_splitk.cu"')
    for header in ("decode_core.cuh", "mma_layout.cuh", "mma_features.cuh", "mma_stream.cuh", "mma_attend.cuh",
                   "mma_combine.cuh", "mma_kernel.cuh", "pd_common.cuh", "pd_ptx.cuh", "pd_splitk.cuh"):
        assert text.count(f'#line 1 "kernels_cu/{header}"') == 1, header


def test_the_line_after_an_include_is_numbered_as_in_the_original_file():
    original = read_source("simt/simt_decode_gqa_packed.cu").splitlines()
    text = inline("simt/simt_decode_gqa_packed.cu")
    assert text.count('#line 1 "kernels_cu/simt/simt_core.cuh"') == 1
    directive = re.findall(r'#line (\d+) "kernels_cu/simt/simt_decode_gqa_packed\.cu"\n(.*)', text)[-1]
    line, first = int(directive[0]), directive[1]
    assert original[line - 1] == first


def test_the_packed_source_declares_the_pack_width_and_head_dim_the_dispatch_uses():
    text = KernelSpec("gqa_packed", 256, "bf16", "bf16").source()
    assert read_define(text, "PD_GQA") == policy.DECODE_GQA_PACK_WIDTH
    assert read_define(text, "PD_HDIM") == policy.DECODE_GQA_PACK_HEAD_DIM


@pytest.mark.parametrize("define, value", [("PD_GQA", 8), ("PD_HDIM", 128)])
def test_a_packed_source_whose_defines_disagree_with_the_policy_is_refused(define, value):
    for impl in IMPLS:
        original = read_source(SOURCE_FILES[impl, "gqa_packed"])
        edited = re.sub(rf"(#define {define}) \d+", rf"\1 {value}", original)
        assert edited != original
        with pytest.raises(KernelSourceError, match=f"{define} {value}"):
            KernelSpec("gqa_packed", 256, "bf16", "bf16", impl).source(edited)


def test_a_packed_source_without_the_define_is_refused():
    for impl in IMPLS:
        original = read_source(SOURCE_FILES[impl, "gqa_packed"])
        edited = re.sub(r"#define PD_GQA \d+", "", original)
        with pytest.raises(KernelSourceError, match="PD_GQA"):
            KernelSpec("gqa_packed", 256, "bf16", "bf16", impl).source(edited)


def test_block_sizes_and_dtype_codes_are_read_from_the_common_header():
    c = source_constants()
    assert c.threads % 32 == 0 and c.merge_threads % 32 == 0
    assert sorted(c.dtype_codes.values()) == [0, 1, 2, 3, 4]


def test_variant_names_carry_every_specialization_parameter():
    assert KernelSpec("splitk", 128, "bf16", "fp8", "simt").name == "simt_decode_splitk_qbf16_kvfp8_hd128"
    assert KernelSpec("splitk", 128, "bf16", "fp8", "mma", 2).name == "decode_splitk_qbf16_kvfp8_hd128_r16"
    assert KernelSpec("unpacked", 64, "fp16", "fp8e5m2", features={"sinks", "multi_token"}).name == \
        "decode_unpacked_qfp16_kvfp8e5m2_hd64_r8_multi_token_sinks"
    names = [v.name for v in all_specs()]
    simt = 4 * 2 * 3 + 4 * 2 * 3 + 1 * 2 * 3  # four head dims (the packed arm: 256), three KV dtypes (no e5m2)
    # four KV dtypes; unpacked and split-K at the 13 head dims, 1 or 2 row tiles (hd208 on: 1)
    mma = 2 * ((9 * 2 + 4) * 2 * 4) + 1 * 2 * 4
    featured = 3 * len(FEATURES) - 1 + 6  # each feature alone per arm (the packed arm has no multi-token), all 6 times
    mla = 2 * 2 * (3 + 1)  # 576/512: simt unpacked and split-K, two q dtypes, three KV dtypes and bf16 V in K
    simt_multi_token = simt - 1 * 2 * 3 + mla  # every simt unpacked and split-K spec again, with multi_token
    # csr and device_scales: each alone per arm; all the arm serves on every 512, 576/512 and packed spec
    simt_featured = 3 * 2 + (2 * 2 * 3 + mla + 2 * 3)
    # multi-token with csr, and with device_scales, split and unsplit: mma at 256, simt at 512 and 576/512
    # (fp8), and simt's 576/512 bf16 with V in K (csr); then SGLang's csr alone at 512 and 576/512
    pairs = 2 * 2 * 3 + 2 + 2 * 2
    assert len(names) == len(set(names)) == simt + mma + featured + mla + simt_multi_token + simt_featured + pairs
    assert KernelSpec("splitk", 576, "bf16", "fp8", "simt", v_head_dim=512).name == \
        "simt_decode_splitk_qbf16_kvfp8_hd576_v512"


def test_the_packed_variant_exists_only_at_its_head_dim():
    with pytest.raises(ValueError, match="head_dim"):
        KernelSpec("gqa_packed", 128, "bf16", "bf16")


def test_every_kernel_an_arm_launches_is_defined_in_its_source():
    for (impl, arm), filename in SOURCE_FILES.items():
        declared = parse_kernel_params(inline(filename))  # with its headers: the core declares the kernels
        assert set(KERNELS[impl, arm]) <= set(declared), (filename, KERNELS[impl, arm])


def test_the_dispatch_passes_every_parameter_every_kernel_declares():
    """The launch ABI is each kernel's parameter list, read from its source; the dispatch
    passes arguments by name (binding.ARGUMENTS, or a LayerConfig field of the same name),
    so a parameter it does not know is caught here; pointers are exactly the arrays."""
    from metrale_attn.binding import POINTER_ARGUMENTS, argument_source, kernel_abi

    for spec in all_specs():
        kernel_abi(spec)  # refuses a parameter nothing binds
        for kernel, params in kernel_params(spec).items():
            unknown = [p.name for p in params if argument_source(p.name) is None]
            assert not unknown, (kernel, unknown)
            for p in params:
                assert p.is_pointer == (p.name in POINTER_ARGUMENTS), (kernel, p)


@pytest.mark.parametrize("impl, core", [("mma", "mma_kernel.cuh"), ("simt", "simt/simt_core.cuh")])
def test_the_three_attention_kernels_of_an_implementation_take_the_one_parameter_list_of_its_core(impl, core):
    """The core spells the list once; each arm's .cu only names its kernel (PD_ENTRY) and
    its arm, and the ABI of every arm is read from that one description."""
    lists = {arm: kernel_params(KernelSpec(arm, 256, "bf16", "fp8", impl))[KERNELS[impl, arm][0]] for arm in ARMS}
    assert lists["unpacked"] == lists["splitk"] == lists["gqa_packed"]
    assert parse_kernel_params(read_source(core))["PD_ENTRY"] == lists["unpacked"]
    for arm in ARMS:  # the .cu itself declares no kernel
        assert parse_kernel_params(read_source(SOURCE_FILES[impl, arm])) == {}


def test_comments_in_a_parameter_list_are_not_read_as_parameters():
    text = 'extern "C" __global__ void k(  // a, b\n  const int* __restrict__ a, /* (x, y) */ float b) {}'
    assert [(p.name, p.ctype) for p in parse_kernel_params(text)["k"]] == [("a", "int *"), ("b", "float")]


def test_a_parameter_of_an_unknown_type_is_refused_when_the_abi_is_read():
    text = 'extern "C" __global__ void k(const int* __restrict__ a, short b) {}'
    with pytest.raises(KernelSourceError, match="short"):
        parse_kernel_params(text)


def test_the_features_section_lists_and_defines_one_struct_per_feature_of_the_config():
    """mma_features.cuh's opening table names every feature of config.FEATURES with its struct,
    and the section defines that struct with `on` the feature's define, and no other."""
    from metrale_attn import config

    text = read_source("mma_features.cuh")
    table = text[text.index("//   feature        struct"):].split("\n//\n")[0].splitlines()[1:]
    rows = [m.groups() for line in table if (m := re.match(r"//   ([a-z_0-9]+)\s+([A-Z]\w*)\s", line))]
    assert [feature for feature, _ in rows] == list(config.FEATURES)
    structs = re.findall(r"^struct (\w+) \{\n  enum \{ on = (PD_\w+) \};", text, re.MULTILINE)
    assert sorted(structs) == sorted((struct, config.feature_define(feature)) for feature, struct in rows)


def test_the_constants_the_host_and_the_kernels_both_hold_agree():
    """log2(e), ln 2 and the row tile have one home on each side (config; pd_convert.cuh and
    mma_layout.cuh), tied by the read-back; the float64 oracle keeps its own copies, equal too."""
    from metrale_attn import config, reference

    c = source_constants()
    assert (c.log2e, c.ln2, c.row_tile) == (config.LOG2E, config.LN2, config.ROW_TILE)
    assert (reference.LOG2E, reference.LN2) == (config.LOG2E, config.LN2)


def test_a_kernel_constant_that_disagrees_with_the_host_is_refused(monkeypatch):
    from metrale_attn import sources

    real = sources.read_source
    monkeypatch.setattr(sources, "read_source", lambda name: real(name).replace(
        "#define PD_LOG2E 1.4426950408889634", "#define PD_LOG2E 1.44269504"))
    with pytest.raises(KernelSourceError, match="PD_LOG2E .*config.LOG2E"):
        source_constants.__wrapped__()


def test_the_cpu_shim_emulates_the_shared_memory_of_every_target():
    """The shim's limit (module.py, and runtime/internal.h's kMaxShared, one value) holds the
    largest target's shared memory per block, the default of a spec built without a target."""
    import cuda_on_cpu.module
    from metrale_attn.tiling import SMEM_LIMIT_BYTES

    header = (pathlib.Path(cuda_on_cpu.module.__file__).parent / "runtime" / "internal.h").read_text()
    (k_max_shared,) = re.findall(r"constexpr size_t kMaxShared = (\d+) \* 1024;", header)
    assert int(k_max_shared) * 1024 == cuda_on_cpu.module.MAX_SHARED_BYTES
    assert SMEM_LIMIT_BYTES == max(t.smem_per_block for t in TARGETS.values()) <= cuda_on_cpu.module.MAX_SHARED_BYTES


def test_sources_follow_the_shared_dialect():
    for path in source_names():
        text = read_source(path)
        includes = re.findall(r'#\s*include\s*[<"]([^>"]+)', text)
        assert all(name.endswith(".cuh") for name in includes), (path, includes)
        assert not re.search(r"\bINFINITY\b|\batomic\w*\s*\(", text), path


def test_ci_compiles_every_targets_architecture():
    """b300 (sm_103) and gb10 (sm_121) once got no CI-compiled binary: CI compiled sm_90/100/120."""
    assert {t.arch for t in TARGETS.values()} <= set(ARCHES)


def test_the_host_sizes_the_shared_memory_exactly_as_the_core_carves_it():
    """mma_layout.cuh static_asserts SMEM_BYTES == PD_SMEM_BYTES; a compile of a spec
    with a wrong PD_SMEM_BYTES must fail there."""
    from metrale_attn.backends.cupy_backend import nvrtc_compile

    v = KernelSpec("unpacked", 64, "bf16", "bf16")
    wrong = type("Wrong", (), {"name": v.name, "source": v.source, "kernels": v.kernels,
                               "defines": lambda self: dict(v.defines(), PD_SMEM_BYTES=v.shared_bytes + 16)})()
    with pytest.raises(RuntimeError, match="sized the dynamic shared memory differently"):
        nvrtc_compile(wrong, "sm_90")


nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC (cupy) is not installed")


@needs_nvrtc
@pytest.mark.parametrize("spec, arch", arch_matrix())
def test_every_variant_compiles_through_nvrtc_with_no_stack_frame_and_no_spills(spec, arch):
    """No stack frame means every register array is indexed by constants and nothing spilled."""
    cubin, log = nvrtc_build(spec, arch)
    assert len(cubin) > 1000
    frames = spill_frames(log)
    assert len(frames) == len(spec.kernels), log
    assert all(f == ("0", "0", "0") for f in frames), log


@needs_nvrtc
@pytest.mark.parametrize("spec", spec_matrix())
def test_k_and_v_rows_are_read_with_vector_loads_and_nothing_touches_local_memory(spec):
    ptx = nvrtc_ptx(spec)
    assert not re.search(r"\b(ld|st)\.local\b", ptx)
    if spec.impl == "mma":  # K/V through 16-byte async copies, tensor cores, hardware fp8 conversion
        for instruction in ("cp.async.cg.shared.global", "ldmatrix.sync.aligned.m8n8.x4.trans", "movmatrix",
                            "mma.sync.aligned.m16n8k16"):
            assert instruction in ptx, instruction
        assert ("cvt.rn.f16x2.e4m3x2" in ptx) == (spec.kv_dtype == "fp8")
        return
    # simt: 16-byte loads everywhere but the packed fp8 kernel, which reads 8 bytes per
    # thread so that its 6 q vectors and 6 accumulators stay in registers.
    vector = "v2" if (spec.arm, spec.kv_dtype) == ("gqa_packed", "fp8") else "v4"
    assert re.search(rf"ld\.global\.nc\.{vector}\.u32", ptx)


@needs_nvrtc
def test_the_gpu_build_keeps_fp32_denormals_and_is_the_one_ci_compiles(monkeypatch, tmp_path):
    """CuPy's RawModule would append -ftz=true; the backend compiles its own cubin instead."""
    from metrale_attn.backends import cupy_backend

    _, options = cupy_backend.nvrtc_program(KernelSpec("splitk", 128, "bf16", "fp8"))
    assert "-ftz=false" in options and not any("ftz=true" in o or "fast_math" in o for o in options)
    monkeypatch.setenv("METRALE_ATTN_CACHE_DIR", str(tmp_path))
    calls = []
    real = cupy_backend.compile_cubin
    monkeypatch.setattr(cupy_backend, "compile_cubin", lambda v, a: calls.append(a) or real(v, a))
    first = cupy_backend.cubin_path(KernelSpec("unpacked", 64, "fp16", "fp8"), "sm_90")
    again = cupy_backend.cubin_path(KernelSpec("unpacked", 64, "fp16", "fp8"), "sm_90")
    assert first == again and calls == ["sm_90"]
    assert pathlib.Path(first).read_bytes()[:4] == b"\x7fELF"


def test_plans_launch_exactly_the_kernels_their_arm_compiles():
    from metrale_attn.cli import MODELS
    from metrale_attn.plan import make_plan
    from metrale_attn.targets import get_target, resolve_target_policy

    from support.problems import layer_config

    for options in (dict(splitk="4"), dict(splitk="off"), dict(splitk="off", gqa_pack=True)):
        target_policy = resolve_target_policy(get_target("hopper"), environ={}, **options)
        for impl in IMPLS:
            plan = make_plan(layer_config(target_policy, MODELS["qwen3.8-27b"], max_batch=2, impl=impl), 2)
            assert tuple(g.kernel for g in plan.launches) == KernelSpec(plan.arm, 256, "bf16", "bf16", impl).kernels
