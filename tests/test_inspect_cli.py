"""``shapewise inspect``: the dump folder and the summary, for the toy model and a user's factory."""

from __future__ import annotations

import torch

from shapewise import cli, inspect_cli
from shapewise.models import MLP
from tests.helpers import is_png


def make_mlp():
    """A user factory: (module, example inputs)."""
    torch.manual_seed(0)
    return MLP(dim=8, hidden=16), torch.randn(3, 8)


def make_mlp_with_options():
    """A user factory: (module, example inputs, options)."""
    torch.manual_seed(0)
    return MLP(dim=8, hidden=16), (torch.randn(3, 8),), {"sizes": [2, 3], "ranges": [(4, 16)]}


def make_nothing():
    return 42


def test_inspect_the_toy_model(tmp_path, capsys):
    out = tmp_path / "dump"
    assert inspect_cli.main(["--backend", "aot_eager", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith("shapewise inspect: ToyTransformer (built in) | backend aot_eager | sizes [1, 8]")
    assert "5 pieces (2 splitting)" in text
    for piece in ("piece_0", "piece_1", "piece_2", "piece_3", "piece_4"):
        assert f"\n{piece} " in text
    assert "DispatchPlan: 2 exact, 1 ranges" in text and "range  {n=9..64}" in text
    assert "compile report (9 variants)" in text
    assert "verify against eager: " in text and "all ok" in text
    assert "build_dispatch  {n=64}  dispatch" in text
    stages = sorted(p.name for p in out.iterdir() if p.is_dir())
    assert stages == ["00_input", "01_split", "02_analyze_shapes", "03_concretize", "04_lower", "05_build_dispatch"]
    assert (out / "pipeline.txt").read_text().splitlines()[1] == "01 split{ops=shapewise_toy::attention}"
    for i in range(5):
        assert (out / "05_build_dispatch" / f"piece_{i}.py").read_text().count("def forward(") == 1
    is_png((out / "01_split" / "split.png").read_bytes())
    assert f"dump: {out}/ (6 stages" in text


def test_inspect_through_the_shapewise_command(tmp_path, capsys):
    assert cli.main(["--help"]) == 0
    assert "inspect" in capsys.readouterr().out
    out = tmp_path / "d"
    assert cli.main(["inspect", "--model", "tests.test_inspect_cli:make_mlp", "--sizes", "1,3", "--ranges", "4,8",
                     "--backend", "eager", "--out", str(out), "--no-verify"]) == 0
    text = capsys.readouterr().out
    assert "tests.test_inspect_cli:make_mlp | backend eager | sizes [1, 3] | ranges [(4, 8)]" in text
    assert "1 pieces (0 splitting)" in text and "verify" not in text
    assert (out / "04_lower" / "piece_0.py").exists()


def test_factory_options_and_default_sizes(tmp_path, capsys):
    assert inspect_cli.main(["--model", "tests.test_inspect_cli:make_mlp_with_options", "--backend", "eager",
                             "--out", str(tmp_path / "a")]) == 0
    text = capsys.readouterr().out
    assert "sizes [2, 3] | ranges [(4, 16)]" in text and "all ok" in text
    assert "build_dispatch  {n=16}" in text  # the range's high end was checked
    # No sizes anywhere: the traced size is compiled.
    assert inspect_cli.main(["--model", "tests.test_inspect_cli:make_mlp", "--backend", "eager",
                             "--out", str(tmp_path / "b")]) == 0
    text = capsys.readouterr().out
    assert "sizes [3] | ranges []" in text and "exact  {n=3}" in text


def test_bad_model_specs_are_reported(tmp_path, capsys):
    for spec, message in [("nocolon", "package.module:factory"),
                          ("no_such_module_xyz:f", "cannot import 'no_such_module_xyz'"),
                          ("tests.test_inspect_cli:missing", "has no callable 'missing'"),
                          ("tests.test_inspect_cli:make_nothing", "must return (module, example_inputs)")]:
        assert inspect_cli.main(["--model", spec, "--out", str(tmp_path)]) == 1
        assert message in capsys.readouterr().err
    assert inspect_cli.main(["--sizes", "1,x", "--out", str(tmp_path)]) == 1
    assert "--sizes takes comma-separated ints" in capsys.readouterr().err
    assert inspect_cli.main(["--backend", "tensorrt", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shapewise inspect: error: ConfigError: unknown backend 'tensorrt'")
    assert "Traceback" not in err
    assert not any(tmp_path.iterdir())  # nothing was dumped
