#!/usr/bin/env bash
# Regenerate the image's hashed locks from docker/requirements.in + pyproject.toml's dependencies, for
# the image's interpreter and platform (CPython 3.12, manylinux x86_64, glibc 2.39 = Ubuntu 24.04):
#   docker/requirements.lock        everything pip installs in the image (exact versions, sha256)
#   docker/build-tools.lock         setuptools + wheel at the same pins, installed first (builds run
#                                   without isolation, so build tools are hash-checked too)
#   docker/flash-attn.lock          flash-attn's sdist (PyPI has no wheel; the image builds it)
#   docker/requirements.sdist-only  pins without a wheel, found by scripts/check_lock.py
# Needs network access to the package index and uv (`pip install uv`; .venv has it).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
UV=${UV:-$([ -x .venv/bin/uv ] && echo .venv/bin/uv || echo uv)}
FLASH_ATTN_VERSION=2.8.3
target=(--python-version 3.12 --python-platform x86_64-manylinux_2_39)

echo "resolving docker/requirements.in + pyproject.toml for CPython 3.12 manylinux_2_39 x86_64 ..."
"$UV" pip compile -q docker/requirements.in pyproject.toml "${target[@]}" --generate-hashes \
  --custom-compile-command "scripts/lock.sh" -o docker/requirements.lock.tmp
mv docker/requirements.lock.tmp docker/requirements.lock

printf 'setuptools\nwheel\n' | "$UV" pip compile -q - -c docker/requirements.lock "${target[@]}" \
  --generate-hashes --custom-compile-command "scripts/lock.sh" -o docker/build-tools.lock.tmp
mv docker/build-tools.lock.tmp docker/build-tools.lock

# No resolver hashes an sdist without building it, and flash-attn's build imports a CUDA torch: take
# the sdist's sha256 from the index's own JSON (PEP 691) instead.
"$PY" - "$FLASH_ATTN_VERSION" > docker/flash-attn.lock.tmp <<'EOF'
import json, sys, urllib.request
version = sys.argv[1]
request = urllib.request.Request("https://pypi.org/simple/flash-attn/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(request, timeout=60))["files"]
sdist = [f for f in files if f["filename"] == f"flash_attn-{version}.tar.gz"]
if len(sdist) != 1:
    sys.exit(f"flash-attn {version}: no single sdist on the index")
print("# flash-attn has no wheel on PyPI: the image builds this sdist against the locked torch.")
print("# Written by scripts/lock.sh.")
print(f"flash-attn=={version} \\\n    --hash=sha256:{sdist[0]['hashes']['sha256']}")
EOF
mv docker/flash-attn.lock.tmp docker/flash-attn.lock

echo "checking the lock with pip's resolver (binary-only, dry run) ..."
"$PY" scripts/check_lock.py --discover
