"""The API fuzz (``tests/api_fuzz.py``: every constructor and run argument, valid and invalid,
every feature combination, the torch op and merge_states) in a child process, so that a crash
is a failed test naming its case: a fixed-seed sample in the default run, a long profile in
the slow run. Each case ends in a ValueError/TypeError before any launch, or in outputs within
the bar of the float64 reference."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).with_name("api_fuzz.py")


def _fuzz(*args: str, timeout: float) -> str:
    done = subprocess.run([sys.executable, str(FUZZ), *args], capture_output=True, text=True, timeout=timeout)
    cases = [line for line in done.stdout.splitlines() if line.startswith(("decode ", "merge "))]
    assert done.returncode == 0, (f"the fuzz exited {done.returncode} (negative: killed by a signal, a crash) in "
                                  f"or after the case\n{cases[-1] if cases else '(none)'}\n{done.stderr[-4000:]}"
                                  f"{done.stdout[-4000:]}")
    assert "FUZZ OK" in done.stdout
    return done.stdout


def test_any_arguments_are_refused_before_a_launch_or_meet_the_bar_on_a_fixed_sample():
    out = _fuzz("--examples", "100", "--seed", "1", timeout=600)
    tally = out.strip().splitlines()[-1]
    for outcome in ("'ok'", "'refused'", "'refused at construction'", "'merge ok'", "'merge refused'"):
        assert outcome in tally, tally  # the sample reaches every outcome


@pytest.mark.slow
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_any_arguments_are_refused_before_a_launch_or_meet_the_bar_on_the_long_profile(seed):
    _fuzz("--examples", "400", "--seed", str(seed), "--profile", "wide", timeout=3600)
