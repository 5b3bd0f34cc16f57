"""The static SASS model's prediction beside each measured row.

``python -m benchmarks.model.sass_model --json PATH`` (it needs no GPU: NVRTC compiles, nvdisasm
disassembles) writes a JSON list of rows, each with at least ``arm``, ``q_heads``,
``kv_heads``, ``head_dim``, ``q_dtype``, ``kv_dtype`` (``bf16``, ``fp16``,
``fp8_e4m3``), ``arch``, ``heads_per_cta``, ``instr_per_kib``,
``kib_in_flight_per_sm``, ``registers``, ``spill_bytes``, ``ceiling_pct`` and
``binding``; since 2026-12-02 the report is a dict whose ``rows`` are those rows and whose
``calls`` are the call model's predictions (``predicted_pct`` and ``binding`` of one call:
shape, dtypes, ``batch``, ``context``, on the plan's kernel; a bare list of rows is still
read). ``gpu_check.sh`` runs it on the device's CPU beside the GPU tests, and
falls back to the committed ``benchmarks/model/results/sass_model.json`` (regenerate it with
``python -m benchmarks.model.sass_model --json benchmarks/model/results/sass_model.json``).

Rows are joined by (implementation, arm, q_heads, kv_heads, head_dim, q_dtype,
kv_dtype, heads_per_cta) on the device's architecture, the implementation and heads per
CTA being what the measured plan ran (``plan.impl``, ``plan.heads_per_cta``). The report
gives an mma variant on a shape at the largest heads per CTA its group allows (up to
16), so an mma row at another ``heads_per_cta`` (the ``heads_per_cta`` sweep's, or the
plan's choice at a small batch) has no prediction. A report row without ``impl`` is a
simt row (the report named none before the mma kernels existed). A missing or
unreadable report means "no prediction", never a failure. A measured row with a batch and a
context also gets the call model's ``predicted_pct`` / ``predicted_binding`` where the report
predicted that very call (today's kernel, the same heads per CTA); ``call_ratio`` is measured
over that.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

REPORT_DEFAULT_IMPL = "simt"
"""The implementation of a report row that names none."""
FIELDS = ("instr_per_kib", "kib_in_flight_per_sm", "registers", "spill_bytes", "ceiling_pct", "binding")
CALL_FIELDS = {"predicted_pct": "predicted_pct", "predicted_binding": "binding"}
"""What a call-model row adds to a prediction (name here: name in the report)."""
KV_SPELLING = {"bf16": "bf16", "fp16": "fp16", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}


def arch_digits(arch) -> str:
    """``sm_90``, ``sm_90a``, ``90``, ``9.0`` -> ``90``."""
    text = str(arch or "")
    if re.fullmatch(r"\d+\.\d+", text):
        major, minor = text.split(".")
        return major + minor
    match = re.search(r"(\d+)", text)
    return match.group(1) if match else ""


class Predictions:
    """An index of a SASS report's rows for one architecture."""

    def __init__(self, rows: list, arch: str, source: str = "", note: str = "", calls: Optional[list] = None):
        self.arch, self.source, self.note = arch_digits(arch), source, note
        self.rows = [r for r in rows if isinstance(r, dict) and arch_digits(r.get("arch")) == self.arch]
        self.calls = [c for c in (calls or []) if isinstance(c, dict) and arch_digits(c.get("arch")) == self.arch
                      and c.get("lever", "today") == "today" and c.get("predicted_pct") is not None]
        self.total = len(rows)

    @classmethod
    def load(cls, path: Optional[str], arch: str) -> "Predictions":
        if not path:
            return cls([], arch, note="no SASS report given")
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as err:
            return cls([], arch, source=path, note=f"no prediction: SASS report unreadable ({type(err).__name__})")
        rows = data.get("rows", []) if isinstance(data, dict) else data
        calls = data.get("calls", []) if isinstance(data, dict) else []
        if not isinstance(rows, list):
            return cls([], arch, source=path, note="no prediction: SASS report is not a list of rows")
        return cls(rows, arch, source=os.path.basename(path), calls=calls if isinstance(calls, list) else [])

    def describe(self) -> dict:
        note = self.note or (f"{len(self.rows)} of {self.total} rows for sm_{self.arch}" if self.rows else
                             f"no prediction: no row for sm_{self.arch} in {self.total}")
        return {"source": self.source, "arch": f"sm_{self.arch}", "rows": len(self.rows), "note": note}

    @staticmethod
    def _key(r: dict) -> tuple:
        return (r.get("impl") or REPORT_DEFAULT_IMPL, r["arm"], int(r["q_heads"]), int(r["kv_heads"]),
                int(r["head_dim"]), KV_SPELLING.get(r["q_dtype"], r["q_dtype"]),
                KV_SPELLING.get(r["kv_dtype"], r["kv_dtype"]), int(r["heads_per_cta"]))

    def lookup(self, *, impl: str, arm: str, q_heads: int, kv_heads: int, head_dim: int, q_dtype: str,
               kv_dtype: str, heads_per_cta: int, batch: Optional[int] = None,
               context: Optional[int] = None) -> Optional[dict]:
        """The prediction for one measured spec, or None; with ``batch`` and ``context``,
        the call model's ``predicted_pct`` / ``predicted_binding`` too where the report has
        that call."""
        want = (impl, arm, int(q_heads), int(kv_heads), int(head_dim), KV_SPELLING.get(q_dtype, q_dtype),
                KV_SPELLING.get(kv_dtype, kv_dtype), int(heads_per_cta))
        found = None
        for r in self.rows:
            try:
                key = self._key(r)
            except (KeyError, TypeError, ValueError):
                continue
            if key == want:
                found = {k: r.get(k) for k in FIELDS}
                break
        call = self.lookup_call(want, batch, context) if batch is not None and context is not None else None
        if call is None:
            return found
        return {**(found or dict.fromkeys(FIELDS)), **{k: call.get(v) for k, v in CALL_FIELDS.items()}}

    def lookup_call(self, want: tuple, batch: int, context: int) -> Optional[dict]:
        for c in self.calls:
            try:
                if self._key(c) == want and (int(c["batch"]), int(c["context"])) == (int(batch), int(context)):
                    return c
            except (KeyError, TypeError, ValueError):
                continue
        return None


def ratio(measured_pct: Optional[float], prediction: Optional[dict]) -> Optional[float]:
    """Measured % of copy over the predicted ceiling % (1.0: the model was right)."""
    if measured_pct is None or not prediction:
        return None
    ceiling = prediction.get("ceiling_pct")
    try:
        return measured_pct / float(ceiling) if ceiling else None
    except (TypeError, ValueError):
        return None


def call_ratio(measured_pct: Optional[float], prediction: Optional[dict]) -> Optional[float]:
    """Measured % of copy over the call model's predicted % (1.0: the model was right)."""
    if measured_pct is None or not prediction or not prediction.get("predicted_pct"):
        return None
    try:
        return measured_pct / float(prediction["predicted_pct"])
    except (TypeError, ValueError):
        return None
