"""examples/ runs in CI: the decode loop on the CPU backend, eager and compiled."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from support.optional import import_torch

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv", [[], ["--compile", "aot_eager", "--steps", "6"]], ids=["eager", "compiled"])
def test_the_decode_loop_example_runs_and_every_attention_output_meets_the_bar(argv, capsys):
    torch = import_torch()
    torch._dynamo.reset()
    summary = _load("decode_loop").run(argv)
    assert summary["attention_calls_checked"] == summary["steps"] * summary["layers"]
    assert summary["worst_ulp"] <= 1 and summary["tokens"] > 0
    if not argv:  # the default run sees sequences join, grow across pages, finish and free their pages
        assert summary["finished"] >= 2 and summary["sequences"] > summary["finished"]
    assert "attention outputs checked" in capsys.readouterr().out
