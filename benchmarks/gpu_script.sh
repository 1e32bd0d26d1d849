# Sourced by the unattended one-GPU scripts (`*_gpu.sh`): their output folder, interpreter, working directory and
# one way to run a capped part (`run`), and of a part that runs tests (`run_tests`). Not run by itself.
#
#     source "$(dirname "$0")/gpu_script.sh" "$@"      # $1: OUT_DIR, default $OUT; PYTHON=... (default: python)
set -u
mkdir -p "${1:-${OUT:?usage: bash $0 OUT_DIR (or set OUT)}}"
out=$(cd "${1:-$OUT}" && pwd)
python=${PYTHON:-python}
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD:$PWD/tests:$PWD/benchmarks${PYTHONPATH:+:$PYTHONPATH}"

run() {  # name, seconds, command...: its output in OUT_DIR/name.log, its exit status in OUT_DIR/status.txt
    local name=$1 seconds=$2
    shift 2
    local start=$SECONDS
    timeout "$seconds" "$@" > "$out/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - start)) s" | tee -a "$out/status.txt"
}

run_tests() {  # name, seconds, pytest arguments...: `run` of pytest, each test capped at half the part (pytest-timeout),
    # so that one slow test fails alone and the part still ends with every failure's short traceback in its log
    local name=$1 seconds=$2
    shift 2
    run "$name" "$seconds" "$python" -m pytest -q -rfEs --tb=short -p no:cacheprovider --timeout $((seconds / 2)) "$@"
}
