"""Carry Triton's compiled kernels from one lent GPU machine to the next (docs/PERF.md, "Open directions", the cold
compile).

A fresh machine compiles every kernel again: at 01a23a9 qualification's first 7 steps took 172 s of a 260 s limit doing
so. The compiled kernels of an sm_90 machine serve every sm_90 machine with the same Triton, so a stage packs its cache
into the files the device tool brings back, and the next call carries them in and unpacks them before it starts.
    python3 ci/triton_cache.py unpack CARRIED_DIR CACHE_DIR
    python3 ci/triton_cache.py pack CACHE_DIR OUT_DIR
    python3 ci/triton_cache.py repack CARRIED_DIR
The device packs quickly (xz preset 1: its time is the session's budget); `repack`, run here before the next call,
compresses the returned parts again at xz's strongest preset (~2 minutes of one core: 26 MiB became 9 MiB at e5e7890),
since the tree and the parts travel within the tool's 64 MiB.
Only what a cache hit reads travels (each kernel's binary, its metadata and group files, the compiled launchers); the
intermediate IR stays behind. Where a stage's own files and the parts together pass the tool's eight files, the stage's
files go into one `results.tar.xz` first (`tar xf` it where the files land), so that neither is left out. The cache
must sit at the same absolute path on both machines: its group files name their members by path.
"""

import io
import lzma
import sys
import tarfile
from pathlib import Path

PART_BYTES = 15 << 20  # the device tool brings back files of at most 16 MiB
FILES_BACK = 8  # and at most eight of them
LEFT_BEHIND = {".ttir", ".ttgir", ".llir", ".ptx", ".source", ".amdgcn"}
PREFIX = "triton-cache-part-"
BUNDLE = "results.tar.xz"


def _bundle(out: Path, files: list[Path]) -> bool:
    """The stage's `files` as one xz tar in `out`, in their place; False (nothing changed) if it would not come back."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=6) as tar:
        for path in files:
            tar.add(path, arcname=path.name)
    if len(buffer.getvalue()) > PART_BYTES:
        return False
    (out / BUNDLE).write_bytes(buffer.getvalue())
    for path in files:
        path.unlink()
    return True


def pack(cache: Path, out: Path) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz", preset=1) as tar:
        for path in sorted(cache.rglob("*")):
            if path.is_file() and path.suffix not in LEFT_BEHIND:
                tar.add(path, arcname=str(path.relative_to(cache)))
    data = buffer.getvalue()
    parts = [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)]
    results = sorted(p for p in out.iterdir() if p.is_file())
    room = FILES_BACK - len(results)
    if len(parts) > room and len(results) > 1 and len(parts) < FILES_BACK and _bundle(out, results):
        print(f"triton cache: the stage's {len(results)} files bundled into {BUNDLE} to make room")
        room = FILES_BACK - 1
    if len(parts) > room:
        print(f"triton cache: {len(data) >> 20} MiB needs {len(parts)} files, {room} left to bring back: not packed")
        return
    _write_parts(data, out)
    print(f"triton cache: {len(data) >> 20} MiB in {len(parts)} files")


def _write_parts(data: bytes, out: Path) -> int:
    parts = [data[i:i + PART_BYTES] for i in range(0, len(data), PART_BYTES)]
    for i, part in enumerate(parts):
        (out / f"{PREFIX}{i:02d}").write_bytes(part)
    return len(parts)


def repack(carried: Path) -> None:
    parts = sorted(carried.glob(PREFIX + "*"))
    if not parts:
        sys.exit(f"triton cache: no {PREFIX}* files in {carried}")
    data = b"".join(p.read_bytes() for p in parts)
    tar = lzma.decompress(data)
    smaller = lzma.compress(tar, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    for p in parts:  # written whole in memory first, so a failure above leaves the parts as they were
        p.unlink()
    n = _write_parts(smaller, carried)
    print(f"triton cache: {len(data) >> 20} MiB repacked into {len(smaller) >> 20} MiB, {n} files")


def unpack(carried: Path, cache: Path) -> None:
    parts = sorted(carried.glob(PREFIX + "*"))
    if not parts:
        print("triton cache: none carried, compiling cold")
        return
    cache.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(b"".join(p.read_bytes() for p in parts)), mode="r:xz") as tar:
        tar.extractall(cache, filter="data")
        print(f"triton cache: {len(tar.getmembers())} files carried in")


if __name__ == "__main__":
    verb, *dirs = sys.argv[1:]
    {"pack": pack, "unpack": unpack, "repack": repack}[verb](*map(Path, dirs))
