"""ci/triton_cache.py: compiled kernels packed into the files the device tool brings back, and unpacked on the next
machine; the intermediate IR left behind, and nothing written when the parts would not all come back."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args) -> str:
    return subprocess.run([sys.executable, str(ROOT / "ci" / "triton_cache.py"), *map(str, args)], check=True,
                          capture_output=True, text=True).stdout


def _cache(tmp_path: Path, cubin_bytes: int) -> Path:
    cache = tmp_path / "cache"
    (cache / "ab12").mkdir(parents=True)
    (cache / "ab12" / "k.cubin").write_bytes(os.urandom(cubin_bytes))  # incompressible: parts by size
    (cache / "ab12" / "k.json").write_text('{"name": "k"}')
    (cache / "ab12" / "__grp__k.json").write_text("{}")
    for ir in ("ttir", "ttgir", "llir", "ptx"):
        (cache / "ab12" / f"k.{ir}").write_text("ir")
    (cache / "cd34").mkdir()
    (cache / "cd34" / "launcher.so").write_bytes(b"\x7fELF")
    return cache


def test_a_cache_travels_in_parts_without_its_ir(tmp_path):
    cache, out = _cache(tmp_path, 20 << 20), tmp_path / "out"
    out.mkdir()
    (out / "qualify.log").write_text("a stage's own file")
    assert "in 2 files" in _run("pack", cache, out)
    parts = sorted(p.name for p in out.iterdir() if p.name.startswith("triton-cache-part-"))
    assert parts == ["triton-cache-part-00", "triton-cache-part-01"]
    assert all((out / p).stat().st_size <= 16 << 20 for p in parts)
    again = tmp_path / "again"
    assert "4 files carried in" in _run("unpack", out, again)
    got = sorted(str(p.relative_to(again)) for p in again.rglob("*") if p.is_file())
    assert got == ["ab12/__grp__k.json", "ab12/k.cubin", "ab12/k.json", "cd34/launcher.so"]
    assert (again / "ab12" / "k.cubin").read_bytes() == (cache / "ab12" / "k.cubin").read_bytes()


def test_no_parts_when_they_would_not_all_come_back(tmp_path):
    cache, out = _cache(tmp_path, 20 << 20), tmp_path / "out"
    out.mkdir()
    for i in range(7):  # the tool brings back eight files: one left, two needed
        (out / f"log{i}").write_text("x")
    assert "not packed" in _run("pack", cache, out)
    assert not any(p.name.startswith("triton-cache-part-") for p in out.iterdir())


def test_nothing_carried_is_a_cold_start(tmp_path):
    assert "compiling cold" in _run("unpack", tmp_path / "none", tmp_path / "cache")
    assert not (tmp_path / "cache").exists()
