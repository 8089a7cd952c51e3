#!/usr/bin/env bash
# gpu_check.sh: check gradcomm's GPU backends (nccl, cupy-nccl, mpi with CUDA buffers) on a CUDA
# machine, in one command, in under 5 minutes on one GPU (after the packages are installed).
#
#   scripts/gpu_check.sh                  # make/reuse a venv, install what is missing, check
#   scripts/gpu_check.sh --python PY      # use this interpreter as it is (nothing installed)
#   scripts/gpu_check.sh --no-install     # use python3 as it is
#
# Environment: GPU_CHECK_VENV (default /tmp/gradcomm-gpu-venv; made with --system-site-packages,
# so a preinstalled CUDA torch is reused), GPU_CHECK_LOGS (default a new /tmp directory).
#
# Checks, one summary line each (PASS / FAIL / SKIP + reason):
#   gpu          an NVIDIA GPU is visible (else: SKIP, exit 2 -- nothing else runs)
#   install      torch with CUDA, cupy-cuda12x, mpi4py + mpich, pytest; gradcomm editable
#   cuda         torch sees CUDA and NCCL
#   cpu-tests    the always-on tests of tests/test_gpu.py and tests/test_mpi_device.py
#   gpu:<test>   each @pytest.mark.gpu test (nccl world_size 1 (2 with 2 GPUs), cupy-nccl under
#                mpiexec (one rank per GPU: NCCL's rule), mpi with CUDA buffers on 2 ranks
#                sharing GPU 0, the gradient manager on CUDA against one process)
#   bench:<b>    a short `python -m gradcomm.bench` all-reduce sweep per GPU backend
#   digits:<b>   examples/train_digits.py on CUDA (held-out accuracy in the line)
# Exit status: 0 all PASS/SKIP, 1 a FAIL, 2 no GPU.

set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
LOGS=${GPU_CHECK_LOGS:-$(mktemp -d /tmp/gradcomm-gpu-check.XXXXXX)}
mkdir -p "$LOGS"
VENV=${GPU_CHECK_VENV:-/tmp/gradcomm-gpu-venv}
PY=""
INSTALL=1
while [ $# -gt 0 ]; do
    case "$1" in
        --python) PY=$2; INSTALL=0; shift 2 ;;
        --no-install) INSTALL=0; shift ;;
        -h|--help) sed -n '2,25p' "$0"; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 64 ;;
    esac
done

SUMMARY=()
FAILED=0
START=$SECONDS

record() {  # record STATUS NAME REASON...
    local status=$1 name=$2
    shift 2
    local line
    line=$(printf '%-4s %-46s %s' "$status" "$name" "$*")
    SUMMARY+=("$line")
    echo "== $line"
    if [ "$status" = FAIL ]; then FAILED=1; fi
}

finish() {
    echo
    echo "==== gradcomm gpu_check summary ($((SECONDS - START)) s; logs in $LOGS) ===="
    printf '%s\n' "${SUMMARY[@]}"
    exit "$1"
}

tail_of() {  # the last non-empty line of a log, for a summary line
    grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-160
}

# ---------------------------------------------------------------------------------------- gpu
if ! command -v nvidia-smi >/dev/null 2>&1; then
    record SKIP gpu "no NVIDIA GPU here (nvidia-smi not found): nothing to check"
    finish 2
fi
if ! nvidia-smi -L >"$LOGS/nvidia-smi.log" 2>&1 || ! grep -q '^GPU' "$LOGS/nvidia-smi.log"; then
    record SKIP gpu "no NVIDIA GPU here (nvidia-smi lists none): nothing to check"
    finish 2
fi
NGPU=$(grep -c '^GPU' "$LOGS/nvidia-smi.log")
record PASS gpu "$NGPU GPU(s): $(head -n 1 "$LOGS/nvidia-smi.log" | cut -c1-80)"

