"""The artifact cache: file format and recovery (no compiles), then real Inductor on CPU:
dedupe counts, a warm start in a fresh process, corrupted files, models that differ only by a
bias, and three processes sharing one cache folder."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import shapewise as sw
from shapewise.lower import cache as swcache
from shapewise.lower.cache import MAGIC, ArtifactCache, CacheCorrupt, decode, encode, resolve_cache
from shapewise.models import ATTENTION_OP, MLP, ToyTransformer
from tests.helpers import assert_same

ROOT = Path(__file__).resolve().parents[2]
KEY = "ab" * 32


def sources(rows) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[r["source"]] = out.get(r["source"], 0) + 1
    return out


def file_of(cache_dir: Path, artifact: str) -> Path:
    (path,) = Path(cache_dir).glob(f"v*/*/{artifact}*.swa")
    return path


def rewrite_header(path: Path, **changes) -> None:
    """Rewrite a cache file's JSON header (sections untouched)."""
    data = path.read_bytes()
    (n,) = struct.unpack(">Q", data[len(MAGIC):len(MAGIC) + 8])
    start = len(MAGIC) + 8
    header = {**json.loads(data[start:start + n]), **changes}
    head = json.dumps(header, sort_keys=True).encode()
    path.write_bytes(MAGIC + struct.pack(">Q", len(head)) + head + data[start + n:])


