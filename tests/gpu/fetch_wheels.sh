#!/bin/sh
# The wheels the GPU machine lacks, for tests/gpu/run_device_checks.sh (its header says how
# they are used there). Run here, with network (`make gpu-wheels`); fills .whl/ (git-ignored)
# with exactly these, for CPython 3.12 on x86-64 Linux, and checks that they fit the budget
# (the repository and the wheels travel together, 64 MiB a call).
set -eu
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
WHEELS="pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
typing-extensions==4.16.0"
BUDGET_BYTES=$((16 * 1024 * 1024))
mkdir -p .whl
rm -f .whl/*.whl                # one version of each: two would stop the install there
# shellcheck disable=SC2086
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl $WHEELS
total=$(cat .whl/*.whl | wc -c)
echo "$(ls .whl/*.whl | wc -l) wheels in .whl/, $total bytes"
if [ "$total" -gt "$BUDGET_BYTES" ]; then
    echo "the wheels exceed their budget of $BUDGET_BYTES bytes" >&2
    exit 1
fi
