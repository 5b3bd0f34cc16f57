"""What the package says under the ``metrale_attn`` logger, and where it goes: each compile
(spec, where, seconds, cache hit or miss: DEBUG), a cold compile before and after it and while
it runs long (INFO), each layer's plan once (INFO), each fallback (simt, a cache directory it
cannot use, a cache another NVRTC filled: WARNING); ``METRALE_ATTN_LOG_LEVEL`` and its stderr
handler, and the records' way into vLLM's handlers (``logs.follow_vllm``)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import types
import warnings

import pytest

from cuda_on_cpu import build
from metrale_attn import attention, logs
from metrale_attn.backends import cubin
from metrale_attn.backends.cpu_backend import CpuBackend

from support.problems import decoder, problem

P = problem(seed=31, seq_lens=(5, 40), num_q_heads=4, num_kv_heads=2)


def stand_in(name: str):
    """What ``CpuBackend.load`` reads of a spec (its name, source and defines), for a one-line kernel."""
    source = f'extern "C" __global__ void {name}(float* out) {{ out[threadIdx.x] = 1.0f; }}\n'
    return types.SimpleNamespace(name=name, source=lambda: source, defines=dict)


def layer_lines(caplog) -> list[tuple[int, str]]:
    return [(r.levelno, r.getMessage()) for r in caplog.records
            if r.name == "metrale_attn.attention" and r.getMessage().startswith("DecodeAttention ")]


def test_a_layer_configuration_says_its_impl_and_plans_at_info_once_and_at_debug_after(monkeypatch, caplog):
    monkeypatch.setattr(attention, "_LAYERS_SAID", set())  # as in a new process
    with caplog.at_level(logging.INFO, logger="metrale_attn"):
        decoder(P, max_batch=4)
        decoder(P, max_batch=4)  # a second layer like it: said once
    ((level, text),) = layer_lines(caplog)
    assert level == logging.INFO
    assert text.startswith("DecodeAttention 4/2/64, page 16, q bf16, KV bf16 NHD, target defaults (hopper")
    assert "impl mma, max_batch 4: batch 1: splitk, 16 split(s), 1 head(s)/CTA (auto: ceil(2 x 132 SMs / 4 q " in text
    assert "; batch 4: splitk, 16 split(s), 2 head(s)/CTA (auto: " in text and "kernels" not in text
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="metrale_attn"):
        decoder(P, max_batch=4)
        decoder(P, max_batch=8)  # another configuration: INFO again
    (first, again) = layer_lines(caplog)
    assert first[0] == logging.DEBUG and "; kernels decode_splitk_" in first[1]
    assert again[0] == logging.INFO and "max_batch 8" in again[1]


def test_a_layers_features_are_named_in_its_line(monkeypatch, caplog):
    monkeypatch.setattr(attention, "_LAYERS_SAID", set())
    with caplog.at_level(logging.INFO, logger="metrale_attn"):
        decoder(P, max_batch=2, window_left=7, logits_soft_cap=30.0)
    ((_, text),) = layer_lines(caplog)
    assert ", features soft_cap+window, target defaults" in text, text


class ColdBuilds(CpuBackend):
    """The CPU backend as it is with a cold cache: every spec is a miss (its builds are the
    warm cache's, so the test costs no compiler run); ``delay`` seconds of building."""

    def __init__(self, delay: float = 0.0):
        super().__init__()
        self.delay = delay

    def uncached(self, specs):
        return list(specs)

    def load_many(self, specs):
        time.sleep(self.delay)
        return super().load_many(specs)


def test_a_cold_compile_is_said_before_it_starts_and_when_it_ends_with_its_time(caplog):
    with caplog.at_level(logging.INFO, logger="metrale_attn"):
        decoder(P, backend=ColdBuilds())
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "kernel(s)" in r.getMessage()]
    assert len(infos) == 2, infos
    assert infos[0].startswith("compiling 1 kernel(s) for sm_90 (cpu backend; not in the cache ")
    assert infos[0].endswith("): decode_splitk_qbf16_kvbf16_hd64_r8")
    assert infos[1].startswith("compiled 1 kernel(s) for sm_90 in ") and infos[1].endswith(" s")


