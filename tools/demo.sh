#!/usr/bin/env bash
# The ComputeDomains demo (`make demo`): a simulated two-rack NVL72 cluster running three jobs,
# a node agent killed under one of them, recovery, teardown and the SPEC §4 invariants.
#
# Usage: tools/demo.sh            (after `make setup`; takes about a minute)
# Environment: PYTHON (default .venv/bin/python), CDSIM_STATE_DIR (default <tmp>/cdsim-demo-<uid>).
set -euo pipefail

cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
export CDSIM_STATE_DIR="${CDSIM_STATE_DIR:-${TMPDIR:-/tmp}/cdsim-demo-$(id -u)}"
export PYTHONPATH="${PWD}${PYTHONPATH:+:$PYTHONPATH}"
STARTED=$SECONDS

cdsim() { "$PY" -m tools.cdsim.main "$@"; }
cdctl() { "$PY" -m tools.cdctl.main "$@"; }

bold=""; reset=""
if [ -t 1 ]; then bold=$'\033[1m'; reset=$'\033[0m'; fi
step() { printf '\n%s==> %s%s\n' "$bold" "$*" "$reset"; }
say() { printf '    %s\n' "$@"; }

cleanup() {
    status=$?
    if [ "$status" -ne 0 ]; then
        printf '\n%sDEMO FAILED (exit %s).%s Logs of every process: %s/logs\n' "$bold" "$status" "$reset" "$CDSIM_STATE_DIR"
        cdsim down >/dev/null 2>&1 || true
    fi
    exit "$status"
}
trap cleanup EXIT

# A node of a job, from `cdsim status --json` (the first node of the job's claims).
node_of_job() {
    cdsim status --json | "$PY" -c '
import json, sys
doc = json.load(sys.stdin)
job = next(j for j in doc["jobs"] if j["name"] == sys.argv[1])
print(job["claims"][0]["node"])
' "$1"
}

step "ComputeDomains demo: two simulated GB200 NVL72 racks (36 compute trays, 144 GPUs)"
say "Every tray runs a real node agent process (the kubelet DRA plugin + IMEX daemon supervisor)," \
    "next to etcd, two leader-elected domain controllers and the placement advisor." \
    "cdsim plays kubelet: it calls each node agent's DRA socket exactly as kubelet would."
cdsim down >/dev/null 2>&1 || true
cdsim up --racks 2

step "Submit three jobs: 18, 8 and 4 nodes"
say "For each job: the advisor picks nodes inside one NVLink clique, cdsim creates the" \
    "ComputeDomain and one channel claim per node, and prepares the claims on the chosen nodes." \
    "Each node joins the domain, gets its index, starts its IMEX daemon; the domain turns Ready."
for spec in "train-a 18" "train-b 8" "infer-c 4"; do
    set -- $spec
    echo
    cdsim job submit "$1" --nodes "$2" --wait
done

step "The cluster now (one character per tray: the letter is the domain using it)"
cdsim status
echo
cdctl get domains

VICTIM=$(node_of_job train-b)
step "Fault: SIGKILL the node agent of ${VICTIM} (a member of train-b), keep it down for 10 s"
say "Its IMEX daemon keeps running, but its node record lives on a 5 s etcd lease." \
    "When the lease expires the controller marks the node lost and train-b reports NodeLost."
cdsim fault kill-agent "$VICTIM" --down-for 10
cdsim job wait train-b --status NotReady --reason NodeLost --timeout 30
echo
cdctl describe domain train-b

step "Recovery: the supervisor restarts the agent (as a DaemonSet would); it rejoins from its checkpoint"
cdsim job wait train-b --status Ready --timeout 60
cdsim job wait train-a --status Ready --timeout 10
cdsim job wait infer-c --status Ready --timeout 10
cdsim check

step "Delete the jobs: kubelet unprepares every claim, the controller tears each domain down"
for job in train-a train-b infer-c; do
    cdsim job delete "$job" --wait
done

step "Invariants (SPEC §4) after teardown: store, node-local files (CDI specs, IMEX configs," \
    "checkpoints) and IMEX processes"
cdsim check --idle

step "Stop everything"
cdsim down

step "Demo finished in $((SECONDS - STARTED)) s: three jobs ran, a lost node was reported and recovered," \
    "and nothing was left behind."
