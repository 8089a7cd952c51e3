#!/usr/bin/env bash
# gpu_check.sh: prove gradcomm's GPU paths on a CUDA machine in one run of at most 540 s.
#
#   scripts/gpu_check.sh              # run every check (needs a GPU)
#   scripts/gpu_check.sh --dry-run    # list the checks, their budgets and what is here; exit 0
#
# Uses the machine's Python as it is (GPU_CHECK_PYTHON, default python3): no virtual environment,
# no network. MPI comes from wheels carried in the working tree (GPU_CHECK_WHEELS, default
# wheels/, gitignored), unpacked into a scratch folder and put on PATH/LD_LIBRARY_PATH/PYTHONPATH:
#   pip download mpich mpi4py --only-binary=:all: --no-deps -d wheels/ \
#       --python-version 3.X --platform manylinux_2_28_x86_64     # X: the GPU machine's Python
# and carry "wheels" with the working tree. An mpi4py and mpiexec already installed are used as
# they are. The digits example also needs scikit-learn and tqdm there (see docs/gpu.md).
#
# Output: one line per check, "PASS|FAIL|SKIP name (used/budget s) reason [versions]"; every log
# in one archive, $OUT/gpu_check_logs.tar.gz (OUT defaults to ./out). Exit 1 on any FAIL (a
# missing piece a check needs is a FAIL), else 0. Each check has a budget (its timeout) and the
# whole run a deadline of GPU_CHECK_DEADLINE_S seconds (default 540).

set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
PY=${GPU_CHECK_PYTHON:-python3}
WHEELS=${GPU_CHECK_WHEELS:-$REPO/wheels}
OUTDIR=${OUT:-$REPO/out}
DEADLINE_S=${GPU_CHECK_DEADLINE_S:-540}
DRY=0
case "${1:-}" in
    --dry-run) DRY=1 ;;
    "") ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 64 ;;
esac

