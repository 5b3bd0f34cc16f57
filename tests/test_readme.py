"""The README's example and its printed plans are real: they run, and they match the code."""

import pathlib
import re
import shlex

import numpy as np

from metrale_attn import reference, tolerance
from metrale_attn.cli import main

README = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()


def test_the_python_example_runs_and_its_output_matches_the_reference():
    code = re.search(r"```python\n(.*?)```", README, re.S).group(1)
    scope: dict = {}
    exec(compile(code, "README.md", "exec"), scope)
    q, k, v, bt, lens, out = (scope[n] for n in ("q", "k_cache", "v_cache", "block_tables", "seq_lens", "out"))
    ref = reference.paged_decode(q, k, v, bt, lens, k_scale=0.02, v_scale=0.02)
    tolerance.assert_close_to_reference(out, ref, v_absmax=0.02 * 448)
    assert np.isfinite(scope["lse"]).all()


def test_every_plan_printed_in_the_readme_is_what_the_cli_prints_today(capsys):
    blocks = re.findall(r"\$ metrale-attn (plan [^\n]*)\n(.*?)(?=\n\$ |\n```)", README, re.S)
    assert len(blocks) >= 2
    for command, printed in blocks:
        assert main(shlex.split(command)) == 0
        assert capsys.readouterr().out.strip() == printed.strip(), command
