"""The GPU proof-and-benchmark harness of metrale-attn, with the static SASS model below it (``model``):
a package of its own beside the library.

It imports ``metrale_attn``; nothing in ``metrale_attn`` imports it. How a call is timed (``timing``), the
data a timed configuration runs on (``data``), the copy bandwidth and the SDPA and FlashInfer peers live
in ``metrale_attn.check``, the library's own ``metrale-attn check``, and are imported from there. It is not installed with
the library: run its modules from the repository root, ``python -m benchmarks.<module>``
(``gpu_check.sh`` does, and puts the root on ``PYTHONPATH`` for what they start). Its modules,
lowest first; a module imports only modules of lower rows
(``benchmarks/tests/test_benchmarks_layering.py``):

- ``model``: the static SASS model, a subpackage below every module here (it imports none of them;
  ``model/README.md``); ``predictions`` and ``model_assumptions`` are what the harness reads of it
- ``schedule``: the GPU check's steps in order, their caps and expected times, and the device session they fit
- ``steps``: the verdicts of ``gpu_check.sh``'s steps and its exit code
- ``environment``: the environment probe and the device-to-device copy bandwidth (every ratio's ceiling,
  measured by ``metrale_attn.check.bandwidth``)
- ``impls``: the kernel implementations measured, and building one with the mma self-test's verdict
- ``decode_loop_check``: the end-to-end step, ``examples/decode_loop.py`` on the device
- ``model_probes``: one CTA's tile and fixed cost, and the fp8 conversion's rate, measured (what the models disagree on)
- ``pdl_check``: the split-K merge launched as a programmatic dependent and plainly, side by side
- ``host_overhead``: microseconds of Python per ``DecodeAttention.run``, kernels stubbed
- ``cubin_identity``: a fixed sample of specs' cubins and their hashes, to show that a source edit
  moved no instruction (no GPU needed)
- ``baselines``: PyTorch SDPA, FlexAttention and FlashInfer on the same data; FlashInfer's JIT prewarm
- ``sweep_plan``: what the sweep runs and in which order (tiers, profiles, slots)
- ``l2_probe``: ncu's L2 and DRAM counters on one small configuration per arm and implementation
- ``sanitize_cases``: one small checked decode per arm and implementation, for compute-sanitizer
- ``report``: a sweep's result as targets, markdown, plots and files
- ``sweep``: the sweep's job loop (data, check before timing, bytes, rows, budget, checkpoints)
- ``summary``: ``summary.md`` and the short table ``gpu_check.sh`` prints last

Beside them: ``gpu_check.sh`` (the one device command), ``fetch_wheels.sh``, ``results/`` (GPU runs only),
``NOTES.md``, ``README.md`` and ``tests/`` (this package's own tests, in the default test run).
"""