# name:budget (seconds), in the order they run; the budgets add up to at most DEADLINE_S.
CHECKS=(
    env:30 mpi-setup:25 nccl-1:45 nccl-2-one-gpu:40 cupy-nccl-1:40 mpi-cuda-staged:45
    mpi-cuda-aware:40 reducer-mpi-cuda:60 bench-nccl:25 bench-cupy-nccl:25 bench-mpi:45
    digits-nccl-1:45 digits-mpi-cuda-2:60
)
TOTAL=0
for c in "${CHECKS[@]}"; do TOTAL=$((TOTAL + ${c##*:})); done

probe() {  # what is here: one "key: value" line each
    echo "python: $(command -v "$PY" || echo "$PY (not found)") $("$PY" -c 'import sys; print(sys.version.split()[0])' 2>/dev/null)"
    "$PY" - <<'EOF' 2>/dev/null || echo "torch: not importable"
import importlib.util
import torch
cuda = torch.cuda.is_available()
nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda else "n/a"
print(f"torch: {torch.__version__}, CUDA build {torch.version.cuda}, GPUs {torch.cuda.device_count() if cuda else 0}, NCCL {nccl}")
for mod in ("cupy", "mpi4py", "sklearn", "tqdm", "pytest"):
    spec = importlib.util.find_spec(mod)
    print(f"{mod}: {'installed' if spec else 'missing'}")
EOF
    echo "nvidia-smi: $(nvidia-smi -L 2>/dev/null | head -n 1 || true)"
    local bin
    bin=$(dirname "$(command -v "$PY" || echo "$PY")")
    echo "mpiexec: $(command -v mpiexec || { [ -x "$bin/mpiexec" ] && echo "$bin/mpiexec"; } || echo none)"
    local found
    found=$(ls "$WHEELS"/mpich-*.whl "$WHEELS"/mpi4py-*.whl 2>/dev/null | xargs -r -n1 basename | tr '\n' ' ')
    echo "wheels ($WHEELS): ${found:-none}"
}

if [ "$DRY" = 1 ]; then
    echo "gpu_check.sh --dry-run: checks and budgets (deadline $DEADLINE_S s)"
    for c in "${CHECKS[@]}"; do printf '  %-20s %4s s\n' "${c%%:*}" "${c##*:}"; done
    echo "environment:"
    probe | sed 's/^/  /'
    echo "total: $TOTAL s"
    if [ "$TOTAL" -gt "$DEADLINE_S" ]; then echo "budgets exceed the deadline" >&2; exit 1; fi
    exit 0
fi

LOGS=$(mktemp -d /tmp/gradcomm-gpu-check.XXXXXX)
mkdir -p "$OUTDIR"
START=$SECONDS
SUMMARY=()
FAILED=0
VERSIONS=""
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=2 PYTHONUNBUFFERED=1
# An mpiexec beside the interpreter (pip's mpich in a virtual environment) counts as installed.
PYBIN=$(dirname "$(command -v "$PY")")
[ -x "$PYBIN/mpiexec" ] && export PATH="$PYBIN:$PATH"

record() {  # record STATUS NAME BUDGET USED REASON...
    local status=$1 name=$2 budget=$3 used=$4
    shift 4
    local line
    line=$(printf '%-4s %-18s (%s/%s s) %s [%s]' "$status" "$name" "$used" "$budget" "$*" "$VERSIONS")
    SUMMARY+=("$line")
    echo "$line"
    if [ "$status" = FAIL ]; then FAILED=1; fi
}

finish() {
    echo "==== gradcomm gpu_check: $((SECONDS - START)) s ====" | tee "$LOGS/summary.txt"
    printf '%s\n' "${SUMMARY[@]}" | tee -a "$LOGS/summary.txt"
    tar czf "$OUTDIR/gpu_check_logs.tar.gz" -C "$LOGS" . 2>/dev/null
    echo "logs: $OUTDIR/gpu_check_logs.tar.gz"
    exit "$FAILED"
}

last_line() { grep -v '^[[:space:]]*$' "$1" 2>/dev/null | tail -n 1 | cut -c1-150; }

run_job() {  # run_job NAME BUDGET RANKS KIND CMD... ; KIND: job (RESULT lines), bench, digits
    local name=$1 budget=$2 ranks=$3 kind=$4
    shift 4
    local left=$((DEADLINE_S - (SECONDS - START)))
    if [ "$left" -lt 5 ]; then record FAIL "$name" "$budget" 0 "global deadline reached"; return; fi
    [ "$budget" -gt "$left" ] && budget=$left
    local log="$LOGS/$name.log" t0=$SECONDS rc
    echo "\$ $*" >"$log"
    timeout --kill-after=5 "$budget" "$@" >>"$log" 2>&1
    rc=$?
    local used=$((SECONDS - t0))
    if [ $rc = 124 ] || [ $rc = 137 ]; then
        record FAIL "$name" "$budget" "$used" "timed out (hung?): $(last_line "$log")"; return
    fi
    case "$kind" in
        job)
            local skip ok
            skip=$(grep -m1 -o 'RESULT [^ ]* skip: .*' "$log" | cut -d' ' -f4- | cut -c1-140)
            ok=$(grep -c 'RESULT [^ ]* ok ' "$log")
            if [ $rc = 0 ] && [ -n "$skip" ]; then record SKIP "$name" "$budget" "$used" "$skip"
            elif [ $rc = 0 ] && [ "$ok" = "$ranks" ]; then
                record PASS "$name" "$budget" "$used" \
                    "$(grep -m1 -o 'RESULT [^ ]* ok .*' "$log" | cut -d' ' -f4- | cut -c1-140)"
            else record FAIL "$name" "$budget" "$used" "rc=$rc, $ok/$ranks ok: $(last_line "$log")"; fi ;;
        bench)
            local verdict
            verdict=$(grep -m1 -o 'out of bounds values: .*' "$log")
            if [ $rc = 0 ] && [ "$verdict" = "out of bounds values: 0 OK" ]; then
                record PASS "$name" "$budget" "$used" "wrong results: 0; $(grep -E '^[[:space:]]*[0-9]' "$log" | tail -n 1 | tr -s ' ' | cut -c1-90)"
            else record FAIL "$name" "$budget" "$used" "rc=$rc ${verdict:-no verdict}: $(last_line "$log")"; fi ;;
        digits)
            local acc
            acc=$(grep -m1 -o 'final held-out accuracy: [0-9.]*' "$log" | awk '{print $NF}')
            if [ $rc = 0 ] && [ -n "$acc" ] && awk -v a="$acc" 'BEGIN{exit !(a >= 0.90)}'; then
                record PASS "$name" "$budget" "$used" "held-out accuracy $acc >= 0.90"
            else record FAIL "$name" "$budget" "$used" "rc=$rc accuracy ${acc:-none} (need 0.90): $(last_line "$log")"; fi ;;
    esac
}

budget_of() { local c; for c in "${CHECKS[@]}"; do [ "${c%%:*}" = "$1" ] && echo "${c##*:}"; done; }

# ------------------------------------------------------------------------------------- env
t0=$SECONDS
if timeout "$(budget_of env)" "$PY" - >"$LOGS/env.log" 2>&1 <<'EOF'
import torch
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
nccl = ".".join(map(str, torch.cuda.nccl.version()))
try:
    import cupy
    cp = cupy.__version__
except ImportError:
    cp = "missing"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}, CuPy {cp}; "
      f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
EOF
then
    VERSIONS=$(last_line "$LOGS/env.log" | cut -d';' -f1)
    record PASS env "$(budget_of env)" $((SECONDS - t0)) "$(last_line "$LOGS/env.log" | cut -d';' -f2-)"
else
    record FAIL env "$(budget_of env)" $((SECONDS - t0)) "$(last_line "$LOGS/env.log")"
    finish
fi

# ------------------------------------------------------------------------------- mpi-setup
t0=$SECONDS
MPI_OK=0
if "$PY" -c 'import mpi4py' 2>/dev/null && command -v mpiexec >/dev/null; then
    MPI_FROM="installed"
