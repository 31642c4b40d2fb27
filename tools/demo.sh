#!/usr/bin/env bash
# The ComputeDomains demo (`make demo`): a simulated two-rack NVL72 cluster running three jobs;
# a kubelet-plugin "upgrade" (30 s down) that running jobs do not notice; a whole node killed under
# one job and brought back; teardown and the invariants.
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
say "Every tray runs two real processes: the kubelet plugin (DRA sockets, CDI) and the IMEX agent" \
    "(node record on its lease, the IMEX daemons), next to etcd, two leader-elected domain" \
    "controllers and the placement advisor. cdsim plays kubelet: it calls each plugin's DRA" \
    "socket exactly as kubelet would. As in production, etcd takes only TLS clients with a" \
    "certificate (one etcd user and role per component) and the advisor only mutual TLS; every" \
    "command finds its certificate in the state directory."
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

step "Each job's workload imports memory from every other node of its domain (IMEX imports)"
say "An import stays valid only while its exporter is the same IMEX daemon instance: a restarted" \
    "daemon would break the job. 'cdsim job check' asks every daemon."
for job in train-a train-b infer-c; do cdsim job check "$job"; done

UPGRADED=$(node_of_job train-a)
step "Upgrade: the kubelet plugin of ${UPGRADED} (a member of train-a) is killed and down for 30 s"
say "The plugin holds no lease and runs no daemon, so nothing of the running job changes."
PIDS_BEFORE=$(cdsim status --json | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(sorted((n["name"], n["index"], n["daemon_pid"]) for x in d["domains"] for n in x["nodes"]))')
cdsim fault kill-agent "$UPGRADED" --down-for 30
for second in 5 10 15 20 25; do
    sleep 5
    cdsim job wait train-a --status Ready --timeout 1 >/dev/null
    printf '    %2d s after the kill: train-a Ready, ' "$second"; cdsim job check train-a
done
PIDS_AFTER=$(cdsim status --json | "$PY" -c 'import json,sys; d=json.load(sys.stdin); print(sorted((n["name"], n["index"], n["daemon_pid"]) for x in d["domains"] for n in x["nodes"]))')
[ "$PIDS_BEFORE" = "$PIDS_AFTER" ] || { echo "indices or IMEX daemon pids changed"; exit 1; }
say "Indices and IMEX daemon pids of every member: unchanged."

VICTIM=$(node_of_job train-b)
step "Fault: the whole node ${VICTIM} (a member of train-b) dies for 20 s"
say "Its plugin, IMEX agent and IMEX daemon are killed; its address stops answering. Once its" \
    "lease expires and its peers lose it, train-b reports NodeLost. Nothing is reconfigured:" \
    "no peer is restarted or signalled, no index moves."
cdsim fault kill-node "$VICTIM" --down-for 20
cdsim job wait train-b --status NotReady --reason NodeLost --timeout 10
echo
cdctl describe domain train-b
say "The other jobs are untouched:"
cdsim job check train-a
cdsim job check infer-c

step "Recovery: the node comes back and takes its old index again"
cdsim job wait train-b --status Ready --timeout 60
cdsim status --json | "$PY" -c '
import json, sys
doc = json.load(sys.stdin)
node = sys.argv[1]
entry = next(n for d in doc["domains"] if d["name"] == "train-b" for n in d["nodes"] if n["name"] == node)
print("    %s: index %s, member %s, daemon %s" % (node, entry["index"], entry["member_state"], entry["daemon"]))
' "$VICTIM"
cdsim check

step "Delete the jobs: kubelet unprepares every claim, the controller tears each domain down"
for job in train-a train-b infer-c; do
    cdsim job delete "$job" --wait
done

step "Invariants (docs/state-model.md) after teardown: store, node-local files (CDI specs, IMEX configs," \
    "checkpoints) and IMEX processes"
cdsim check --idle

step "Stop everything"
cdsim down

step "Demo finished in $((SECONDS - STARTED)) s: three jobs ran, a plugin upgrade changed nothing," \
    "a lost node was reported and took its index back, and nothing was left behind."
