#!/usr/bin/env bash
# The GPU checks of the kernel path, as one prepared command for a single H200 (< 10 min):
#
#   bash tests/gpu/run_device_checks.sh            # from the repository root
#
# 1. picks a Python whose torch sees CUDA (PYTHON=..., else .venv/bin/python, else python3);
# 2. installs what is missing, offline first: wheels in $WHEELS_DIR (default .wheels/, e.g.
#    flashinfer-python, pydantic) with --no-index; from the package index only when
#    HYBRIDSERVE_PIP_NETWORK=1 (pip install -e '.[gpu,dev]'); otherwise the FlashInfer and
#    whole-model checks skip and say so;
# 3. pytest tests/gpu (kernels vs references at real sizes, FlashInfer vs torch attention,
#    whole-model greedy equality), then the interpreter-free Triton tests of
#    tests/kernels/triton_path on the GPU;
# 4. tests/gpu/bench.py: the speed table and the ~1B-model decode throughput.
#
# Every stage has its own time limit; a failing stage does not stop the later ones, and the
# exit status is that of the first failure. Logs go to $OUT (if set) or /tmp/hybridserve-device-logs.
set -u
cd "$(dirname "$0")/../.."
LOG_DIR="${OUT:-/tmp/hybridserve-device-logs}"
mkdir -p "$LOG_DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset TRITON_INTERPRET HYBRIDSERVE_KERNEL_BACKEND
status=0
note() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }
record() { if [ "$1" -ne 0 ] && [ "$status" -eq 0 ]; then status=$1; fi; }

has_cuda() { "$1" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; }
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for cand in .venv/bin/python python3 python; do
        if command -v "$cand" >/dev/null 2>&1 && has_cuda "$cand"; then PY="$cand"; break; fi
    done
fi
if [ -z "$PY" ] || ! has_cuda "$PY"; then
    echo "no Python with a CUDA-enabled torch found (set PYTHON=...)"; exit 2
fi

note "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
"$PY" - <<'EOF'
import importlib, torch
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
for name in ("triton", "flashinfer", "transformers", "pydantic", "pytest", "hypothesis"):
    try:
        print(f"{name:<13}", getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as exc:
        print(f"{name:<13} missing ({type(exc).__name__})")
EOF

note "install what is missing"
missing=$("$PY" - <<'EOF'
import importlib.util
need = {"flashinfer": "flashinfer-python", "pydantic": "pydantic", "yaml": "pyyaml",
        "pytest": "pytest", "hypothesis": "hypothesis", "pytest_timeout": "pytest-timeout",
        "transformers": "transformers", "safetensors": "safetensors", "tokenizers": "tokenizers"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
WHEELS_DIR="${WHEELS_DIR:-.wheels}"
if [ -z "$missing" ]; then
    echo "nothing missing"
elif [ -d "$WHEELS_DIR" ]; then
    echo "offline install from $WHEELS_DIR: $missing"
    for pkg in $missing; do
        timeout 180 "$PY" -m pip install -q --no-index --find-links "$WHEELS_DIR" "$pkg" \
            || echo "  $pkg: not installed"
    done
elif [ "${HYBRIDSERVE_PIP_NETWORK:-0}" = "1" ]; then
    echo "pip install -e '.[gpu,dev]' (missing: $missing)"
    timeout 300 "$PY" -m pip install -q -e '.[gpu,dev]' || echo "  pip install failed"
else
    echo "missing: $missing -- no $WHEELS_DIR and no network: the checks that need them skip"
fi

TIMEOUT_ARGS=""
"$PY" -c 'import pytest_timeout' 2>/dev/null && TIMEOUT_ARGS="--timeout=180"

note "pytest tests/gpu"
timeout 270 "$PY" -m pytest tests/gpu -q -rs -p no:cacheprovider $TIMEOUT_ARGS 2>&1 \
    | tee "$LOG_DIR/pytest_gpu.log"
record "${PIPESTATUS[0]}"

note "pytest tests/kernels/triton_path (real kernels on the GPU, small shapes)"
timeout 90 "$PY" -m pytest tests/kernels/triton_path -q -rs -p no:cacheprovider $TIMEOUT_ARGS \
    2>&1 | tee "$LOG_DIR/pytest_triton_path.log"
record "${PIPESTATUS[0]}"

note "speed table"
timeout 200 "$PY" tests/gpu/bench.py 2>&1 | tee "$LOG_DIR/bench.log"
record "${PIPESTATUS[0]}"

note "done: exit status $status"
exit "$status"
