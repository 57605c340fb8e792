"""The examples and the training benchmark run (tiny sizes, CPU) and do what they say."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from shapewise._compat import dynamo_unique_graphs

ROOT = Path(__file__).resolve().parents[1]


def load_script(folder: str, name: str) -> ModuleType:
    """Import ``<folder>/<name>.py`` once per process (scripts register custom ops)."""
    module_name = f"shapewise_{folder}_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, ROOT / folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]


@pytest.mark.inductor
def test_train_packed_tiny_loss_goes_down(capsys):
    result = load_script("examples", "train_packed").main(["--tiny"])
    out = capsys.readouterr().out
    assert result["traces"] == 1 and dynamo_unique_graphs() == 1
    assert result["max_rel_diff"] < 1e-4  # step 0: compiled loss and grads vs eager (float32)
    assert result["loss_end"] < result["loss_start"] - 0.5, (result["loss_start"], result["loss_end"])
    buckets = result["buckets"]
    assert 1 <= len(buckets) <= 3 and buckets == sorted(buckets)
    assert set(result["steps_per_bucket"]) <= set(buckets)
    for b in buckets:  # the per-bucket compile report is printed
        assert f"{{tokens={b}}}" in out
    assert "shapewise.plan_sizes" in out


def test_train_packed_on_a_transformers_llama(capsys):
    pytest.importorskip("transformers")
    result = load_script("examples", "train_packed").main(["--tiny", "--model", "hf-llama", "--backend", "aot_eager"])
    assert result["traces"] == 1
    assert result["max_rel_diff"] < 1e-4  # step 0: compiled loss and grads vs eager (float32)
    assert result["loss_end"] < result["loss_start"] - 0.5, (result["loss_start"], result["loss_end"])
    assert set(result["steps_per_bucket"]) <= set(result["buckets"])
    assert "shapewise.plan_sizes" in capsys.readouterr().out


@pytest.mark.inductor
def test_bench_training_smoke(tmp_path):
    # The GPU benchmark's code path on CPU at the smallest size: it runs, checks, writes its files.
    bench = load_script("benchmarks", "bench_training")
    with torch._dynamo.config.patch(recompile_limit=8):
        result = bench.main(["--device", "cpu", "--tiny", "--layers", "1", "--tokens", "16,32", "--warmup", "0",
                             "--steps", "1", "--contenders", "eager,shapewise", "--warm-cache", "--out", str(tmp_path)])
    assert result["ok"], result
    by_name = {r["contender"]: r for r in result["contenders"]}
    assert set(by_name) == {"eager", "shapewise"}
    sw_row = by_name["shapewise"]
    assert sw_row["dynamo_graphs"] == 1 and sw_row["recompiles_while_timing"] == 0
    assert sw_row["shapewise"]["traces"] == 1
    assert all(s["ok"] and s["step_ms"] > 0 for s in sw_row["sizes"].values())
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["env"]["torch"] == torch.__version__
    table = (tmp_path / "results.md").read_text()
    assert "| shapewise | 32 |" in table and torch.__version__ in table


@pytest.mark.inductor
def test_graph_passes_example_rewrites_decode_sizes_only(capsys):
    from shapewise._compat import no_inductor_caches

    with no_inductor_caches():  # the post-grad pass must run to be seen (a cache hit skips it)
        result = load_script("examples", "graph_passes").main([])
    assert result["traces"] == 1
    for n, err in result["errors"].items():
        assert err < (1e-3 if n <= 4 else 1e-5), (n, err)  # tanh GELU's approximation error at decode only
    tanh = {r["key"] for r in result["rows"] if "tanh_gelu" in r["passes"]}
    assert tanh == {"{n=1}", "{n=2}", "{n=4}"}
    assert sum(result["inductor_replacements"]) >= 1  # Inductor's matcher found x * 2 in the last piece
    assert "tanh_gelu{max_tokens=4}, twice_is_add" in capsys.readouterr().out


def test_cold_generates_token_check_tells_a_tie_from_a_wrong_token():
    # The device script's check of bf16 tokens: random weights in bf16 make near-ties that greedy decoding
    # may break either way, and a flag that only said "differ" could not tell those from a bug.
    from benchmarks.device.cold_generate import token_check

    logits = (torch.tensor([[1.0, 3.0, 2.99]]), torch.tensor([[0.0, 5.0, 1.0]]))
    assert token_check(torch.tensor([1, 1]), torch.tensor([1, 1]), logits) == "equal"
    assert token_check(torch.tensor([2, 1]), torch.tensor([1, 1]), logits).startswith("near-tie at new token 0")
    assert token_check(torch.tensor([0, 1]), torch.tensor([1, 1]), logits).startswith("WRONG at new token 0")
    assert token_check(torch.tensor([1, 2]), torch.tensor([1, 1]), logits).startswith("WRONG at new token 1")