# ------------------------------------------------------------------------------------ install
if [ "$INSTALL" = 1 ]; then
    if [ ! -x "$VENV/bin/python" ]; then
        python3 -m venv --system-site-packages "$VENV" >"$LOGS/venv.log" 2>&1 \
            || { record FAIL install "venv failed: $(tail_of "$LOGS/venv.log")"; finish 1; }
    fi
    PY="$VENV/bin/python"
    pip_install() {  # pip_install LABEL PACKAGE...
        local label=$1
        shift
        if ! timeout 900 "$PY" -m pip install -q "$@" >>"$LOGS/install.log" 2>&1; then
            record FAIL "install:$label" \
                "pip install $* failed (offline?): $(tail_of "$LOGS/install.log")"
            return 1
        fi
    }
    # torch from PyPI: the default wheel is the CUDA build. Kept if CUDA already works.
    "$PY" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null \
        || pip_install torch torch
    "$PY" -c 'import cupy' 2>/dev/null || pip_install cupy cupy-cuda12x
    "$PY" -c 'import mpi4py' 2>/dev/null || pip_install mpi mpi4py mpich
    "$PY" -c 'import pytest, pytest_timeout, sklearn, tqdm' 2>/dev/null \
        || pip_install test pytest pytest-timeout scikit-learn tqdm numpy
    pip_install gradcomm --no-deps -e "$REPO" && record PASS install "venv $VENV"
else
    PY=${PY:-python3}
    record SKIP install "using $PY as it is (--python/--no-install)"
fi

# --------------------------------------------------------------------------------------- cuda
if ! "$PY" - >"$LOGS/cuda.log" 2>&1 <<'EOF'
import torch, torch.distributed as dist
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
assert dist.is_nccl_available(), "this torch has no NCCL"
nccl = ".".join(map(str, torch.cuda.nccl.version()))
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, "
      f"{torch.cuda.device_count()} device(s): {torch.cuda.get_device_name(0)}")
EOF
then
    record FAIL cuda "$(tail_of "$LOGS/cuda.log")"
    finish 1
fi
record PASS cuda "$(tail_of "$LOGS/cuda.log")"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
PYBIN=$(dirname "$PY")
MPIEXEC=$(command -v "$PYBIN/mpiexec" || command -v mpiexec || true)
MPIRUN=("$MPIEXEC")
if [ -n "$MPIEXEC" ] && "$MPIEXEC" --version 2>/dev/null | grep -q 'Open MPI\|OpenRTE'; then
    MPIRUN+=(--allow-run-as-root --oversubscribe)
fi

# -------------------------------------------------------------------------------------- tests
timeout 240 "$PY" -m pytest -q -p no:cacheprovider -m 'not gpu' \
    tests/test_gpu.py tests/test_mpi_device.py >"$LOGS/cpu-tests.log" 2>&1
rc=$?
if [ $rc = 0 ]; then record PASS cpu-tests "$(tail_of "$LOGS/cpu-tests.log")"
else record FAIL cpu-tests "rc=$rc: $(tail_of "$LOGS/cpu-tests.log")"; fi

timeout 300 "$PY" -m pytest -v -p no:cacheprovider -rs -m gpu --junitxml="$LOGS/gpu-tests.xml" \
    tests/test_gpu.py >"$LOGS/gpu-tests.log" 2>&1
rc=$?
if [ ! -s "$LOGS/gpu-tests.xml" ]; then
    record FAIL gpu-tests "rc=$rc, no report: $(tail_of "$LOGS/gpu-tests.log")"
else
    while IFS= read -r line; do
        # shellcheck disable=SC2086
        record ${line%%|*} "$(echo "$line" | cut -d'|' -f2)" "$(echo "$line" | cut -d'|' -f3-)"
    done < <("$PY" - "$LOGS/gpu-tests.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

for case in ET.parse(sys.argv[1]).iter("testcase"):
    status, why = "PASS", "%.1f s" % float(case.get("time", 0))
    for tag, label in (("failure", "FAIL"), ("error", "FAIL"), ("skipped", "SKIP")):
        node = case.find(tag)
        if node is not None:
            message = (node.get("message") or tag).strip().splitlines() or [tag]
            status, why = label, message[0][:150]
            break
    print("%s|gpu:%s|%s" % (status, case.get("name"), why))
EOF
)
fi

