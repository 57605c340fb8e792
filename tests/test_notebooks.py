"""The notebooks in ``notebooks/`` run top to bottom without an error (nbclient, kernel ``python3``).

Deselect with ``-m "not fuzz and not notebooks"``. ``python -m tests.test_notebooks [NAME ...]`` executes
them (or the ones named) and writes the outputs back into the files (how the committed outputs are made).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

# The GPU machine has no nbclient (and no network to install it): skip there, run in CI.
nbclient = pytest.importorskip("nbclient")
nbformat = pytest.importorskip("nbformat")

pytestmark = pytest.mark.notebooks

FOLDER = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = ["01_split_graphs", "02_symbolic_shapes", "03_dispatch_and_speed", "04_write_a_pass"]

# Outputs each notebook must produce (beyond running without an error): the things it is about.
EXPECTED = {
    "01_split_graphs": ["image/png", "piece_4", "-> piece_1  q: float32[s",
                        "symbolic sizes in the generated code: none", "the static Inductor variant matches",
                        "05_build_dispatch/", "split.png"],
    "02_symbolic_shapes": ["2*s", "FloorDiv", "guard:", "offset", "GuardViolation: size {s=3} contradicts",
                           "GuardViolation: range {s=6..9} ends at the size"],
    "03_dispatch_and_speed": ["DispatchPlan: 3 exact", "DispatchMiss: no compiled variant for size {n=17}",
                              "per lookup", "image/png", "shapewise static"],
    "04_write_a_pass": ["tanh_gelu.applies({'n': (5, 63)}) -> False", "<th>passes</th>",
                        ">tanh_gelu{max_tokens=4}</td>",
                        "rewritten by tanh_gelu{max_tokens=4} (its graph below)", "approximate = 'tanh'",
                        "lower{backend=aot_eager}", "every size matches eager within its tolerance",
                        "aot_eager; median of 30 calls", "tanh / exact",
                        "{q, k, v, o} -> [256, 64]",
                        "shapewise.linear_group.default(l_x_, [q_weight, k_weight, v_weight], [])",
                        "linear_group.default(h, [gate_weight, up_weight], [gate_bias, up_bias])",
                        "shapewise.decode_attention.default(reshape_2, l_k_, l_v_, l_mask_, None)",
                        "3 tokens rewritten: False",
                        "torch.ops.aten._foreach_add_.Scalar([l_layers_0_counter, l_layers_1_counter, "
                        "l_layers_2_counter], 1)", "counters: [1, 1, 1]",
                        "gemv_norm.default(l_x_, [q_weight, k_weight, v_weight], [], n1_weight, 1e-06, None)",
                        "gemv_norm.default(att, [o_weight], [], None, 0.0, l_x_)"],
}


def execute(path: Path, timeout: int = 600) -> nbformat.NotebookNode:
    """Run a notebook in a fresh ``python3`` kernel, in its own folder; raises on a cell error."""
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=timeout,
                                     resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    return nb


def output_text(nb: nbformat.NotebookNode) -> str:
    """Everything the code cells printed or displayed (text, HTML, and the mime types shown).

    A cell's stdout can reach the notebook as several stream outputs, cut wherever the kernel
    flushed (under load, between ``print``'s arguments: "GuardViolation:" | " range ..."): the
    consecutive pieces of one stream are joined as printed, not with newlines."""
    parts: list[str] = []
    for cell in nb.cells:
        stream = None
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                if stream == out.get("name") and parts:
                    parts[-1] += out.get("text", "")
                else:
                    parts.append(out.get("text", ""))
                stream = out.get("name")
                continue
            stream = None
            parts.append(out.get("text", ""))
            for mime, data in out.get("data", {}).items():
                parts.append(mime)
                if mime in ("text/plain", "text/html"):
                    parts.append(data if isinstance(data, str) else "".join(data))
            if out.get("output_type") == "error":
                parts.append("\n".join(out.get("traceback", [])))
    return "\n".join(parts)


def test_the_committed_notebooks_carry_their_outputs():
    assert sorted(p.stem for p in FOLDER.glob("*.ipynb")) == NOTEBOOKS
    for name in NOTEBOOKS:
        nb = nbformat.read(FOLDER / f"{name}.ipynb", as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert code and all(c.execution_count is not None for c in code), f"{name}: not executed"
        assert not any(o.output_type == "error" for c in code for o in c.outputs), f"{name}: committed with an error"
        text = output_text(nb)
        for expected in EXPECTED[name]:
            assert expected in text, f"{name}: committed outputs lack {expected!r}"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_executes(name):
    nb = execute(FOLDER / f"{name}.ipynb")
    text = output_text(nb)
    for expected in EXPECTED[name]:
        assert expected in text, f"{name}: output lacks {expected!r}"


def main() -> int:
    """Execute every notebook and write its outputs back into the file."""
    for name in sys.argv[1:] or NOTEBOOKS:
        path = FOLDER / f"{name}.ipynb"
        t0 = time.perf_counter()
        nb = execute(path)
        nbformat.write(nb, path)
        print(f"{path.name}: executed in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
