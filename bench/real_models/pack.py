"""Split files into per-call folders that each fit one device call, and put them back.

A device call carries at most 64 MiB (the repository's tree included), so the model
files travel in parts over successive calls while the machine stays warm, each call
leaving its parts in a stash folder there. `pack` writes `OUT/c1 .. OUT/cN`, each at
most `--cap` MiB, the large files cut into parts in order and the small files (`--small`:
wheels, references, texts) all in the last folder; every folder holds the same
`manifest{NAME}.json` (file names, sizes, sha256, parts in order). `stash` copies a carried
folder's parts into the stash; `assemble` joins every file whose parts are all in the
stash and checks its sha256.

    python bench/real_models/pack.py pack --out .real --cap 56 --big a.gguf b.gguf \
        --small wheels refs
    python bench/real_models/pack.py stash .real /tmp/real-stash
    python bench/real_models/pack.py assemble /tmp/real-stash /tmp/real
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

MIB = 1 << 20


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def pack(out: Path, cap_mib: float, big: list[Path], small: list[Path],
         label: str = "") -> list[dict]:
    """Write the call folders; returns one {folder, bytes} row per call."""
    cap = int(cap_mib * MIB)
    small_bytes = sum(_tree_size(p) for p in small)
    if small_bytes > cap:
        raise SystemExit(f"the small files alone ({small_bytes / MIB:.1f} MiB) exceed the cap")
    if out.exists():
        shutil.rmtree(out)
    calls: list[int] = [0]  # bytes in each call folder
    files = []
    for path in big:
        size, left, parts = path.stat().st_size, path.stat().st_size, []
        with open(path, "rb") as stream:
            while left > 0:
                room = cap - calls[-1]
                if room < MIB:  # start the next call
                    calls.append(0)
                    room = cap
                chunk = min(room, left)
                name = f"{path.name}.part{len(parts):02d}"
                folder = out / f"c{len(calls)}"
                folder.mkdir(parents=True, exist_ok=True)
                with open(folder / name, "wb") as part:
                    remaining = chunk
                    while remaining:
                        block = stream.read(min(remaining, 1 << 22))
                        part.write(block)
                        remaining -= len(block)
                parts.append({"call": len(calls), "name": name, "bytes": chunk})
                calls[-1] += chunk
                left -= chunk
        files.append({"name": path.name, "bytes": size, "sha256": _sha256(path), "parts": parts})
    if calls[-1] + small_bytes > cap:
        calls.append(0)
    last = out / f"c{len(calls)}"
    last.mkdir(parents=True, exist_ok=True)
    for path in small:
        target = last / path.name
        if path.is_dir():
            shutil.copytree(path, target)
        else:
            shutil.copy2(path, target)
    calls[-1] += small_bytes
    manifest = {"calls": len(calls), "cap_mib": cap_mib, "files": files,
                "small": [p.name for p in small]}
    for number in range(1, len(calls) + 1):
        (out / f"c{number}").mkdir(parents=True, exist_ok=True)
        (out / f"c{number}" / f"manifest{label}.json").write_text(json.dumps(manifest, indent=1))
    return [{"folder": str(out / f"c{i + 1}"), "bytes": b} for i, b in enumerate(calls)]


def stash(carried: Path, stash_dir: Path) -> list[str]:
    """Copy every call folder's contents found under `carried` into `stash_dir`."""
    stash_dir.mkdir(parents=True, exist_ok=True)
    moved = []
    for folder in sorted(p for p in carried.glob("c*") if p.is_dir()):
        for item in folder.iterdir():
            target = stash_dir / item.name
            if item.is_dir():
                shutil.copytree(item, target, dirs_exist_ok=True)
            else:
                shutil.copy2(item, target)
            moved.append(item.name)
    return moved


def assemble(stash_dir: Path, out: Path) -> dict[str, str]:
    """{file name: "ok" | "missing parts ..." | "sha256 mismatch"} for the manifest's
    files, the complete ones joined into `out`."""
    entries = [entry for path in sorted(stash_dir.glob("manifest*.json"))
               for entry in json.loads(path.read_text())["files"]]
    out.mkdir(parents=True, exist_ok=True)
    status = {}
    for entry in entries:
        target = out / entry["name"]
        if target.is_file() and target.stat().st_size == entry["bytes"]:
            status[entry["name"]] = "ok"
            continue
        missing = [p["name"] for p in entry["parts"] if not (stash_dir / p["name"]).is_file()]
        if missing:
            calls = sorted({p["call"] for p in entry["parts"] if p["name"] in missing})
            status[entry["name"]] = f"missing parts from calls {calls}"
            continue
        with open(target.with_suffix(".joining"), "wb") as joined:
            for part in entry["parts"]:
                with open(stash_dir / part["name"], "rb") as stream:
                    shutil.copyfileobj(stream, joined, 1 << 22)
        if _sha256(target.with_suffix(".joining")) != entry["sha256"]:
            status[entry["name"]] = "sha256 mismatch"
            continue
        target.with_suffix(".joining").rename(target)
        status[entry["name"]] = "ok"
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cap", type=float, default=56.0, help="MiB per call folder")
    p.add_argument("--big", type=Path, nargs="*", default=[])
    p.add_argument("--small", type=Path, nargs="*", default=[])
    p.add_argument("--name", default="", help="manifest name suffix (one per pack)")
    s = sub.add_parser("stash")
    s.add_argument("carried", type=Path)
    s.add_argument("stash_dir", type=Path)
    a = sub.add_parser("assemble")
    a.add_argument("stash_dir", type=Path)
    a.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "pack":
        for row in pack(args.out, args.cap, args.big, args.small, args.name):
            print(f"{row['folder']}: {row['bytes'] / MIB:.1f} MiB")
    elif args.command == "stash":
        print(f"stashed {len(stash(args.carried, args.stash_dir))} items in {args.stash_dir}")
    else:
        status = assemble(args.stash_dir, args.out)
        for name, state in status.items():
            print(f"{name}: {state}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
