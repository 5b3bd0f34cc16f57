"""pytest's hooks and fixtures for the library's tests; the helpers they share are the
``support`` package beside this file (tests/support/), which test files import."""

from __future__ import annotations

import os
import sys

import pytest

from metrale_attn import policy

from support import builds
from support.backends import BACKENDS
from support.problems import CountingBackend


def pytest_collection_finish(session):
    """Start the NVRTC builds the selected tests will inspect (``builds.start_prebuilds``)."""
    builds.start_prebuilds(session)


@pytest.fixture(autouse=True)
def _fresh_gqa_gate():
    """The GQA gate is resolved once per process; each test starts from the environment it sets."""
    policy.gqa_pack_enabled.cache_clear()
    yield
    policy.gqa_pack_enabled.cache_clear()


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    """The backend a case runs on: ``"cpu"`` always, and ``"cupy"``, marked ``gpu`` and skipped
    without a CUDA device (support.backends); pass it to ``decoder``, and ``run_poisoned``
    moves the arrays. A test whose cases differ between the two parametrizes ``backend``
    itself (``on_backends``). The hypothesis fuzz tests take none: hypothesis refuses a
    function-scoped fixture, and a parameter would re-draw their derandomized examples."""
    return request.param


@pytest.fixture
def counting_backend() -> CountingBackend:
    """A CPU backend that records what it loads and launches (support.problems.CountingBackend);
    a test that needs two fresh ones builds them itself."""
    return CountingBackend()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that meets a sticky CUDA error (an illegal address, a launch failure) leaves its
    process's CUDA context unusable: every later test of that process would fail too. Under
    pytest-xdist the worker ends itself at once, so xdist reports this test as the one the worker
    crashed on and starts a fresh worker for the rest (the GPU check lists it)."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.excinfo is not None and os.environ.get("PYTEST_XDIST_WORKER"):
        from metrale_attn.check.worker import STICKY

        if STICKY.search(f"{call.excinfo.typename}: {call.excinfo.value}"):
            sys.stderr.write(f"{item.nodeid}: sticky CUDA error, ending this worker: {call.excinfo.value}\n")
            sys.stderr.flush()
            os._exit(3)
