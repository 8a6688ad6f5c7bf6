"""ci/triton_cache.py: compiled kernels packed into the files the device tool brings back, and unpacked on the next
machine; the intermediate IR left behind, and nothing written when the parts would not all come back."""

import importlib.util
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def carry(monkeypatch):
    spec = importlib.util.spec_from_file_location("triton_cache", ROOT / "ci" / "triton_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "PART_BYTES", 64 << 10)  # parts of 64 KB: the tool's 16 MiB, scaled down
    return module


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


def test_a_cache_travels_in_parts_without_its_ir(tmp_path, carry, capsys):
    cache, out = _cache(tmp_path, 100 << 10), tmp_path / "out"
    out.mkdir()
    (out / "qualify.log").write_text("a stage's own file")
    carry.pack(cache, out)
    assert "in 2 files" in capsys.readouterr().out
    parts = sorted(p.name for p in out.iterdir() if p.name.startswith(carry.PREFIX))
    assert parts == [carry.PREFIX + "00", carry.PREFIX + "01"]
    assert all((out / p).stat().st_size <= carry.PART_BYTES for p in parts)
    again = tmp_path / "again"
    carry.unpack(out, again)
    assert "4 files carried in" in capsys.readouterr().out
    got = sorted(str(p.relative_to(again)) for p in again.rglob("*") if p.is_file())
    assert got == ["ab12/__grp__k.json", "ab12/k.cubin", "ab12/k.json", "cd34/launcher.so"]
    assert (again / "ab12" / "k.cubin").read_bytes() == (cache / "ab12" / "k.cubin").read_bytes()


def test_a_stage_with_many_files_has_them_bundled_to_make_room(tmp_path, carry, capsys):
    import tarfile

    cache, out = _cache(tmp_path, 100 << 10), tmp_path / "out"
    out.mkdir()
    for i in range(7):  # the tool brings back eight files: one left, two needed
        (out / f"log{i}").write_text(f"line {i}\n" * 100)
    carry.pack(cache, out)
    assert "7 files bundled" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([carry.PREFIX + "00", carry.PREFIX + "01", carry.BUNDLE])
    with tarfile.open(out / carry.BUNDLE) as tar:
        assert sorted(tar.getnames()) == [f"log{i}" for i in range(7)]
        assert tar.extractfile("log3").read().decode() == "line 3\n" * 100


def test_few_files_stay_as_they_are(tmp_path, carry):
    cache, out = _cache(tmp_path, 100 << 10), tmp_path / "out"
    out.mkdir()
    for i in range(6):  # six and two parts: all eight come back
        (out / f"log{i}").write_text("x")
    carry.pack(cache, out)
    assert sorted(p.name for p in out.iterdir() if not p.name.startswith(carry.PREFIX)) == [f"log{i}" for i in range(6)]


def test_no_parts_when_they_would_not_all_come_back(tmp_path, carry, capsys):
    cache, out = _cache(tmp_path, 600 << 10), tmp_path / "out"  # ten parts: more than the tool brings back
    out.mkdir()
    for i in range(3):
        (out / f"log{i}").write_text("x")
    carry.pack(cache, out)
    assert "not packed" in capsys.readouterr().out
    assert sorted(p.name for p in out.iterdir()) == ["log0", "log1", "log2"]  # the stage's files untouched


def test_nothing_carried_is_a_cold_start(tmp_path, carry, capsys):
    carry.unpack(tmp_path / "none", tmp_path / "cache")
    assert "compiling cold" in capsys.readouterr().out
    assert not (tmp_path / "cache").exists()


def test_the_script_runs_as_ci_calls_it(tmp_path):
    import subprocess
    import sys

    run = subprocess.run([sys.executable, str(ROOT / "ci" / "triton_cache.py"), "unpack", str(tmp_path / "none"),
                          str(tmp_path / "cache")], capture_output=True, text=True, check=True)
    assert "compiling cold" in run.stdout


def test_repack_shrinks_the_parts_and_keeps_every_file(tmp_path, carry, capsys):
    """A kernel repeated 1.2 MiB apart, past preset 1's 1 MiB dictionary (as the device packs) but inside the strong
    preset's: the repacked parts are about half as many, the stale ones gone, and they unpack to the same files."""
    import io
    import tarfile

    cache = tmp_path / "cache"
    block = os.urandom(1200 << 10)
    for name in ("ab12", "cd34"):
        (cache / name).mkdir(parents=True)
        (cache / name / "k.cubin").write_bytes(block)
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=1) as tar:
        tar.add(cache / "ab12" / "k.cubin", arcname="ab12/k.cubin")
        tar.add(cache / "cd34" / "k.cubin", arcname="cd34/k.cubin")
    carried = tmp_path / "carried"
    carried.mkdir()
    before = carry._write_parts(buffer.getvalue(), carried)
    carry.repack(carried)
    assert "repacked" in capsys.readouterr().out
    after = sorted(carried.iterdir())
    assert [p.name for p in after] == [f"{carry.PREFIX}{i:02d}" for i in range(len(after))]
    assert len(after) < 0.6 * before
    again = tmp_path / "again"
    carry.unpack(carried, again)
    assert all((again / n / "k.cubin").read_bytes() == block for n in ("ab12", "cd34"))
