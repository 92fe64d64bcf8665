#!/usr/bin/env bash
# make gpu-check: check a fresh GPU machine in at most 8 minutes of wall time, and print one table.
#
# 1. Installs the carried wheels (make gpu-wheels, folder .whl) with `pip install --no-index --no-deps
#    --target` into $SITE, for a machine without a network that already has CUDA torch (the target image:
#    Python 3.12, torch 2.11 + CUDA 13). `--target` folders are not site folders, so the activation .pth
#    would not run from PYTHONPATH alone: a sitecustomize in $BOOT adds $SITE as a site folder. Without a
#    .whl folder nothing is installed: the environment's own deepspeed and deepspeed-zero3 are used.
# 2. make test-gpu (tests/gpu, same command), then the GPU benchmark (python -m deepspeed_zero3.bench.gpu).
# 3. One table (python -m deepspeed_zero3.bench.gpu.report) on stdout and in gpu-out/table.md; with $OUT
#    set (the device machine's return folder), the table, the JSON results and a tarball of the logs go there.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
PYTHON=${PYTHON:-python3}
WHEELS=${WHEEL_DIR:-.whl}
SITE=${SITE:-/tmp/dsz3-site}
BOOT=${BOOT:-/tmp/dsz3-boot}
export GPU_CHECK_OUT=${GPU_CHECK_OUT:-gpu-out}
export DS_ACCELERATOR=cuda PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-/tmp/dsz3-torch-extensions}
rm -rf "$GPU_CHECK_OUT" && mkdir -p "$GPU_CHECK_OUT"

if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
        "$WHEELS"/*.whl || { echo "gpu-check: installing the wheels of $WHEELS failed"; exit 1; }
    mkdir -p "$BOOT"
    printf 'import site\nsite.addsitedir(%s)\n' "'$SITE'" > "$BOOT/sitecustomize.py"
    export PYTHONPATH="$BOOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
"$PYTHON" -c "import torch; print('gpu-check: torch', torch.__version__, 'CUDA', torch.version.cuda, 'device:',
torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none')"
"$PYTHON" -m deepspeed_zero3 || { echo "gpu-check: deepspeed-zero3 is not importable"; exit 1; }

status=0
timeout 330 "$PYTHON" -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$GPU_CHECK_OUT/test-gpu.log"
tests=${PIPESTATUS[0]}
[ "$tests" -eq 0 ] || status=1
LEFT=$((480 - ($(date +%s) - START) - 20))
if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu-check: no CUDA device here: tests/gpu skipped, no benchmark"
    exit $status
elif [ "$LEFT" -gt 60 ]; then
    timeout "$LEFT" "$PYTHON" -m deepspeed_zero3.bench.gpu --out "$GPU_CHECK_OUT" --timeout $((LEFT / 2 - 5)) \
        2>&1 | tee "$GPU_CHECK_OUT/bench.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
else
    echo "gpu-check: no time left for the benchmark (${LEFT}s)"; status=1
fi

{
    echo "# make gpu-check, $(date -u +%Y-%m-%dT%H:%MZ), $(( $(date +%s) - START )) s"
    "$PYTHON" -c "import torch, deepspeed; print(f'{torch.cuda.get_device_name(0)}, torch {torch.__version__}, deepspeed {deepspeed.__version__}')" 2>/dev/null
    echo "tests/gpu: exit $tests; $(tail -1 "$GPU_CHECK_OUT/test-gpu.log")"
    "$PYTHON" -m deepspeed_zero3.bench.gpu.report "$GPU_CHECK_OUT" check bench
} | tee "$GPU_CHECK_OUT/table.md"

if [ -n "${OUT:-}" ]; then
    cp "$GPU_CHECK_OUT/table.md" "$OUT/"
    tar czf "$OUT/gpu-out.tgz" --exclude='trace-*' "$GPU_CHECK_OUT"
    ls "$GPU_CHECK_OUT"/trace-ours-llama-bench.json >/dev/null 2>&1 && gzip -c "$GPU_CHECK_OUT/trace-ours-llama-bench.json" > "$OUT/trace-ours.json.gz"
    ls "$GPU_CHECK_OUT"/trace-upstream-llama-bench.json >/dev/null 2>&1 && gzip -c "$GPU_CHECK_OUT/trace-upstream-llama-bench.json" > "$OUT/trace-upstream.json.gz"
fi
echo "gpu-check: $(( $(date +%s) - START )) s, status $status"
exit $status
