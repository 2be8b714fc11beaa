#!/bin/sh
# Fetches NCCL's public header (nccl.h of NCCL 2.28.9, the version on the GPU machines) from the
# nvidia-nccl-cu13 wheel and extracts only nccl.h into native/build/include/nccl.h.
#   fetch-headers.sh [CACHE_DIR]     CACHE_DIR keeps the wheel (default native/build/nccl-wheel)
# Nothing is fetched when nccl.h is already extracted. PYTHON overrides the interpreter (python3).
set -eu

NCCL_VERSION=2.28.9
WHEEL_NAME=nvidia-nccl-cu13
HERE=$(cd "$(dirname "$0")" && pwd)
BUILD=$(cd "$HERE/.." && pwd)/build
CACHE=${1:-$BUILD/nccl-wheel}
OUT=$BUILD/include/nccl.h
PYTHON=${PYTHON:-python3}

if [ -s "$OUT" ]; then
    exit 0
fi
mkdir -p "$CACHE" "$BUILD/include"

wheel=$(ls "$CACHE"/nvidia_nccl_cu13-"$NCCL_VERSION"-*.whl 2>/dev/null | head -n 1 || true)
if [ -z "$wheel" ]; then
    echo "fetch-headers: downloading $WHEEL_NAME==$NCCL_VERSION into $CACHE"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: "$WHEEL_NAME==$NCCL_VERSION" -d "$CACHE"
    wheel=$(ls "$CACHE"/nvidia_nccl_cu13-"$NCCL_VERSION"-*.whl | head -n 1)
fi

# Extract to a temporary name first so that an interrupted run never leaves a truncated header.
"$PYTHON" - "$wheel" "$OUT.tmp" <<'PY'
import sys, zipfile
wheel, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    data = z.read("nvidia/nccl/include/nccl.h")
with open(out, "wb") as f:
    f.write(data)
PY
if ! grep -q "#define NCCL_VERSION_CODE 22809" "$OUT.tmp"; then
    echo "fetch-headers: $wheel does not carry NCCL $NCCL_VERSION's nccl.h" >&2
    rm -f "$OUT.tmp"
    exit 1
fi
mv "$OUT.tmp" "$OUT"
echo "fetch-headers: $OUT (NCCL $NCCL_VERSION)"
