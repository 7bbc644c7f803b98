#!/usr/bin/env bash
# SLURM clusters for tests and for trying distc under srun and sbatch:
#
#   scripts/slurm-local.sh start DIR [PORT]   a cluster of this machine: writes
#                                             DIR/slurm.conf, starts slurmctld and slurmd
#                                             (node `local`, 8 CPUs), waits until the node
#                                             is idle
#   scripts/slurm-local.sh stop DIR           stops both (scontrol shutdown, then kill)
#   scripts/slurm-local.sh conf DIR PORT CONTROLLER_ADDR NAME=ADDR...
#                                             only writes DIR/slurm.conf, for nodes at
#                                             those addresses (compiler/tests/netns.rs
#                                             starts the daemons in its namespaces)
#
# Then `SLURM_CONF=DIR/slurm.conf srun ...` or `sbatch ...`. Everything the daemons
# write (state, spool, logs, pid files, per node) stays under DIR. Authentication is
# auth/none: clusters of one machine, run by root, on addresses of their own. Each
# node declares 8 CPUs whatever the machine has (config_overrides), so a job may run
# more ranks than cores, as `mpirun --oversubscribe` does. PORT (default 16817) and
# PORT+1 are the daemons' ports.
set -euo pipefail

cmd="${1:-}"
dir="${2:-}"
if [ -z "$cmd" ] || [ -z "$dir" ]; then
    echo "usage: $0 start|stop|conf DIR ..." >&2
    exit 2
fi
mkdir -p "$dir"
dir="$(cd "$dir" && pwd)"
conf="$dir/slurm.conf"

# write_conf PORT CONTROLLER_ADDR NAME=ADDR...
write_conf() {
    local port="$1" ctld="$2"
    shift 2
    mkdir -p "$dir/state"
    cat >"$conf" <<CONF
ClusterName=distc
SlurmctldHost=localhost($ctld)
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/builtin
SlurmdParameters=config_overrides
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool-%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
SlurmctldPort=$port
SlurmdPort=$((port + 1))
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
CONF
    local node
    for node in "$@"; do
        echo "NodeName=${node%%=*} NodeAddr=${node#*=} CPUs=8 State=UNKNOWN" >>"$conf"
        mkdir -p "$dir/spool-${node%%=*}"
    done
    echo "PartitionName=all Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES" >>"$conf"
}

case "$cmd" in
start)
    port="${3:-16817}"
    write_conf "$port" 127.0.0.1 local=127.0.0.1
    slurmctld -f "$conf"
    slurmd -f "$conf" -N local
    for _ in $(seq 1 100); do
        if SLURM_CONF="$conf" sinfo -h -o %t 2>/dev/null | grep -qx idle; then
            echo "slurm-local: up, SLURM_CONF=$conf"
            exit 0
        fi
        sleep 0.2
    done
    echo "slurm-local: the node did not become idle within 20 s; logs in $dir" >&2
    tail -n 5 "$dir/slurmctld.log" "$dir"/slurmd-*.log >&2 || true
    exit 1
    ;;
stop)
    SLURM_CONF="$conf" scontrol shutdown >/dev/null 2>&1 || true
    for pid_file in "$dir"/slurmd-*.pid "$dir/slurmctld.pid"; do
        if [ -f "$pid_file" ]; then
            pid="$(cat "$pid_file")"
            for _ in $(seq 1 50); do
                kill -0 "$pid" 2>/dev/null || break
                sleep 0.1
            done
            kill -9 "$pid" 2>/dev/null || true
        fi
    done
    ;;
conf)
    [ "$#" -ge 5 ] || { echo "usage: $0 conf DIR PORT CONTROLLER_ADDR NAME=ADDR..." >&2; exit 2; }
    port="$3" ctld="$4"
    shift 4
    write_conf "$port" "$ctld" "$@"
    ;;
*)
    echo "usage: $0 start|stop|conf DIR ..." >&2
    exit 2
    ;;
esac