def run_child(*args: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tests.lower.cache_child", *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def child_result(proc: subprocess.Popen, timeout: float = 240) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, f"child failed ({proc.returncode}):\n{err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


# -- the file format, no compiles ---------------------------------------------------------------

def test_encode_decode_and_every_kind_of_damage():
    sections = {"inductor": b"artifact bytes", "kernel:ab/cab.main.so": b"\x7fELF..."}
    data = encode(KEY, sections, {"piece": "piece_0"})
    entry = decode(data, KEY)
    assert entry.sections == sections and entry.kernels == [("ab/cab.main.so", b"\x7fELF...")]
    damaged = {
        "truncated": data[: len(data) - 5],
        "truncated (header)": data[: len(MAGIC) + 12],
        "bad magic": b"garbage" * 20,
        "empty": b"",
        "checksum": data[:-1] + bytes([data[-1] ^ 1]),
        "trailing": data + b"x",
    }
    for what, bad in damaged.items():
        with pytest.raises(CacheCorrupt, match=what.split(" ")[0]):
            decode(bad, KEY)
    with pytest.raises(CacheCorrupt, match="not the key"):
        decode(data, "cd" * 32)


def test_foreign_build_is_refused(tmp_path):
    cache = ArtifactCache(tmp_path)
    path = cache.write(KEY, {"inductor": b"x"}, {})
    rewrite_header(path, torch_git="0" * 40)
    with pytest.raises(CacheCorrupt, match="another build"):
        cache.read(KEY)


def test_a_key_another_process_is_compiling_is_left_to_it_without_waiting(tmp_path):
    # What ranks dividing the compiles rely on: wait=False never blocks on a held lock (None at
    # once, nothing compiled), and compiles when the lock is free.
    cache = ArtifactCache(tmp_path)
    compiled = []
    holder = cache.lock(KEY)  # another file handle: as another process holds it
    holder.acquire()
    try:
        assert cache.compile_or_load(KEY, lambda: compiled.append("here"), {}, wait=False) is None
    finally:
        holder.release()
    assert compiled == []
    fn, source = cache.compile_or_load(KEY, lambda: compiled.append("here") or (lambda: 1), {}, wait=False)
    assert source == "compiled" and compiled == ["here"]


def test_writes_are_atomic_and_leave_nothing_half_written(tmp_path, monkeypatch):
    cache = ArtifactCache(tmp_path)

    def crash(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(swcache.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        cache.write(KEY, {"inductor": b"x" * 1000}, {})
    monkeypatch.undo()
    assert cache.keys() == [] and not list(tmp_path.rglob("*.tmp"))
    cache.write(KEY, {"inductor": b"x"}, {})
    assert cache.keys() == [KEY] and not list(tmp_path.rglob("*.tmp"))


def test_where_the_cache_lives(tmp_path, monkeypatch):
    monkeypatch.setenv("SHAPEWISE_CACHE_DIR", str(tmp_path / "here"))
    assert resolve_cache(None).root == tmp_path / "here"
    assert resolve_cache(str(tmp_path / "there")).root == tmp_path / "there"
    assert resolve_cache(False) is None
    monkeypatch.setenv("SHAPEWISE_CACHE", "0")
    assert resolve_cache(None) is None
    assert resolve_cache(True).root == tmp_path / "here"
    monkeypatch.delenv("SHAPEWISE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert swcache.default_cache_dir() == tmp_path / "xdg" / "shapewise"
    with pytest.raises(sw.ConfigError, match="cache must be"):
        resolve_cache(42)
    with pytest.raises(sw.ConfigError, match="hex digest"):
        ArtifactCache(tmp_path).path("../../etc/passwd")


def test_only_inductor_artifacts_are_cached(tmp_path):
    model = ToyTransformer(layers=2)
    fast = sw.compile(model, sizes=[2], splitting_ops=[ATTENTION_OP], backend="aot_eager", cache=str(tmp_path))
    fast(torch.randint(0, 64, (2,)))
    assert ArtifactCache(tmp_path).keys() == []


# -- real Inductor ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def toy_cache(tmp_path_factory):
    """An 8-layer ToyTransformer compiled at sizes 2 and 4 into a fresh cache folder."""
    torch._dynamo.reset()
    folder = tmp_path_factory.mktemp("toy-cache")
    model = ToyTransformer(layers=8).eval()
    fast = sw.compile(model, sizes=[2, 4], splitting_ops=[ATTENTION_OP], backend="inductor", cache=str(folder))
    with torch.no_grad():
        for n in (2, 4):
            ids = torch.randint(0, 64, (n,))
            assert_same(fast(ids), model(ids), f"n={n}")
    return folder, fast.report()


@pytest.mark.inductor
def test_eight_layers_compile_no_more_artifacts_than_two(toy_cache):
    folder, report8 = toy_cache
    assert sources(report8) == {"compiled": 3 * 2, "reused": 6 * 2}  # first, middle, last piece x 2 sizes
    model = ToyTransformer(layers=2).eval()
    fast = sw.compile(model, sizes=[2, 4], splitting_ops=[ATTENTION_OP], backend="inductor", cache=str(folder))
    with torch.no_grad():
        for n in (2, 4):
            ids = torch.randint(0, 64, (n,))
            assert_same(fast(ids), model(ids), f"n={n}")
    report2 = fast.report()
    artifacts2 = {r["artifact"] for r in report2}
    assert len(artifacts2) == sources(report8)["compiled"], "2 layers need as many artifacts as 8"
    assert sources(report2) == {"cache": 6}  # the same pieces: loaded from what the 8-layer model saved
    assert artifacts2 == {r["artifact"] for r in report8}


@pytest.mark.inductor
def test_warm_start_in_a_fresh_process_compiles_nothing(toy_cache, tmp_path):
    folder, report8 = toy_cache
    env = {**os.environ, "SHAPEWISE_CACHE_DIR": str(folder), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    got = child_result(run_child("--model", "toy", "--layers", "8", "--sizes", "2,4", env=env))
    assert got["ok"]
    assert "compiled" not in got["sources"], got["sources"]
    assert sources({"source": s} for s in got["sources"]) == {"cache": 6, "reused": 12}
    assert got["artifacts"] == [r["artifact"] for r in report8]


@pytest.mark.inductor
def test_corrupt_files_are_reported_recompiled_and_replaced(toy_cache, tmp_path, caplog):
    folder = tmp_path / "cache"
    shutil.copytree(toy_cache[0], folder)
    first = list(dict.fromkeys(r["artifact"] for r in toy_cache[1]))[:4]
    truncated, garbage, foreign, foreign_inductor = (file_of(folder, a) for a in first)
    truncated.write_bytes(truncated.read_bytes()[:1000])
    garbage.write_bytes(os.urandom(4096))
    rewrite_header(foreign, torch="1.0.0")
    key = foreign_inductor.name[: -len(".swa")]
    entry = decode(foreign_inductor.read_bytes(), key)
    from torch._inductor.codecache import torch_key  # the torch build, as Inductor stamps it

    stamp = torch_key()
    assert stamp in entry.sections["inductor"]
    entry.sections["inductor"] = entry.sections["inductor"].replace(stamp, bytes(b ^ 0xFF for b in stamp))
    foreign_inductor.write_bytes(encode(key, entry.sections, entry.header["info"]))

    model = ToyTransformer(layers=2).eval()
    fast = sw.compile(model, sizes=[2, 4], splitting_ops=[ATTENTION_OP], backend="inductor", cache=str(folder))
    with caplog.at_level(logging.WARNING, logger="shapewise"), torch.no_grad():
        for n in (2, 4):
            ids = torch.randint(0, 64, (n,))
            assert_same(fast(ids), model(ids), f"n={n}")
    warnings = [m for m in caplog.messages if "is unusable" in m]
    for path, why in ((truncated, "truncated"), (garbage, "bad magic"), (foreign, "another build"),
                      (foreign_inductor, "Inductor could not load it")):
        assert any(str(path) in m and why in m for m in warnings), (why, warnings)
    rows = fast.report()
    assert sources(rows) == {"compiled": 4, "cache": 2}
    cache = ArtifactCache(folder)
    for a in first:  # replaced by good files
        p = file_of(folder, a)
        assert decode(p.read_bytes(), p.name[: -len(".swa")]).header["torch"] == torch.__version__
    assert len(cache.keys()) == 6 and not list(folder.rglob("*.tmp"))


@pytest.mark.inductor
def test_models_that_differ_only_by_a_bias_never_share(tmp_path):
    folder = str(tmp_path)
    reports = {}
    for bias in (True, False):
        torch.manual_seed(0)
        model = MLP(bias=bias).eval()
        fast = sw.compile(model, sizes=[4], backend="inductor", cache=folder)
        x = torch.randn(4, 32)
        with torch.no_grad():
            assert_same(fast(x), model(x), f"bias={bias}")
        reports[bias] = fast.report()
    assert sources(reports[False]) == {"compiled": 1}, "the bias-free MLP must not load the biased one's kernels"
    assert reports[True][0]["artifact"] != reports[False][0]["artifact"]
    assert len(ArtifactCache(folder).keys()) == 2


@pytest.mark.inductor
def test_three_processes_on_one_cache_folder(tmp_path):
    env = {**os.environ, "SHAPEWISE_CACHE_DIR": str(tmp_path / "shared")}
    procs = [run_child("--model", "mlp", "--sizes", "2,3", env=env) for _ in range(3)]
    results = [child_result(p) for p in procs]
    assert all(r["ok"] for r in results)
    for r in results:
        assert set(r["sources"]) <= {"compiled", "cache"}
    # The key's lock makes one process compile each artifact; the others wait and load it.
    assert sum(r["sources"].count("compiled") for r in results) == 2
    cache = ArtifactCache(tmp_path / "shared")
    assert len(cache.keys()) == 2 and all(cache.read(k) is not None for k in cache.keys())
    assert not list((tmp_path / "shared").rglob("*.tmp"))
