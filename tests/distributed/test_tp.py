"""Tensor parallel on torch.distributed: two processes on gloo (CPU) each compile their shard of
``TPLlama`` once, answer as the single-process model at every size, and divide the compiles
through a shared cache folder (keys do not depend on the rank). NCCL on two GPUs is marked gpu."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_world(tmp_path: Path, *flags: str, world: int = 2) -> list[dict]:
    # A gloo world runs on the CPU: on a GPU machine transformers' tp_plan would place rank r on
    # cuda:r ("invalid device ordinal" on the one-GPU H200), so the GPUs are hidden from it.
    env = os.environ if "--nccl" in flags else {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    for attempt in (1, 2):
        out = tmp_path / f"out{attempt}"
        proc = subprocess.run([sys.executable, "-m", "tests.distributed.tp_worker", "--world", str(world),
                               "--out", str(out), *flags], cwd=ROOT, capture_output=True, text=True, timeout=600,
                              env=env)
        # Once, in a clean-clone CI run (2 cores, the whole suite before it), rank 0 died by SIGABRT
        # ("terminate called without an active exception", no Python traceback); not reproduced in
        # three runs alone, cause not found. A death by a signal gets one more run from nothing;
        # any Python error fails at once.
        if proc.returncode == 0 or "terminated with signal" not in proc.stderr or attempt == 2:
            break
        warnings.warn(f"tp_worker: a rank died by a signal; running the world again: {proc.stderr[-500:]}",
                      stacklevel=2)
        if "--cache" in flags:  # the run again compiles from nothing, as the first did
            shutil.rmtree(flags[flags.index("--cache") + 1], ignore_errors=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.inductor
def test_two_ranks_answer_as_one_and_divide_the_compiles(tmp_path):
    # Three layers: the middle layer's piece is the first's, so it reuses that piece's artifacts.
    # OverlapAllReduce chunks the row-parallel layers at 8 rows (one run covers both: CI time).
    ranks = run_world(tmp_path, "--cache", str(tmp_path / "cache"), "--layers", "3", "--overlap")
    for r, result in enumerate(ranks):
        assert result["traces"] == 1, f"rank {r}"
        assert result["max_rel_error"] < 1e-5, f"rank {r}: {result['max_rel_error']}"
        chunked = {row["key"] for row in result["rows"] if "overlap_all_reduce" in row["passes"]}
        assert chunked == {"{n=8}"}, f"rank {r}: {chunked}"
    # Inductor kept the pipeline (two slices of 4 rows): both first all-reduces issued, then
    # slice 0 waits for its own and issues its second before slice 1 waits for its first.
    orders = [o for result in ranks for o in result["collective_order"].values() if o]
    assert orders and all(o == "RRWRWRWW" for o in orders), orders
    # The same content keys on both ranks: the weights are inputs, the group a name both share.
    artifacts = [{(row["piece"], row["key"]): row["artifact"] for row in result["rows"]} for result in ranks]
    assert artifacts[0] == artifacts[1]
    # Each distinct artifact compiled once, by one rank; the other loaded it, and says who compiled it.
    compiled = [{row["artifact"] for row in result["rows"] if row["source"] == "compiled"} for result in ranks]
    assert not compiled[0] & compiled[1]
    assert compiled[0] | compiled[1] == set(artifacts[0].values())
    # Each rank starts with its half; one that finishes early may take keys from the other's.
    assert all(compiled), "the work is divided, not repeated"
    # A row names the rank that compiled its artifact: a reused one too (it named its own rank).
    compiled_by = {a: r for r, mine in enumerate(compiled) for a in mine}
    for r, result in enumerate(ranks):
        assert any(row["source"] == "reused" for row in result["rows"]), f"rank {r}"
        for row in result["rows"]:
            assert row["rank"] == compiled_by[row["artifact"]], (r, row)


def test_split_at_the_collectives_too(tmp_path):
    ranks = run_world(tmp_path, "--backend", "aot_eager", "--split-collectives")
    for result in ranks:
        assert result["traces"] == 1 and result["max_rel_error"] < 1e-5
        assert len({row["piece"] for row in result["rows"]}) == 7  # 2 layers: 2 attentions + 4 all-reduces split


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs two GPUs")
def test_two_gpus_on_nccl(tmp_path):
    ranks = run_world(tmp_path, "--nccl", "--cache", str(tmp_path / "cache"))
    for result in ranks:
        assert result["traces"] == 1 and result["max_rel_error"] < 1e-4


def _known_refusal(name: str, message: str) -> bool:
    """transformers 5.17 (the GPU machine's) shards Qwen3's q/k norms with a module backward hook,
    which Dynamo traces only with compiled autograd: shapewise refuses it, naming the cause. 5.2x
    has no such hook."""
    import transformers
    from packaging.version import Version

    return name == "qwen3" and Version(transformers.__version__) < Version("5.20") and \
        "Module-level backwards hooks require compiled autograd" in message


def test_transformers_tp_plan_dtensor_weights(tmp_path):
    # A transformers Llama loaded with tp_plan="auto": its weights are DTensors (graph inputs
    # rebuilt around fake local shards for each compile), and DTensor's rules compile each rank's
    # vocab offset into the embedding and head pieces. Those pieces must not be shared between
    # ranks (shared, rank 1 ran rank 0's embedding: relative error 0.83); a piece whose DTensor
    # weights are only taken to_local is the same code on both and is compiled once.
    ranks = run_world(tmp_path, "--hf", "--hf-zoo", "phi3", "--cache", str(tmp_path / "cache"))
    for r, result in enumerate(ranks):
        check_zoo(r, result["zoo"], {"phi3"})  # (fused qkv and gate-up: test_tp_plans_of_the_zoo has the others)
        assert result["traces"] == 2, f"rank {r}: one trace for one token, one for the rest"
        assert result["dtensor_weights"] == 16, f"rank {r}: {result['dtensor_weights']}"  # embedding, 7 x 2, head
        # Past Dynamo's guards (the DeviceMesh a DTensor hook holds is an input, taken by identity).
        assert result["direct_info"] == "trace 1 (n=1): on; trace 2: on", result["direct_info"]
        assert result["max_rel_error"] < 1e-5, f"rank {r}: {result['max_rel_error']}"
        assert result["train_rel_error"] < 1e-5, f"rank {r}: loss or gradient {result['train_rel_error']}"
        # Every variant called with DTensor weights builds its arguments past the wrappers (pieces
        # that take a size too: refusing ints sent those back through them, +30% on the H200).
        assert len(result["flattened"]) >= 6 and all(result["flattened"]), result["flattened"]
        assert "stride=(64, 1) DTensor" in result["shown"] and "DeviceMesh(" in result["shown"], result["shown"]
        # Serving with generate(): the unsharded model's tokens, decode past Dynamo's DTensor guards
        # (7 decode steps, the first arms the direct call).
        gen = result["generate"]
        assert gen["same_tokens"] and gen["max_rel_error"] < 1e-5, (r, gen)
        assert gen["direct_calls"] == 6 and gen["direct_info"].endswith("trace 2 (seq=1): on"), (r, gen)
    artifacts = [{(row["trace"], row["piece"], row["key"]): row["artifact"] for row in result["rows"]}
                 for result in ranks]
    assert artifacts[0].keys() == artifacts[1].keys()
    shared = {k for k in artifacts[0] if artifacts[0][k] == artifacts[1][k]}
    assert {piece for _, piece, _ in shared} == {"piece_2"}, shared  # between the two attentions
    assert {piece for _, piece, _ in set(artifacts[0]) - shared} == {"piece_0", "piece_4"}
    compiled = [{row["artifact"] for row in result["rows"] if row["source"] == "compiled"} for result in ranks]
    assert not compiled[0] & compiled[1] & {artifacts[0][k] for k in shared}, "a shared piece compiled twice"


def check_zoo(rank: int, zoo: dict, names: set[str]) -> None:
    """The zoo's decoders that have a tp_plan (aot_eager): right answers at 1 and 4 tokens, sharded
    weights, direct calls on for both traces."""
    assert set(zoo) == names
    for name, z in zoo.items():
        if "refused" in z and _known_refusal(name, z["refused"]):
            continue
        assert z["dtensor_weights"] >= 10 and z["traces"] == 2, (rank, name, z)
        assert z["max_rel_error"] < 1e-5 and z["direct_info"] == "trace 1 (n=1): on; trace 2: on", (rank, name, z)


@pytest.mark.sweep
def test_tp_plans_of_the_zoo(tmp_path):
    # Every zoo decoder of tp_worker.ZOO_TP (CI runs phi3's in the test above): pytest -m sweep tests/distributed
    from tests.distributed.tp_worker import ZOO_TP

    for r, result in enumerate(run_world(tmp_path, "--hf", "--hf-zoo", "all", "--zoo-only")):
        check_zoo(r, result["zoo"], set(ZOO_TP))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2])
def test_transformers_dtensor_weights_on_gpus(tmp_path, world):
    # DTensor weights under CUDA graphs (full at one token, piecewise above) and direct calls,
    # bf16 on NCCL. One GPU: torch's own tensor-parallel plan on a mesh of one (transformers
    # leaves a world of one unsharded); two: transformers' tp_plan.
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    ranks = run_world(tmp_path, "--hf", "--nccl", "--cache", str(tmp_path / "cache"), world=world)
    for r, result in enumerate(ranks):
        assert result["dtensor_weights"] >= 14, f"rank {r}: {result['dtensor_weights']}"
        assert result["traces"] == 2 and result["max_rel_error"] < 2e-2, (r, result["max_rel_error"])
        assert result["train_rel_error"] < 2e-2, (r, result["train_rel_error"])
        assert result["direct_info"] == "trace 1 (n=1): on; trace 2: on", result["direct_info"]
        gen = result["generate"]  # bf16: the tokens can part where logits are near-tied
        assert gen["max_rel_error"] < 2e-2 and gen["direct_calls"] == 6, (r, gen)
