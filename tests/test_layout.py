"""The package keeps its layers (the import-linter contracts in pyproject.toml, lazy imports
included), has no import cycle, and no module over 500 lines."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "shapewise"
MAX_LINES = 500


def test_no_module_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in sorted(PACKAGE.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them along a concept): {long}"


def test_the_layer_contracts_hold():
    lint = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    assert lint is not None, "import-linter is not installed: pip install -e .[dev] (make install does)"
    out = subprocess.run([lint, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_no_import_cycle_between_modules():
    import grimp  # import-linter's graph builder (the dev extra)
    import networkx as nx
    graph = grimp.build_graph("shapewise")
    g = nx.DiGraph()
    for m in graph.modules:
        g.add_node(m)
        for t in graph.find_modules_directly_imported_by(m):
            g.add_edge(m, t)
    # The package's own __init__ re-exports every layer; a cycle through it is no cycle of layers.
    g.remove_node("shapewise")
    cycles = list(nx.simple_cycles(g))
    assert not cycles, f"import cycles: {cycles[:5]}"


def test_every_public_name_is_there():
    import importlib
    import pkgutil

    import shapewise

    missing = []
    for info in pkgutil.walk_packages(shapewise.__path__, "shapewise."):
        if info.name.endswith("__main__"):
            continue
        module = importlib.import_module(info.name)
        missing += [f"{info.name}.{n}" for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
    assert not missing, f"names in __all__ that the module lacks: {missing}"


def test_importing_shapewise_imports_no_library_module_and_registers_no_op_of_it():
    # Every layer below the library, imported; then the library's names one by one.
    code = (
        "import sys, torch, shapewise as sw\n"
        "import shapewise.module, shapewise.generate, shapewise.cli, shapewise.instruments\n"
        "ops = lambda: hasattr(torch.ops.shapewise, 'gemv')\n"
        "print(ops(), sorted(m for m in sys.modules if m.startswith('shapewise.library')))\n"
        "sw.library.OverlapAllReduce\n"
        "print(ops())\n"
        "sw.library.DecodeGemv\n"
        "print(ops())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split("\n")[:3] == ["False []", "False", "True"], out.stdout
