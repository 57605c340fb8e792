"""Every causal-LM architecture transformers ships (``benchmarks/sweep_architectures.py``), one
test each: the compiled forward and ``compile_generate`` give eager's answers from a fixed number
of traces, or refuse with a ``ShapewiseError`` that names the cause. Deselected by default (about
20 s an architecture on a CPU core): ``pytest -m sweep tests/models/test_sweep.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from sweep_architectures import architectures, fixed_traces, run_one  # noqa: E402

pytestmark = pytest.mark.sweep


@pytest.mark.parametrize("arch", architectures())
def test_architecture(arch):
    row = run_one(arch, ("forward", "generate"), timeout=600, mem_gb=8)
    print(f"{arch}: forward={row['forward']} generate={row['generate']} traces={row.get('traces')} "
          f"{row.get('error') or ''}")
    if row["forward"] in ("build-fails", "eager-fails"):
        pytest.skip(f"does not run eagerly with a tiny config: {row['error']}")
    refused = (row.get("error") or "").startswith("shapewise.")
    assert row["forward"] == "ok" or (row["forward"] == "error" and refused), row
    if row["generate"] == "eager-fails":
        return
    assert fixed_traces(row) or (row["generate"] == "error" and refused), row
