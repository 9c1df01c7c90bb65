#!/usr/bin/env bash
# `make gpu-payload`: builds, on a CPU host, everything a lent GPU machine lacks to run
# deploy/gpu/check.sh, in parts small enough for the device tool's carry limit (64 MiB a call).
#
#   .gpu/downloads/   the wheels, fetched once and kept (about 500 MB, fbgemm-gpu's 465 MB of it)
#   .gpu/build/       the tree that is packed: site/ (every package, installed for cp312) and
#                     kafka-libs/ (the broker's jars); made on each run, removed once packed
#   .gpu/c1, c2, ...  the packed tree (tar, xz) split into parts, one folder per device call, each
#                     with payload.sha256 (of the whole archive) and MANIFEST (what is inside)
#
# fbgemm-gpu 1.6.0 (CUDA 13, for the device's torch 2.11) unpacks to 2.4 GiB: its cubins for
# sm_80 and sm_100 are zeroed in place (deploy/gpu/zero_cubins.py keeps every header and offset, so
# the driver still finds the sm_90 cubin), and xz then packs the tree to under 80 MiB.
# Environment: PART_MIB (default 60), GPU_PAYLOAD (default .gpu), PYTHON (default .venv/bin/python),
# KEEP_ARCH (default 90: an H100 or H200).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${GPU_PAYLOAD:-.gpu}
PY=${PYTHON:-.venv/bin/python}
PART_MIB=${PART_MIB:-60}
KAFKA_LIBS=${STREAMTRAIN_KAFKA_LIBS:-.cache/kafka/4.1.1/libs}
FBGEMM=fbgemm-gpu==1.6.0
DOWNLOADS=$OUT/downloads
BUILD=$OUT/build
TARGET=(--python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
        --platform any --only-binary=:all: --no-deps)
started=$(date +%s)
say() { echo "gpu-payload [$(( $(date +%s) - started ))s]: $*" >&2; }

ls "$KAFKA_LIBS"/kafka_2.13-*.jar >/dev/null 2>&1 || { echo "no Kafka jars in $KAFKA_LIBS: run make setup" >&2; exit 1; }
mkdir -p "$DOWNLOADS"
say "downloading $FBGEMM and deploy/gpu/requirements.txt for CPython 3.12 (kept in $DOWNLOADS)"
"$PY" -m pip download --quiet --disable-pip-version-check "${TARGET[@]}" -d "$DOWNLOADS" "$FBGEMM" \
    -r deploy/gpu/requirements.txt
# iopath is an sdist only: torchrec.models imports it (through torchrec.datasets).
ls "$DOWNLOADS"/iopath-0.1.10-*.whl >/dev/null 2>&1 ||
    "$PY" -m pip wheel --quiet --disable-pip-version-check --no-deps -w "$DOWNLOADS" iopath==0.1.10

rm -rf "$BUILD" "$OUT"/c[0-9]*
mkdir -p "$BUILD/site"
say "installing the wheels into $BUILD/site"
"$PY" -m pip install --quiet --disable-pip-version-check --no-compile --no-index --find-links "$DOWNLOADS" \
    --target "$BUILD/site" "${TARGET[@]}" -r deploy/gpu/requirements.txt iopath==0.1.10
say "unpacking fbgemm-gpu, zeroing its cubins for other GPUs than sm_${KEEP_ARCH:-90}"
"$PY" -m zipfile -e "$DOWNLOADS"/fbgemm_gpu-1.6.0-cp312-*.whl "$BUILD/site"
find "$BUILD/site/fbgemm_gpu" -name '*.so' -print0 | xargs -0 "$PY" deploy/gpu/zero_cubins.py | tail -1 >&2
cp -r "$KAFKA_LIBS" "$BUILD/kafka-libs"
rm -f "$BUILD/kafka-libs/.stamp"

say "packing (tar | xz -6)"
tar -C "$BUILD" -cf - site kafka-libs | xz -6 -T0 > "$BUILD/payload.tar.xz"
sum=$(sha256sum "$BUILD/payload.tar.xz" | cut -d' ' -f1)
split -b "$((PART_MIB * 1024 * 1024))" -d -a 2 "$BUILD/payload.tar.xz" "$BUILD/payload.tar.xz."
parts=("$BUILD"/payload.tar.xz.[0-9][0-9])
for i in "${!parts[@]}"; do
    folder=$OUT/c$((i + 1))
    mkdir -p "$folder"
    mv "${parts[$i]}" "$folder/"
    echo "$sum  payload.tar.xz" > "$folder/payload.sha256"
    {
        echo "part $((i + 1)) of ${#parts[@]} of payload.tar.xz (sha256 $sum)"
        echo "fbgemm: $FBGEMM, sm_${KEEP_ARCH:-90} cubins only"
        grep -v '^#' deploy/gpu/requirements.txt | grep . | tr '\n' ' '
        echo "iopath==0.1.10"
        echo "kafka: $(ls "$KAFKA_LIBS"/kafka_2.13-*.jar | xargs -n1 basename)"
    } > "$folder/MANIFEST"
done
rm -rf "$BUILD"  # 2.6 GiB unpacked; the parts and the downloads are what is kept
say "done: ${#parts[@]} part(s), sha256 $sum"
du -b "$OUT"/c*/payload.tar.xz.* | awk '{printf "  %s  %.1f MiB\n", $2, $1 / 1048576}' >&2