else
    MPI_DIR="$LOGS/mpi"
    TAG=$("$PY" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
    MPICH_WHL=$(ls "$WHEELS"/mpich-*.whl 2>/dev/null | head -n 1)
    MPI4PY_WHL=$(ls "$WHEELS"/mpi4py-*-"$TAG"-*.whl "$WHEELS"/mpi4py-*-abi3-*.whl 2>/dev/null | head -n 1)
    MPI_FROM="wheels $(basename "${MPICH_WHL:-none}") $(basename "${MPI4PY_WHL:-none}")"
    if [ -n "$MPICH_WHL" ] && [ -n "$MPI4PY_WHL" ]; then
        # A wheel is a zip: *.data/data/{bin,lib} go under MPI_DIR, the rest under MPI_DIR/site.
        "$PY" - "$MPI_DIR" "$MPICH_WHL" "$MPI4PY_WHL" >"$LOGS/mpi-unpack.log" 2>&1 <<'EOF'
import os, pathlib, sys, zipfile
dest = pathlib.Path(sys.argv[1])
for whl in sys.argv[2:]:
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            parts = info.filename.split("/")
            if parts[0].endswith(".data"):
                if len(parts) < 3 or parts[1] != "data":
                    continue
                target = dest.joinpath(*parts[2:])
            else:
                target = dest.joinpath("site", *parts)
            if info.is_dir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(z.read(info))
            os.chmod(target, ((info.external_attr >> 16) & 0o777) or 0o644)
EOF
        export PATH="$MPI_DIR/bin:$PATH" LD_LIBRARY_PATH="$MPI_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        export PYTHONPATH="$PYTHONPATH:$MPI_DIR/site"
    fi
fi
if timeout "$(budget_of mpi-setup)" mpiexec -n 2 "$PY" -c '
from mpi4py import MPI
from gradcomm.comm.backends.mpi.device import cuda_aware_mpi
if MPI.COMM_WORLD.Get_rank() == 0:
    aware, why = cuda_aware_mpi()
    print("MPI", MPI.Get_library_version().split(chr(10))[0].strip()[:40], "| cuda-aware", aware, "|", why[:80])
' >"$LOGS/mpi-setup.log" 2>&1; then
    MPI_OK=1
    VERSIONS="$VERSIONS, $(grep -m1 '^MPI' "$LOGS/mpi-setup.log" | cut -d'|' -f1-2 | tr -s ' ')"
    record PASS mpi-setup "$(budget_of mpi-setup)" $((SECONDS - t0)) "$MPI_FROM; $(grep -m1 '^MPI' "$LOGS/mpi-setup.log" | cut -d'|' -f3)"
else
    record FAIL mpi-setup "$(budget_of mpi-setup)" $((SECONDS - t0)) "no working MPI ($MPI_FROM): $(last_line "$LOGS/mpi-setup.log")"
fi

MPIRUN=(mpiexec -n 2)
if mpiexec --version 2>/dev/null | grep -q 'Open MPI'; then MPIRUN+=(--oversubscribe --allow-run-as-root); fi
mpi_job() {  # mpi_job NAME KIND CMD... : FAIL at once without MPI (a missing piece)
    local name=$1 kind=$2
    shift 2
    if [ "$MPI_OK" != 1 ]; then record FAIL "$name" "$(budget_of "$name")" 0 "needs MPI (see mpi-setup)"; return; fi
    run_job "$name" "$(budget_of "$name")" 2 "$kind" "${MPIRUN[@]}" "$@"
}
BENCH=(-m gradcomm.bench --device cuda -b 1K -e 4M -f 16 -n 5 -w 2 -r 1 --timeout 30)
JOB=tests/_support/gpu_jobs.py

# ---------------------------------------------------------------------------------- checks
run_job nccl-1 "$(budget_of nccl-1)" 1 job "$PY" "$JOB" nccl-1
CUDA_VISIBLE_DEVICES=0 run_job nccl-2-one-gpu "$(budget_of nccl-2-one-gpu)" 2 job \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 "$JOB" nccl-2-one-gpu
run_job cupy-nccl-1 "$(budget_of cupy-nccl-1)" 1 job "$PY" "$JOB" cupy-nccl-1
GRADCOMM_MPI_CUDA_AWARE=0 mpi_job mpi-cuda-staged job "$PY" "$JOB" mpi-cuda
mpi_job mpi-cuda-aware job "$PY" "$JOB" mpi-cuda-aware
mpi_job reducer-mpi-cuda job "$PY" "$JOB" reducer-mpi-cuda
run_job bench-nccl "$(budget_of bench-nccl)" 1 bench "$PY" "${BENCH[@]}" --backend nccl
run_job bench-cupy-nccl "$(budget_of bench-cupy-nccl)" 1 bench "$PY" "${BENCH[@]}" --backend cupy-nccl
mpi_job bench-mpi bench "$PY" "${BENCH[@]}" --backend mpi
run_job digits-nccl-1 "$(budget_of digits-nccl-1)" 1 digits \
    "$PY" examples/train_digits.py --backend nccl --device cuda --epochs 10
mpi_job digits-mpi-cuda-2 digits "$PY" examples/train_digits.py --backend mpi --device cuda --epochs 10

finish
