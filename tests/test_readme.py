"""The README's example and its printed plans are real: they run, and they match the code."""

import linecache
import pathlib
import re
import shlex

import ml_dtypes
import numpy as np
import pytest

from metrale_attn import reference, tolerance
from metrale_attn.cli import main

from support.optional import import_torch

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()


PYTHON_BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


def _as_numpy(x):
    """A torch tensor (CPU) as NumPy, bf16 and fp8 included; anything else as it is."""
    if type(x).__module__.startswith("torch"):
        from metrale_attn.torch_op import to_numpy

        return to_numpy(x.cpu())
    return x


def test_the_readme_shows_the_torch_usage_first_then_numpy():
    assert len(PYTHON_BLOCKS) == 2
    assert "torch.ops.metrale_attn.paged_decode" in PYTHON_BLOCKS[0] and "torch.compile" in PYTHON_BLOCKS[0]
    assert "import numpy" in PYTHON_BLOCKS[1]


@pytest.mark.parametrize("index", range(len(PYTHON_BLOCKS)), ids=["torch", "numpy"][:len(PYTHON_BLOCKS)])
def test_each_python_example_runs_and_its_output_matches_the_reference(index):
    code = PYTHON_BLOCKS[index]
    if "import torch" in code:
        import_torch()
        import torch

        torch._dynamo.reset()
    name = f"<README.md python block {index + 1}>"  # torch.compile reads the source back: give it this block's
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    scope: dict = {}
    exec(compile(code, name, "exec"), scope)
    q, k, v, bt, lens, out = (_as_numpy(scope[n]) for n in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "out"))
    if k.dtype == np.uint8:  # fp8 bits, as the examples store them
        k, v = (a.view(ml_dtypes.float8_e4m3fn) for a in (k, v))
    ref = reference.paged_decode(q, k, v, bt, lens, k_scale=0.02, v_scale=0.02)
    tolerance.assert_close_to_reference(out, ref, v_absmax=reference.max_abs_v_read(v, bt, lens, v_scale=0.02))
    if "lse" in scope:
        assert np.isfinite(_as_numpy(scope["lse"])).all()


def test_every_plan_printed_in_the_readme_is_what_the_cli_prints_today(capsys):
    blocks = re.findall(r"\$ metrale-attn (plan [^\n]*)\n(.*?)(?=\n\$ |\n```)", README, re.S)
    assert len(blocks) >= 2
    for command, printed in blocks:
        assert main(shlex.split(command)) == 0
        assert capsys.readouterr().out.strip() == printed.strip(), command
