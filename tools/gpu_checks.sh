#!/usr/bin/env bash
# The GPU checks of the device tier, for a lent GPU machine (see the README's "On a GPU").
#
#   bash tools/gpu_checks.sh STAGE...   stages: env tests suite sanitize bench fresh dlrm profile
#
# Wheels the machine lacks (lmdb, cachetools) are read from .whl/ when it exists. Logs and JSON go
# to $OUT (or ./gpu-checks). Each stage has its own time limit so one slow stage leaves the others
# their turn.
set -u
OUT=${OUT:-gpu-checks}
mkdir -p "$OUT"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
stage() { # name, seconds, command...
    local name=$1 seconds=$2
    shift 2
    echo "=== $name ($(date +%T))"
    timeout "$seconds" "$@" >"$OUT/$name.log" 2>&1
    echo "=== $name: exit $? ($(date +%T))"
    tail -n 25 "$OUT/$name.log"
}
sanitize() { # tool, seconds, dtypes: every device-tier kernel under compute-sanitizer, on rows of those dtypes
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 stage "sanitize-$1-${3// /-}" "$2" compute-sanitizer --tool "$1" \
        --report-api-errors no --error-exitcode 9 python3 tools/gpu_kernel_workload.py $3
}
for name in "$@"; do
    case $name in
    env) stage env 60 bash -c 'nvidia-smi; python3 -c "import torch, cuda.bindings, numpy; print(torch.__version__, \
        cuda.bindings.__version__, numpy.__version__, torch.cuda.get_device_name())"' ;;
    tests) stage tests 300 python3 -m pytest -q -p no:cacheprovider -m gpu --maxfail=5 tests ;; # every gpu test
    suite) stage suite 540 python3 -m pytest -v -p no:cacheprovider -n 8 tests ;; # -v: outcomes as they come
    sanitize) for tool in memcheck racecheck synccheck initcheck; do
        sanitize $tool 90 float32
        sanitize $tool 120 "float16 bfloat16"
    done ;;
    bench) stage bench 300 python3 bench/bench_device.py --json "$OUT/device.json" ;;
    fresh) stage fresh 200 python3 bench/bench_device.py --fresh --json "$OUT/device-fresh.json" ;;
    dlrm) stage dlrm 150 python3 tools/train_dlrm.py --device cuda --steps 100 ;;
    profile) stage profile 150 python3 bench/bench_device.py --profile --repeats 10 ;;
    *) echo "unknown stage $name" && exit 2 ;;
    esac
done
