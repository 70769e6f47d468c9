#!/bin/sh
# Runs one build command with the build machine's site settings, leaving nothing of them in the image:
# `make build` serves SITE_CA (as ca.crt) and WHEELS (as wheels/) on a loopback address, BUILD_FILES_URL;
# this fetches the CA into a temporary file for pip, points pip at the wheels, and deletes the file again
# before the layer is committed. Without BUILD_FILES_URL it just runs the command.
set -eu
# Build args that were not given arrive empty: unset them, so that pip keeps its defaults.
for name in PIP_INDEX_URL PIP_EXTRA_INDEX_URL; do
  eval "value=\${$name:-}"
  [ -n "$value" ] || unset "$name"
done
if [ -z "${BUILD_FILES_URL:-}" ]; then
  exec "$@"
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
fetch() {
  python3 - "$1" "$2" <<'PY'
import sys, urllib.error, urllib.request
try:
    data = urllib.request.urlopen(sys.argv[1], timeout=30).read()
except urllib.error.HTTPError:
    sys.exit(1)
open(sys.argv[2], "wb").write(data)
PY
}
if fetch "$BUILD_FILES_URL/ca.crt" "$tmp/ca.crt"; then
  export PIP_CERT="$tmp/ca.crt" SSL_CERT_FILE="$tmp/ca.crt"
fi
if fetch "$BUILD_FILES_URL/wheels/" "$tmp/wheels.html"; then
  export PIP_FIND_LINKS="$BUILD_FILES_URL/wheels/"
fi
"$@"