# -------------------------------------------------------------------------------------- bench
BENCH_ARGS=(-b 1K -e 16M -f 4 -n 10 -w 3 -r 1 --timeout 60)
if ! "$PY" -m gradcomm.bench --help 2>/dev/null | grep -q -- '--device'; then
    for b in nccl cupy-nccl mpi; do
        record SKIP "bench:$b" "gradcomm.bench has no --device option: its buffers are on the CPU"
    done
else
    run_bench() {  # run_bench NAME LAUNCHER...
        local name=$1
        shift
        if timeout 120 "$@" -m gradcomm.bench --backend "$name" --device cuda "${BENCH_ARGS[@]}" \
                >"$LOGS/bench-$name.log" 2>&1; then
            local last
            last=$(grep -E '^[[:space:]]*[0-9]' "$LOGS/bench-$name.log" | tail -n 1 | tr -s ' ')
            record PASS "bench:$name" "largest size: ${last:0:110}"
        else
            record FAIL "bench:$name" "$(tail_of "$LOGS/bench-$name.log")"
        fi
    }
    if [ "$NGPU" -ge 2 ]; then
        run_bench nccl "$PY" -m torch.distributed.run --nproc-per-node 2
        if [ -n "$MPIEXEC" ]; then run_bench cupy-nccl "${MPIRUN[@]}" -n 2 "$PY"; fi
    else
        for b in nccl cupy-nccl; do
            record SKIP "bench:$b" "one GPU: NCCL takes one rank per GPU; 1 rank sends nothing"
        done
    fi
    if [ -n "$MPIEXEC" ]; then
        run_bench mpi "${MPIRUN[@]}" -n 2 "$PY"
    else
        record SKIP bench:mpi "no mpiexec"
    fi
fi

# ------------------------------------------------------------------------------------- digits
EX=examples/train_digits.py
DEVICE_OPT=()
if "$PY" "$EX" --help 2>/dev/null | grep -q -- '--device'; then DEVICE_OPT=(--device cuda); fi
run_digits() {  # run_digits LABEL BACKEND LAUNCHER...
    local label=$1 backend=$2
    shift 2
    if timeout 150 "$@" "$EX" --backend "$backend" ${DEVICE_OPT[@]+"${DEVICE_OPT[@]}"} --epochs 10 \
            >"$LOGS/digits-$label.log" 2>&1; then
        local acc
        acc=$(grep -i 'accuracy' "$LOGS/digits-$label.log" | tail -n 1)
        record PASS "digits:$label" "${acc:0:110}"
    else
        record FAIL "digits:$label" "$(tail_of "$LOGS/digits-$label.log")"
    fi
}
run_digits nccl-1 nccl "$PY"
if [ "$NGPU" -ge 2 ]; then
    run_digits nccl-torchrun-2 nccl "$PY" -m torch.distributed.run --nproc-per-node 2
    if [ -n "$MPIEXEC" ]; then
        run_digits cupy-nccl-mpiexec-2 cupy-nccl "${MPIRUN[@]}" -n 2 "$PY"
    fi
else
    run_digits cupy-nccl-1 cupy-nccl "$PY"
fi
if [ ${#DEVICE_OPT[@]} -eq 0 ]; then
    record SKIP digits:mpi-cuda "train_digits.py has no --device option: mpi would use the CPU"
elif [ -n "$MPIEXEC" ]; then
    run_digits mpi-cuda-mpiexec-2 mpi "${MPIRUN[@]}" -n 2 "$PY"
fi

finish "$FAILED"
