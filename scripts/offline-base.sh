#!/usr/bin/env bash
# Makes a base image for FLAVOR=cpu without any container registry: a minimal Debian root filesystem from
# Debian's own packages (mmdebstrap), imported into the local Docker engine as NAME.
#   scripts/offline-base.sh NAME [SUITE]      e.g. scripts/offline-base.sh local/base   (SUITE: bookworm)
# It carries what the CPU image needs (python3 + venv, CA certificates, ssh and rsync for `make gather`,
# ip and ps for `make doctor`), so the image build needs no apt mirror afterwards.
# Needs: mmdebstrap (apt-get install mmdebstrap), a reachable Debian mirror, a running Docker engine.
set -euo pipefail
if [ "$#" -lt 1 ] || [ "$#" -gt 2 ]; then
  echo "usage: scripts/offline-base.sh NAME [SUITE]" >&2
  exit 2
fi
name=$1
suite=${2:-bookworm}
for tool in mmdebstrap docker; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "error: $tool is not installed: apt-get install -y mmdebstrap docker.io" >&2
    exit 1
  fi
done
if ! docker version --format '{{.Server.Version}}' >/dev/null 2>&1; then
  echo "error: no Docker engine answers (docker version): start it first" >&2
  exit 1
fi
packages=python3,python3-venv,ca-certificates,openssh-client,rsync,iproute2,procps
started=$SECONDS
log=$(mktemp)
trap 'rm -f "$log"' EXIT
if ! mmdebstrap --variant=minbase --include="$packages" "$suite" - 2>"$log" | docker import - "$name" >/dev/null; then
  tail -n 5 "$log" >&2
  echo "error: could not make $name from Debian $suite (mmdebstrap's last lines above): check the mirror" >&2
  exit 1
fi
echo "made $name (Debian $suite minbase + $packages) in $((SECONDS - started))s"
