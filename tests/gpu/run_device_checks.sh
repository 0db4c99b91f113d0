#!/usr/bin/env bash
# The GPU checks as one command, sized for the GPU machine as it is: one H100 or H200; python3
# is Python 3.12 with torch 2.11 (CUDA 13), triton 3.6, transformers 5.17, safetensors,
# tokenizers, pyyaml and pytest; pydantic, ray and flashinfer are absent; no network. The
# bench stage alone stays within 8 minutes (one short run: --only env,bench); all four stages
# within 12.
#
#   make gpu-wheels                                  # here, once, with network: fills .whl/
#   bash tests/gpu/run_device_checks.sh              # there, from the repository root
#   bash tests/gpu/run_device_checks.sh --only env,bench   # the short run: <= 8 minutes
#   bash tests/gpu/run_device_checks.sh --dry-run    # any CPU machine: toy sizes, interpreter
#
# What is missing there travels as wheels in .whl/ (git-ignored: name it in the call's carry;
# the repository and the wheels together must stay within the 64 MiB a call may carry; the
# wheels are about 3 MiB). `make gpu-wheels` runs tests/gpu/fetch_wheels.sh, which downloads
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
#       --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic-core==2.50.5 \
#       annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
# and this script installs them (when pydantic is missing) with
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
# and puts /tmp/site on PYTHONPATH. FlashInfer is optional: without it its rows are left out
# and attention runs the Triton kernel. transformers 5.17 is below the project's pin; the
# checks use only its config and model classes, which 5.17 has.
#
# Stages, each its own process with a soft budget (rows after it are reported as skipped)
# and a hard `timeout` 15 s later; a failing stage does not stop the next ones:
#   env      versions, and whether the project imports                       10 s
#   kernels  (a) every Triton kernel vs its torch reference, bf16 and fp32     140 s
#            (tests/gpu/checks_kernels.py, checks_new_kernels.py, checks_2026_kernels.py)
#   model    (b) tiny models: greedy tokens, GPU kernels vs CPU torch           80 s
#   bench    (c) a decode step of a ~1B dense and a ~2B MoE Qwen3-Next, eager  450 s
#            and captured, vs the HBM bound, at batch 1/32/128/256; (c2) the engine
#            compiled (inductor + CUDA graphs, compiled at start-up) on both, MTP k=3 on the
#            dense one, the eager engine: tok/s, host CPU per step by phase, compiled/eager
#            steps; (c3) a torch.profiler window at batch 128 (tests/gpu/bench_stage.py: an
#            engine that would not fit in what is left of the budget is not started)
# (Triton compiles each kernel variant on its first launch, in the stage's time; the cache in
# ~/.triton carries them from stage to stage.) Worst case with the hard limits: 11.7 minutes;
# --only env,bench: 7.9. (On an H200, 2026-12-04: env 12 s, kernels 83 s, model 50 s, and the
# bench stage of then, dense model only, 33 s without the compiled engine.)
# Output: every table in $OUT/summary.md (markdown), each stage's log in $OUT/<stage>.log
# (native.log: the background build of the C++ CPU ops, run with stage model), the profiler
# window's trace in $OUT/profile_b128.json.gz and its op table in $OUT/profile_b128.txt
# ($OUT unset: /tmp/hybridserve-device-checks). Exit status: the first failing stage's.
set -u
cd "$(dirname "$0")/../.."
DRY=0
STAGES="env,kernels,model,bench"
ONLY="$STAGES"
usage() { echo "usage: $0 [--dry-run] [--only STAGE[,STAGE...]] (stages: $STAGES)" >&2; exit 2; }
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY=1 ;;
        --only) [ $# -ge 2 ] || usage; ONLY="$2"; shift ;;
        *) usage ;;
    esac
    shift
done
for stage in ${ONLY//,/ }; do
    case "$stage" in env|kernels|model|bench) ;; *) usage ;; esac
done
wanted() { case ",$ONLY," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }
OUT_DIR="${OUT:-/tmp/hybridserve-device-checks}"
mkdir -p "$OUT_DIR"
: > "$OUT_DIR/summary.md"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset HYBRIDSERVE_KERNEL_BACKEND
if [ "$DRY" = 1 ]; then export TRITON_INTERPRET=1; else unset TRITON_INTERPRET; fi
status=0
note() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

note "install what is missing"
if ! "$PY" -c 'import pydantic' 2>/dev/null; then
    if ls .whl/*.whl >/dev/null 2>&1; then
        timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site .whl/*.whl || echo "installing .whl/ failed"
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "pydantic is missing and there is no .whl/ (make gpu-wheels): stages model and" \
             "bench will fail"
    fi
else
    echo "nothing missing"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null

run_stage() {       # name, soft budget (s)
    wanted "$1" || return 0
    local budget="$2" flags=()
    if [ "$DRY" = 1 ]; then budget=600; flags=(--dry-run); fi
    note "stage $1 (budget ${budget} s)"
    timeout "$((budget + 15))" "$PY" -m tests.gpu.device_checks "$1" --out "$OUT_DIR" \
        --budget-s "$budget" ${flags[@]+"${flags[@]}"} > "$OUT_DIR/$1.log" 2>&1
    local rc=$?
    tail -n 40 "$OUT_DIR/$1.log"
    if [ "$rc" -ne 0 ]; then
        [ "$rc" -eq 124 ] && echo "stage $1: stopped at its time limit" \
            | tee -a "$OUT_DIR/summary.md"
        [ "$status" -eq 0 ] && status=$rc
    fi
}

# The CPU references of stage model call the C++ CPU ops (kernels/native_ops.py: built once
# per machine, a minute or so); build them now, beside the GPU stages, not inside a budget.
native_pid=""
wanted model && { ( start=$(date +%s)
  timeout 400 "$PY" -c 'import sys; from kernels import native_ops; ok = native_ops.load()
print("native CPU ops:", "built" if ok else f"not built, Python fallbacks: {native_ops.failure()}")
sys.exit(0 if ok else 1)'
  echo "rc $? in $(( $(date +%s) - start )) s" ) > "$OUT_DIR/native.log" 2>&1 &
native_pid=$!; }

run_stage env 10
run_stage kernels 140
run_stage model 80
run_stage bench 450
if [ -n "$native_pid" ]; then
    wait "$native_pid"
    printf '\nnative CPU ops (background build): %s\n' "$(tr '\n' ' ' < "$OUT_DIR/native.log" \
        | tail -c 300)" | tee -a "$OUT_DIR/summary.md"
fi
note "done: exit status $status; tables in $OUT_DIR/summary.md"
exit "$status"
