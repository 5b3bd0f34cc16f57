"""The optional dependencies of some tests, torch, vLLM and SGLang: imported, or the test skipped where
they are absent; in CI (``.ci/run`` sets the variables) a missing one is a failure instead."""

from __future__ import annotations

import os

import pytest

REQUIRE_TORCH = "METRALE_ATTN_REQUIRE_TORCH"
"""Set (to 1) by ``.ci/run``: there a missing torch fails the torch tests instead of skipping them."""


def import_torch():
    """``torch``, or a skip where it is not installed; where ``METRALE_ATTN_REQUIRE_TORCH``
    is set (CI), a missing torch is an error, so the torch tests can never be skipped there."""
    if os.environ.get(REQUIRE_TORCH, "").strip() not in ("", "0"):
        import torch

        return torch
    return pytest.importorskip("torch")


REQUIRE_VLLM = "METRALE_ATTN_REQUIRE_VLLM"
"""Set (to 1) by ``.ci/run`` in its vLLM venv: there a missing vLLM fails the vLLM tests."""


def import_vllm():
    """``vllm``, or a skip where it is not installed (the main venv); where
    ``METRALE_ATTN_REQUIRE_VLLM`` is set (CI's vLLM venv), a missing vLLM is an error."""
    if os.environ.get(REQUIRE_VLLM, "").strip() not in ("", "0"):
        import vllm

        return vllm
    return pytest.importorskip("vllm")


REQUIRE_SGLANG = "METRALE_ATTN_REQUIRE_SGLANG"
"""Set (to 1) where SGLang is meant to be installed (its own venv): a missing SGLang fails the tests."""


def import_sglang():
    """``sglang``, or a skip where it is not installed (the main venv); where
    ``METRALE_ATTN_REQUIRE_SGLANG`` is set, a missing SGLang is an error."""
    if os.environ.get(REQUIRE_SGLANG, "").strip() not in ("", "0"):
        import sglang

        return sglang
    return pytest.importorskip("sglang")
