#!/usr/bin/env bash
# Start a real one-node SLURM cluster on this machine for the executor tests and the benchmarks:
# munged as the `munge` user (one munged serves every cluster on the host), slurmctld and slurmd as
# root, with state, spool, pid files and logs under DIR and a pair of TCP ports free when it starts
# (from 6817, SLURM's default, upwards), so that it runs beside any other SLURM on this host; one node
# (this host, CPUs=2) in two partitions, `main` (the default) and `spare`, so that the hardware axis
# has two values. Needs root and Debian's slurm-wlm + munge. Idempotent: the cluster of DIR, when its
# daemons still run and answer, is kept. Prints the line to source: export SLURM_CONF=DIR/slurm.conf
#   usage: tests/cluster/slurm_up.sh [DIR]        (default /tmp/nandoctor-slurm)
#          tests/cluster/slurm_up.sh --down [DIR] (cancels the jobs of DIR's cluster, waits for them to
#                                                  end, stops its daemons; nothing of another cluster)
set -euo pipefail
running() {  # the daemon whose pid file DIR holds runs, started for DIR (its SLURM_CONF): not a pid reused
    local pid
    pid=$(cat "$DIR/$1.pid" 2>/dev/null) || return 1
    [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] \
        && tr '\0' '\n' <"/proc/$pid/environ" 2>/dev/null | grep -xF "SLURM_CONF=$DIR/slurm.conf" >/dev/null
}
if [ "${1:-}" = "--down" ]; then
    DIR=$(cd "${2:-/tmp/nandoctor-slurm}" 2>/dev/null && pwd) || exit 0
    export SLURM_CONF="$DIR/slurm.conf"
    if running slurmctld; then  # its jobs first: slurmd's job steps outlive slurmd
        timeout 10 scancel --user="$(id -un)" 2>/dev/null || true
        for _ in $(seq 1 100); do
            [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
    for name in slurmd slurmctld; do
        if running "$name"; then
            kill "$(cat "$DIR/$name.pid")"
            for _ in $(seq 1 100); do running "$name" || break; sleep 0.1; done  # a zombie's environ is empty
        fi
    done
    exit 0
fi
DIR=${1:-/tmp/nandoctor-slurm}
mkdir -p "$DIR/state" "$DIR/spool"
DIR=$(cd "$DIR" && pwd)
HOST=$(hostname -s)
export SLURM_CONF="$DIR/slurm.conf"

if ! pgrep -u munge -x munged >/dev/null; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
    chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged
fi

# Ours answers: both daemons of DIR run, and the controller that answers keeps its state in DIR
# (not another cluster's controller, on a port ours held once).
if [ -f "$SLURM_CONF" ] && running slurmctld && running slurmd \
        && [ "$(timeout 5 scontrol show config 2>/dev/null | awk '$1 == "StateSaveLocation" {print $3}')" = "$DIR/state" ] \
        && timeout 5 sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc"; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
fi
"$0" --down "$DIR"  # a half-started cluster of DIR

# Two consecutive ports that nothing listens on (checked by binding them, as the daemons will).
PORTS=$(python3 - <<'PY'
import socket
def free(port):
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True
print(next((f"{p} {p + 1}" for p in range(6817, 7817, 2) if free(p) and free(p + 1)), ""))
PY
)
if [ -z "$PORTS" ]; then
    echo "no two free TCP ports between 6817 and 7817 for slurmctld and slurmd" >&2
    exit 3
fi
read -r CTLD_PORT SLURMD_PORT <<<"$PORTS"

cat > "$SLURM_CONF" <<CONF
ClusterName=nandoctor
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_min_interval=0,bf_interval=1
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=600
KillWait=2
InactiveLimit=0
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=main Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
PartitionName=spare Nodes=$HOST MaxTime=INFINITE State=UP
CONF

/usr/sbin/slurmctld -c   # -c: a clean start, no jobs from an earlier life of DIR
/usr/sbin/slurmd
for _ in $(seq 1 60); do
    if running slurmctld && running slurmd && sinfo -h -o %T 2>/dev/null | grep -qE "^(idle|mix|alloc)"; then
        echo "export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.5
done
echo "slurm did not come up on ports $CTLD_PORT and $SLURMD_PORT; see $DIR/slurmctld.log and $DIR/slurmd.log" >&2
"$0" --down "$DIR"
exit 1
