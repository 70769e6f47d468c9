#!/usr/bin/env python3
"""Is this Python environment the locked one? Compares installed versions with docker/requirements.lock
and docker/flash-attn.lock. The image build runs it over every pin; on a machine staged by hand (a GPU box
without the image) check the pins that matter: `scripts/check_image.py --only torch,vllm,verl,transformers`.
A local version label (torch 2.11.0+cu130) matches the plain pin (2.11.0)."""

from __future__ import annotations

import argparse
import importlib.metadata as metadata
import sys
from pathlib import Path

from check_lock import canonical, parse_lock

REPO = Path(__file__).resolve().parent.parent
KEY = ["torch", "vllm", "verl", "transformers", "ray", "flash-attn", "xformers", "swanlab", "pyarrow"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", help="comma-separated package names to check (default: every pin)")
    args = parser.parse_args()
    pins = parse_lock(REPO / "docker" / "requirements.lock")
    pins.update(parse_lock(REPO / "docker" / "flash-attn.lock"))
    names = [canonical(n) for n in args.only.split(",")] if args.only else sorted(pins)
    unknown = [n for n in names if n not in pins]
    if unknown:
        sys.exit(f"error: not pinned in docker/*.lock: {', '.join(unknown)}")
    problems = []
    for name in names:
        want = pins[name][0]
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            problems.append(f"{name} missing (lock {want})")
            continue
        if have.split("+")[0] != want:
            problems.append(f"{name} {have} (lock {want})")
        if name in KEY or args.only:
            print(f"  {name:<14} {have}")
    if problems:
        sys.exit(f"error: {len(problems)} package(s) differ from the lock: {'; '.join(problems)}")
    print(f"{len(names)} package(s) match the lock")
    return 0


if __name__ == "__main__":
    sys.exit(main())
