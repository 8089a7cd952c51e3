#!/usr/bin/env bash
# fault_tolerance_demo.sh: a failed worker costs one step, not the job.
#
#   examples/fault_tolerance_demo.sh
#
# On this host: trains examples/train_digits.py once in one process (the reference), starts the
# coordinator (python -m gradcomm.elastic) and 4 workers of the same script with
# --elastic, kills one with SIGKILL at step 30, starts a replacement at step 60, and waits. Then
# it prints, for each worker, what the worker printed: its final held-out accuracy, its
# parameters' sha256, "applied steps N" and "matches one-process run: True|False (max rel diff
# D)", and the seconds from the kill to the survivors' next completed step. It exits 0 only when
# every worker that was not killed finished and matches the one-process run.
#
# Settings (environment): PYTHON (default python3), KILL_AT (30), JOIN_AT (60), STEP_DELAY
# (0.1 s slept after each step, so that the replacement, which takes seconds to start on a busy
# machine, joins before the 230 steps are over: a worker that comes after the end raises
# ElasticError and the demo fails), DEMO_TIMEOUT (300 s for the whole run). Workers use the
# documented settings: --timeout 10 --heartbeat-timeout 2. Logs stay in the folder printed first.

set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
PY=${PYTHON:-python3}
KILL_AT=${KILL_AT:-30}
JOIN_AT=${JOIN_AT:-60}
STEP_DELAY=${STEP_DELAY:-0.1}
DEMO_TIMEOUT=${DEMO_TIMEOUT:-300}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gradcomm-ft-demo.XXXXXX")
DEADLINE=$((SECONDS + DEMO_TIMEOUT))
echo "logs: $WORK"

declare -a PIDS=()
COORD=""
cleanup() {
    for pid in "${PIDS[@]}" $COORD; do kill -9 "$pid" 2>/dev/null; done
}
trap cleanup EXIT

fail() { echo "FAILED: $*"; exit 1; }

# The highest step any worker has completed (-1 before the first).
step() {
    if [ -f "$WORK/progress" ]; then
        awk 'BEGIN { m = -1 } $2 > m { m = $2 } END { print m }' "$WORK/progress"
    else
        echo -1
    fi
}

wait_for_step() {
    while [ "$(step)" -lt "$1" ]; do
        [ $SECONDS -lt $DEADLINE ] || fail "the job did not reach step $1 within ${DEMO_TIMEOUT} s"
        sleep 0.05
    done
}

start_worker() {
    "$PY" examples/train_digits.py --elastic --world-size 4 --min-world-size 2 --timeout 10 \
        --heartbeat-timeout 2 --step-delay "$STEP_DELAY" --progress "$WORK/progress" \
        --reference "$WORK/reference.pt" > "$WORK/worker$1.log" 2>&1 &
    PIDS[$1]=$!
}

echo "the one-process run (the reference) ..."
"$PY" examples/train_digits.py --save-params "$WORK/reference.pt" > "$WORK/reference.log" 2>&1 \
    || fail "the one-process run failed: see $WORK/reference.log"

"$PY" -m gradcomm.elastic --host 127.0.0.1 --port 0 \
    --address-file "$WORK/coordinator" > "$WORK/coordinator.log" 2>&1 &
COORD=$!
until [ -s "$WORK/coordinator" ]; do
    [ $SECONDS -lt $DEADLINE ] && kill -0 $COORD 2>/dev/null || fail "the coordinator did not start"
    sleep 0.05
done
export GRADCOMM_COORDINATOR
GRADCOMM_COORDINATOR=$(cat "$WORK/coordinator")
echo "coordinator at $GRADCOMM_COORDINATOR; starting 4 workers ..."
for i in 0 1 2 3; do start_worker $i; done

wait_for_step "$KILL_AT"
kill -9 "${PIDS[2]}"
KILL_TIME=$(date +%s.%N)
wait "${PIDS[2]}" 2>/dev/null  # reaped here, without the shell's "Killed" notice
KILLED_AT=$(step)
echo "step $KILLED_AT: killed worker 2 (SIGKILL)"

wait_for_step "$JOIN_AT"
echo "step $(step): starting worker 4, the replacement"
start_worker 4

status=0
for i in 0 1 3 4; do
    while kill -0 "${PIDS[$i]}" 2>/dev/null; do
        [ $SECONDS -lt $DEADLINE ] || fail "worker $i did not finish within ${DEMO_TIMEOUT} s"
        sleep 0.1
    done
    wait "${PIDS[$i]}" || status=1
done
kill "$COORD" 2>/dev/null

echo
for i in 0 1 2 3 4; do
    if [ "$i" = 2 ]; then
        echo "worker 2: killed (SIGKILL) at step $KILLED_AT"
        continue
    fi
    echo "worker $i:"
    grep -E "^(final held-out accuracy|parameters sha256|applied steps|matches one-process run)" \
        "$WORK/worker$i.log" | sed 's/^/    /'
    [ "$(grep -c "^matches one-process run: True" "$WORK/worker$i.log")" = 1 ] || status=1
done
RECOVERY=$(awk -v t="$KILL_TIME" '$1 > t && $3 == 3 { print $1 - t; exit }' "$WORK/progress")
echo "seconds from the kill to the survivors' next completed step: ${RECOVERY:-none}"
[ -n "$RECOVERY" ] || status=1
if [ $status = 0 ]; then
    echo "OK: every worker finished with the one-process run's parameters"
else
    echo "FAILED: a worker failed or differs from the one-process run (logs: $WORK)"
fi
exit $status
