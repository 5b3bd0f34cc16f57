"""The static SASS model: what a kernel spec's hot loop and one decode call cost on an H200, read off
the compiler's output with no GPU. EVERY FIGURE IS MODELLED until a GPU measures it.

Part of ``benchmarks`` and below its GPU harness: the harness imports it (``sweep`` and ``summary`` join
its predictions to measured rows, ``model_probes`` reads its assumptions); nothing here imports the
harness. Run from the repository root: ``python -m benchmarks.model.sass_model`` (README.md says how).
Its modules, lowest first; a module imports only modules of lower rows
(``benchmarks/tests/test_benchmarks_layering.py``):

- ``model_assumptions``: the model's assumption table (clocks, rates, latencies, limits, cap; each sourced)
- ``hot_loop``: what one iteration of a spec's K/V loop consumes (the model's input beside the SASS)
- ``predictions``: the model's report read back, its prediction joined to each measured row
- ``sass``: SASS as the model reads it (instructions, CFG, loops, divergence, the steady-state tile)
- ``warp_chain``: one warp's per-tile dependency chain (a scoreboard) and the levers' SASS rewrites
- ``call_model``: one decode call on 132 SMs from the plan's grid: time, % of copy, the binding limit
- ``sass_model``: the model's report (the command): per-spec rows, the decisive calls, the levers

Beside them: ``results/sass_model.json`` (the committed report, generated), ``README.md`` and
``tests/`` (in the default test run).
"""
