#!/usr/bin/env python3
"""Prove that docker/requirements.lock co-resolves for the image (CPython 3.12, manylinux x86_64 up to
Ubuntu 24.04's glibc 2.39) with pip's own resolver, binary-only, in dry-run/report mode (metadata only,
no multi-GB downloads), and that every wheel pip picks carries a sha256 the lock lists.

Why by hand: pip refuses sdists when resolving for another platform, and uv (which writes the lock)
is a different resolver; so the few pure-Python sdist-only pins (named in docker/requirements.sdist-only)
are first built into wheels from their hash-checked sdists, then pip resolves the whole lock binary-only.

    scripts/check_lock.py                 # check (used by `make test`)
    scripts/check_lock.py --discover      # also find sdist-only pins and rewrite that list (scripts/lock.sh)
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LOCK = REPO / "docker" / "requirements.lock"
SDIST_ONLY = REPO / "docker" / "requirements.sdist-only"
PYTHON_VERSION = "3.12"
GLIBC_MINOR = 39  # Ubuntu 24.04, the image's base
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(?:\[[^\]]*\])?==([^\s;\\]+)")
HASH = re.compile(r"--hash=sha256:([0-9a-f]{64})")
NO_MATCH = re.compile(r"No matching distribution found for ([A-Za-z0-9._-]+)==")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_lock(path: Path) -> dict[str, tuple[str, set[str]]]:
    """name -> (version, sha256 set) from a `uv pip compile --generate-hashes` file."""
    pins: dict[str, tuple[str, set[str]]] = {}
    current = None
    for line in path.read_text().splitlines():
        match = PIN.match(line)
        if match:
            current = canonical(match.group(1))
            pins[current] = (match.group(2), set())
        elif not line.startswith((" ", "\t")):
            current = None
        if current:
            pins[current][1].update(HASH.findall(line))
    return pins


def platform_args() -> list[str]:
    plats = [f"manylinux_2_{minor}_x86_64" for minor in range(GLIBC_MINOR, 16, -1)]
    plats += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64"]
    return [arg for plat in plats for arg in ("--platform", plat)]


def pip(*args: str, timeout: float) -> subprocess.CompletedProcess:
    # --isolated: ignore this machine's pip config (local mirrors, caps); resolve against the index only.
    cmd = [sys.executable, "-m", "pip", "--isolated", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def build_wheel(name: str, pins: dict, wheels: Path, timeout: float) -> None:
    version, hashes = pins[name]
    req = wheels.parent / f"{name}.txt"
    req.write_text(f"{name}=={version} " + " ".join(f"--hash=sha256:{h}" for h in sorted(hashes)) + "\n")
    result = pip("wheel", "--no-deps", "--require-hashes", "--no-binary", ":all:", "-q", "-w", str(wheels),
                 "-r", str(req), timeout=timeout)
    if result.returncode != 0:
        sys.exit(f"error: could not build {name}=={version} from its hashed sdist:\n{result.stderr[-2000:]}")


def resolve(pins: dict, wheels: Path, work: Path, timeout: float) -> subprocess.CompletedProcess:
    plain = work / "plain.txt"  # exact pins without hashes: the locally built wheels have their own
    plain.write_text("".join(f"{name}=={version}\n" for name, (version, _) in sorted(pins.items())))
    return pip("install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(work / "report.json"),
               "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp",
               "--abi", "cp312", *platform_args(), "--target", str(work / "target"),
               "--find-links", str(wheels), "-r", str(plain), timeout=timeout)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lock", type=Path, default=LOCK)
    parser.add_argument("--sdist-only", type=Path, default=SDIST_ONLY)
    parser.add_argument("--discover", action="store_true", help="find sdist-only pins and rewrite the list")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for each pip call")
    args = parser.parse_args()

    pins = parse_lock(args.lock)
    if not pins:
        sys.exit(f"error: no pins in {args.lock}: run scripts/lock.sh")
    missing_hashes = sorted(name for name, (_, hashes) in pins.items() if not hashes)
    if missing_hashes:
        sys.exit(f"error: pins without --hash in {args.lock}: {', '.join(missing_hashes)}")
    listed = []
    if args.sdist_only.exists():
        listed = [canonical(line.split("#")[0].strip()) for line in args.sdist_only.read_text().splitlines()
                  if line.split("#")[0].strip()]
    unknown = [name for name in listed if name not in pins]
    if unknown:
        sys.exit(f"error: {args.sdist_only} names {', '.join(unknown)}, which the lock does not pin")

    with tempfile.TemporaryDirectory(prefix="check-lock-") as tmp:
        work = Path(tmp)
        wheels = work / "wheels"
        wheels.mkdir()
        built = []
        for name in listed:
            build_wheel(name, pins, wheels, args.timeout)
            built.append(name)
        for _ in range(len(pins)):
            result = resolve(pins, wheels, work, args.timeout)
            if result.returncode == 0:
                break
            match = NO_MATCH.search(result.stderr)
            name = canonical(match.group(1)) if match else None
            if not (args.discover and name in pins and name not in built):
                sys.exit(f"error: the lock does not co-resolve binary-only for cp312 manylinux x86_64:\n"
                         f"{result.stderr[-3000:]}\n(rerun scripts/lock.sh)")
            build_wheel(name, pins, wheels, args.timeout)
            built.append(name)
        report = json.loads((work / "report.json").read_text())

    resolved = {canonical(item["metadata"]["name"]): item for item in report["install"]}
    extra = sorted(set(resolved) - set(pins))
    absent = sorted(set(pins) - set(resolved))
    wrong = sorted(f"{name} {item['metadata']['version']} (lock {pins[name][0]})" for name, item in resolved.items()
                   if name in pins and item["metadata"]["version"] != pins[name][0])
    bad_hash = []
    for name, item in resolved.items():
        if name in built or name not in pins:
            continue
        sha = item["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256")
        if sha not in pins[name][1]:
            bad_hash.append(f"{name} ({item['download_info']['url'].rsplit('/', 1)[-1]}: {sha})")
    problems = [f"{label}: {', '.join(items)}" for label, items in
                (("not in the lock", extra), ("locked but not needed", absent), ("other version", wrong),
                 ("sha256 not in the lock", bad_hash)) if items]
    if problems:
        sys.exit("error: the lock is not what pip resolves: " + "; ".join(problems) + " (rerun scripts/lock.sh)")
    if args.discover:
        args.sdist_only.write_text("# Pins with no wheel on the index (pure Python; built from their hashed sdist)."
                                   "\n# Written by scripts/lock.sh.\n" + "".join(f"{n}\n" for n in sorted(built)))
    print(f"lock co-resolves: {len(resolved)} packages for CPython {PYTHON_VERSION} manylinux_2_{GLIBC_MINOR} "
          f"x86_64, binary-only, every picked wheel's sha256 in the lock; built from hashed sdists: "
          f"{', '.join(sorted(built)) or 'none'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
