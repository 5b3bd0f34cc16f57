"""The static SASS model's prediction beside each measured row.

``python -m benchmarks.sass_model --json PATH`` (it needs no GPU: NVRTC compiles, nvdisasm
disassembles) writes a JSON list of rows, each with at least ``arm``, ``q_heads``,
``kv_heads``, ``head_dim``, ``q_dtype``, ``kv_dtype`` (``bf16``, ``fp16``,
``fp8_e4m3``), ``arch``, ``heads_per_cta``, ``instr_per_kib``,
``kib_in_flight_per_sm``, ``registers``, ``spill_bytes``, ``ceiling_pct`` and
``binding``. ``gpu_check.sh`` runs it on the device's CPU beside the GPU tests, and
falls back to the committed ``benchmarks/results/sass_model.json`` (regenerate it with
``python -m benchmarks.sass_model --json benchmarks/results/sass_model.json``).

Rows are joined by (implementation, arm, q_heads, kv_heads, head_dim, q_dtype,
kv_dtype, heads_per_cta) on the device's architecture, the implementation and heads per
CTA being what the measured plan ran (``plan.impl``, ``plan.heads_per_cta``). The report
gives an mma spec on a shape at the largest heads per CTA its group allows (up to
16), so an mma row at another ``heads_per_cta`` (the ``heads_per_cta`` sweep's, or the
plan's choice at a small batch) has no prediction. A report row without ``impl`` is a
simt row (the report named none before the mma kernels existed). A missing or
unreadable report means "no prediction", never a failure.
"""

from __future__ import annotations

import json
import os
import re
from typing import Optional

REPORT_DEFAULT_IMPL = "simt"
"""The implementation of a report row that names none."""
FIELDS = ("instr_per_kib", "kib_in_flight_per_sm", "registers", "spill_bytes", "ceiling_pct", "binding")
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

    def __init__(self, rows: list, arch: str, source: str = "", note: str = ""):
        self.arch, self.source, self.note = arch_digits(arch), source, note
        self.rows = [r for r in rows if isinstance(r, dict) and arch_digits(r.get("arch")) == self.arch]
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
        if not isinstance(rows, list):
            return cls([], arch, source=path, note="no prediction: SASS report is not a list of rows")
        return cls(rows, arch, source=os.path.basename(path))

    def describe(self) -> dict:
        note = self.note or (f"{len(self.rows)} of {self.total} rows for sm_{self.arch}" if self.rows else
                             f"no prediction: no row for sm_{self.arch} in {self.total}")
        return {"source": self.source, "arch": f"sm_{self.arch}", "rows": len(self.rows), "note": note}

    def lookup(self, *, impl: str, arm: str, q_heads: int, kv_heads: int, head_dim: int, q_dtype: str,
               kv_dtype: str, heads_per_cta: int) -> Optional[dict]:
        """The prediction for one measured spec, or None."""
        want = (impl, arm, int(q_heads), int(kv_heads), int(head_dim), KV_SPELLING.get(q_dtype, q_dtype),
                KV_SPELLING.get(kv_dtype, kv_dtype), int(heads_per_cta))
        for r in self.rows:
            try:
                key = (r.get("impl") or REPORT_DEFAULT_IMPL, r["arm"], int(r["q_heads"]), int(r["kv_heads"]),
                       int(r["head_dim"]), KV_SPELLING.get(r["q_dtype"], r["q_dtype"]),
                       KV_SPELLING.get(r["kv_dtype"], r["kv_dtype"]), int(r["heads_per_cta"]))
            except (KeyError, TypeError, ValueError):
                continue
            if key == want:
                return {k: r.get(k) for k in FIELDS}
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
