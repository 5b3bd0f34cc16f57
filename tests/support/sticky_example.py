"""Run only by ``test_check.py``'s test of the sticky-error hook (``tests/conftest.py``): the first test
fails the way CuPy fails on an illegal address, the second passes. Not a test file of the suite."""


class CUDARuntimeError(RuntimeError):
    pass


def test_meets_a_sticky_cuda_error():
    raise CUDARuntimeError("cudaErrorIllegalAddress: an illegal memory access was encountered")


def test_runs_on_a_fresh_worker():
    pass
