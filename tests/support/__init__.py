"""What the library's tests share, as a package of plain modules (tests/ is on ``sys.path``
under pytest, as conftest.py's folder): a test file imports ``from support.problems import
...``; conftest.py holds only pytest's hooks and fixtures.

- ``support.problems``: a decode problem, the ``DecodeAttention`` that serves it, a poisoned
  run on any backend, the check against the float64 reference, the arms' options, and the
  backend that counts what it loads and launches.
- ``support.backends``: the backends a case runs on (the CPU backend always, CuPy marked
  ``gpu`` and skipped without a CUDA device) and moving arrays to a backend and back.
- ``support.builds``: the kernel specs by architecture that the NVRTC build tests compile,
  each build done once per session (and started early in worker processes).
- ``support.ptx_toys``: the toy kernels of tests/toy_kernels/ptx_*.cu on either backend, and
  NumPy models of the PTX instructions they exercise.
- ``support.optional``: torch and vLLM, or a skip where they are absent (a failure in CI).

Nothing here imports conftest.py, and no test file does either.
"""