def test_a_warm_construction_says_nothing_of_compiling(caplog):
    decoder(P)  # warm: this process has the kernels now
    with caplog.at_level(logging.INFO, logger="metrale_attn"):
        decoder(P)
    assert not [r for r in caplog.records if "kernel(s)" in r.getMessage()]


def test_the_cpu_backend_says_which_specs_a_load_would_compile(tmp_path, monkeypatch):
    monkeypatch.setenv("METRALE_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_MEMO", {})
    spec = stand_in("probed")
    assert CpuBackend().uncached([spec]) == [spec]
    assert not list(tmp_path.rglob("*.so"))  # asking builds nothing
    CpuBackend().load(spec)
    assert CpuBackend().uncached([spec]) == []
    monkeypatch.setattr(build, "_MEMO", {})  # a new process: the disk cache has it
    assert CpuBackend().uncached([spec]) == []


def test_each_cpu_compile_logs_its_variant_seconds_and_whether_the_cache_had_it(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("METRALE_ATTN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(build, "_MEMO", {})
    with caplog.at_level(logging.DEBUG, logger="metrale_attn"):
        CpuBackend().load(stand_in("logged"))
        monkeypatch.setattr(build, "_MEMO", {})  # a new process: only the disk cache is left
        CpuBackend().load(stand_in("logged"))
    lines = [r.getMessage() for r in caplog.records if r.name == "metrale_attn.backends.cpu_backend"]
    assert len(lines) == 2
    assert lines[0].startswith("compiled logged for the CPU backend") and "cache miss" in lines[0]
    assert " s (cache miss" in lines[0] and str(tmp_path) in lines[0]
    assert lines[1].startswith("loaded logged for the CPU backend from the cache (hit")


def test_a_compile_still_running_after_the_threshold_says_so_while_it_runs(monkeypatch, caplog):
    monkeypatch.setattr(attention, "SLOW_COMPILE_S", 0.05)
    with caplog.at_level(logging.INFO, logger="metrale_attn"):
        decoder(P, backend=ColdBuilds(delay=0.3))
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO and "kernel(s)" in r.getMessage()]
    assert infos[0].startswith("compiling 1 kernel(s) for sm_90")
    assert infos[1].startswith("still compiling 1 kernel(s) for sm_90 (0 s so far): decode_splitk_")
    assert infos[-1].startswith("compiled 1 kernel(s) for sm_90 in 0.")


def test_a_slow_load_of_cached_kernels_is_said_as_loading_not_compiling(monkeypatch, caplog):
    class SlowLoads(CpuBackend):
        def load_many(self, specs):
            time.sleep(0.3)
            return super().load_many(specs)

    decoder(P)  # warm
    monkeypatch.setattr(attention, "SLOW_COMPILE_S", 0.05)
    with caplog.at_level(logging.INFO, logger="metrale_attn"):
        decoder(P, backend=SlowLoads())
    infos = [r.getMessage() for r in caplog.records if "kernel(s)" in r.getMessage()]
    assert infos[0].startswith("still loading 1 kernel(s) for sm_90")
    assert infos[-1].startswith("done loading 1 kernel(s) for sm_90 in 0.")


def test_a_fallback_to_simt_is_logged_as_well_as_warned(caplog):
    with caplog.at_level(logging.WARNING, logger="metrale_attn"), pytest.warns(RuntimeWarning):
        decoder(problem(seed=31, seq_lens=(5, 40), num_q_heads=4, num_kv_heads=2, kv_dtype="fp8"), target="a10")
    (record,) = [r for r in caplog.records if r.name == "metrale_attn.attention"]
    assert record.levelno == logging.WARNING and "a10 (sm_86) lacks" in record.getMessage()
    assert "using impl='simt'" in record.getMessage()


def test_a_cache_directory_that_cannot_be_written_is_logged_as_well_as_warned(tmp_path, monkeypatch, caplog):
    root = tmp_path / "a-file"
    root.write_text("")
    monkeypatch.setenv("METRALE_ATTN_CACHE_DIR", str(root))
    for name, value in (("_MEMO", {}), ("_FALLBACK_DIRS", {}), ("_FALLBACK_WARNED", False)):
        monkeypatch.setattr(build, name, value)
    with caplog.at_level(logging.WARNING, logger="metrale_attn"), pytest.warns(build.CacheFallbackWarning):
        CpuBackend().load(stand_in("unwritable_logged"))
    (record,) = [r for r in caplog.records if r.name == "metrale_attn.backends.cpu_backend"]
    assert f"cannot write the CUDA-on-CPU kernel cache {root}" in record.getMessage()


# -- METRALE_ATTN_LOG_LEVEL -------------------------------------------------------------------


@pytest.fixture
def our_logger():
    """The ``metrale_attn`` logger (and the ``vllm`` one), put back as they were after the test."""
    saved = {}
    for name in (logs.LOGGER_NAME, logs.VLLM_LOGGER_NAME):
        lg = logging.getLogger(name)
        saved[name] = (lg.level, list(lg.handlers), lg.propagate)
        lg.handlers = []
    yield logging.getLogger(logs.LOGGER_NAME)
    for name, (level, handlers, propagate) in saved.items():
        lg = logging.getLogger(name)
        lg.setLevel(level)
        lg.handlers = handlers
        lg.propagate = propagate


@pytest.mark.parametrize("raw, level", [("DEBUG", 10), ("info", 20), (" Warning ", 30), ("error", 40),
                                        ("CRITICAL", 50), ("15", 15), ("0", 0), ("", None), (None, None)])
def test_the_log_level_variable_takes_a_level_name_in_any_case_or_a_number(raw, level):
    assert logs.parse_level(raw) == level


@pytest.mark.parametrize("raw", ["verbose", "-1", "2.5", "INFO,DEBUG", "１０"])
def test_any_other_log_level_is_an_error_naming_the_variable(raw):
    with pytest.raises(ValueError, match=f"METRALE_ATTN_LOG_LEVEL must be one of DEBUG, INFO, WARNING, ERROR, "
                                         f"CRITICAL .any case. or a non-negative integer, got '{raw}'"):
        logs.parse_level(raw)


def test_without_the_variable_no_handler_is_attached_and_the_level_is_left_alone(our_logger):
    assert logs.configure({}) is None
    assert our_logger.handlers == [] and our_logger.level == logging.NOTSET


def test_the_variable_sets_the_level_and_attaches_one_stderr_handler(our_logger, monkeypatch, capsys):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # an application that configured no logging
    assert logs.configure({"METRALE_ATTN_LOG_LEVEL": "info"}) == logging.INFO
    assert logs.configure({"METRALE_ATTN_LOG_LEVEL": "INFO"}) == logging.INFO  # again: still one handler
    (handler,) = our_logger.handlers
    assert isinstance(handler, logs.StderrUnlessConfigured) and our_logger.level == logging.INFO
    logging.getLogger("metrale_attn.attention").info("compiling %d kernel(s)", 2)
    logging.getLogger("metrale_attn.attention").debug("not shown")
    assert capsys.readouterr().err == "metrale_attn: INFO compiling 2 kernel(s)\n"


def test_the_stderr_handler_stands_down_when_the_application_configured_logging(our_logger, monkeypatch, capsys):
    seen = []
    application = logging.Handler()
    application.emit = seen.append
    monkeypatch.setattr(logging.getLogger(), "handlers", [application])
    logs.configure({"METRALE_ATTN_LOG_LEVEL": "DEBUG"})
    logging.getLogger("metrale_attn.cache").info("waiting for another process")
    assert capsys.readouterr().err == ""  # not twice: the application's handler has it
    assert [r.getMessage() for r in seen] == ["waiting for another process"]


def run_python(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != logs.ENV_LOG_LEVEL}
    return subprocess.run([sys.executable, "-c", code], env={**environ, **env}, capture_output=True, text=True,
                          timeout=120)


def test_an_operator_sees_info_records_on_stderr_with_the_variable_and_nothing_without_it():
    code = "import metrale_attn, logging; logging.getLogger('metrale_attn.attention').info('compiling 3 kernel(s)')"
    shown = run_python(code, METRALE_ATTN_LOG_LEVEL="INFO")
    assert shown.returncode == 0 and shown.stderr == "metrale_attn: INFO compiling 3 kernel(s)\n" and not shown.stdout
    silent = run_python(code)
    assert silent.returncode == 0 and silent.stderr == "" and silent.stdout == ""


def test_a_bad_log_level_stops_the_import_with_the_variables_name():
    done = run_python("import metrale_attn", METRALE_ATTN_LOG_LEVEL="loud")
    assert done.returncode != 0
    assert "ValueError: METRALE_ATTN_LOG_LEVEL must be one of DEBUG, INFO" in done.stderr and "got 'loud'" in done.stderr


# -- under vLLM ---------------------------------------------------------------------------------


def fake_vllm_logging(level: int) -> list:
    """What vLLM's logging configuration leaves (``logger.py``'s ``DEFAULT_LOGGING_CONFIG``): one
    handler on the ``vllm`` logger at ``VLLM_LOGGING_LEVEL``, the logger at that level, not
    propagating. Returns the list the handler collects records into."""
    seen = []
    handler = logging.Handler(level)
    handler.emit = seen.append
    vllm = logging.getLogger("vllm")
    vllm.handlers = [handler]
    vllm.setLevel(level)
    vllm.propagate = False
    return seen


def test_under_vllm_our_records_go_through_vllms_handler_at_its_level(our_logger, monkeypatch, capsys):
    monkeypatch.setattr(logging.getLogger(), "handlers", [])
    logs.configure({"METRALE_ATTN_LOG_LEVEL": "INFO"})  # our stderr handler first: replaced, never doubled
    seen = fake_vllm_logging(logging.DEBUG)
    assert logs.follow_vllm({}) is True
    assert logs.follow_vllm({}) is True  # vLLM loads plugins more than once: still one forwarding handler
    assert [type(h) for h in our_logger.handlers] == [logs.ToVllm] and our_logger.propagate is False
    assert our_logger.level == logging.DEBUG  # vLLM's, since METRALE_ATTN_LOG_LEVEL is not in this environment
    logging.getLogger("metrale_attn.attention").debug("DecodeAttention 8/1/128 ...")
    assert [(r.name, r.getMessage()) for r in seen] == [("metrale_attn.attention", "DecodeAttention 8/1/128 ...")]
    assert capsys.readouterr().err == ""


def test_under_vllm_our_variable_overrides_vllms_level_and_vllms_handler_keeps_its_own(our_logger):
    seen = fake_vllm_logging(logging.INFO)
    logs.follow_vllm({"METRALE_ATTN_LOG_LEVEL": "WARNING"})
    assert our_logger.level == logging.WARNING
    logging.getLogger("metrale_attn.attention").info("not asked for")
    logging.getLogger("metrale_attn.attention").warning("falling back to simt")
    assert [r.getMessage() for r in seen] == ["falling back to simt"]
    seen.clear()
    logs.follow_vllm({"METRALE_ATTN_LOG_LEVEL": "DEBUG"})
    logging.getLogger("metrale_attn.attention").debug("below vLLM's handler's level")
    assert seen == []


def test_the_forwarding_follows_the_handlers_vllm_has_when_it_logs(our_logger):
    fake_vllm_logging(logging.INFO)
    logs.follow_vllm({})
    later = fake_vllm_logging(logging.INFO)  # vLLM configured its logging again (dictConfig)
    logging.getLogger("metrale_attn.cache").info("waiting for another process")
    assert [r.getMessage() for r in later] == ["waiting for another process"]


def test_with_vllms_logging_configuration_off_nothing_is_wired(our_logger):
    logging.getLogger("vllm").handlers = []  # VLLM_CONFIGURE_LOGGING=0: vLLM attached nothing
    assert logs.follow_vllm({}) is False
    assert our_logger.handlers == [] and our_logger.propagate is True and our_logger.level == logging.NOTSET


# -- a cache another NVRTC filled -------------------------------------------------------------


def cached_by(directory, name: str, arch: str, nvrtc) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    meta = {"size": 1, "sha256": "0" * 64} if nvrtc is None else {"arch": arch, "nvrtc": nvrtc, "size": 1,
                                                                     "sha256": "0" * 64}
    (directory / f"{name}_{arch}_{'a' * 20}.cubin.json").write_text(json.dumps(meta))


def test_a_cache_only_another_nvrtc_filled_is_warned_about_once_naming_both_versions(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(cubin, "_nvrtc_checked", set())
    cached_by(tmp_path, "decode_splitk_a", "sm_90", "12.9")
    cached_by(tmp_path, "decode_splitk_b", "sm_90", "12.8")
    cached_by(tmp_path, "decode_splitk_c", "sm_90", None)  # written before sidecars said: no opinion
    with caplog.at_level(logging.WARNING, logger="metrale_attn"), pytest.warns(RuntimeWarning) as warned:
        assert cubin.warn_other_nvrtc(tmp_path, "sm_90", (13, 0)) == {"12.9", "12.8"}
    (message,) = [str(w.message) for w in warned]
    assert f"the kernel cache {tmp_path} holds sm_90 cubins built by NVRTC 12.8, 12.9 and none by this " \
           "environment's NVRTC 13.0" in message and "compiled again" in message and "precompile" in message
    assert [r.getMessage() for r in caplog.records if r.name == "metrale_attn.backends.cubin"] == [message]
    assert cubin.warn_other_nvrtc(tmp_path, "sm_90", (13, 0)) == set()  # once per process per directory


def test_no_warning_when_this_nvrtc_built_entries_too(tmp_path, monkeypatch):
    monkeypatch.setattr(cubin, "_nvrtc_checked", set())
    cached_by(tmp_path, "decode_splitk_a", "sm_90", "12.9")
    cached_by(tmp_path, "decode_splitk_b", "sm_90", "13.0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cubin.warn_other_nvrtc(tmp_path, "sm_90", (13, 0)) == set()


def test_no_warning_when_the_other_nvrtcs_entries_are_for_another_arch(tmp_path, monkeypatch):
    monkeypatch.setattr(cubin, "_nvrtc_checked", set())
    cached_by(tmp_path, "decode_splitk_a", "sm_100", "12.9")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert cubin.warn_other_nvrtc(tmp_path, "sm_90", (13, 0)) == set()


def test_an_empty_or_missing_cache_says_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(cubin, "_nvrtc_checked", set())
    assert cubin.warn_other_nvrtc(tmp_path / "none", "sm_90", (13, 0)) == set()
    assert cubin.warn_other_nvrtc(tmp_path, "sm_90", (13, 0)) == set()


def test_a_cached_cubins_sidecar_records_what_built_it(tmp_path):
    entry = tmp_path / "k_sm_90_x.cubin"
    cubin.write_cached(entry, b"\x7fELF", {"arch": "sm_90", "nvrtc": "12.9"})
    meta = json.loads((tmp_path / "k_sm_90_x.cubin.json").read_text())
    assert meta == {"arch": "sm_90", "nvrtc": "12.9", "size": 4, "sha256": meta["sha256"]}
