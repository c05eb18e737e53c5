#!/usr/bin/env bash
# Start a real one-node SLURM cluster on this machine for the executor tests and the benchmark:
# munged as the `munge` user, slurmctld and slurmd as root, state and spool under DIR, one node
# (this host, CPUs=2) in two partitions, `main` (the default) and `spare`, so that the hardware
# axis has two values. Needs root and Debian's slurm-wlm + munge. Idempotent: a cluster already
# answering under DIR is kept. Prints the line to source: export SLURM_CONF=DIR/slurm.conf
#   usage: tests/cluster/slurm_up.sh [DIR]        (default /tmp/nandoctor-slurm)
#          tests/cluster/slurm_up.sh --down [DIR]
set -euo pipefail
if [ "${1:-}" = "--down" ]; then
    DIR=${2:-/tmp/nandoctor-slurm}
    for name in slurmd slurmctld; do
        [ -f "$DIR/$name.pid" ] && kill "$(cat "$DIR/$name.pid")" 2>/dev/null || true
    done
    exit 0
fi
DIR=${1:-/tmp/nandoctor-slurm}
HOST=$(hostname -s)
mkdir -p "$DIR/state" "$DIR/spool"
export SLURM_CONF="$DIR/slurm.conf"

if ! pgrep -u munge -x munged >/dev/null; then
    mkdir -p /run/munge /var/log/munge /var/lib/munge
    [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
    chown -R munge:munge /etc/munge /run/munge /var/log/munge /var/lib/munge
    chmod 0400 /etc/munge/munge.key
    runuser -u munge -- /usr/sbin/munged
fi

if [ -f "$SLURM_CONF" ] && timeout 5 scontrol ping 2>/dev/null | grep -q UP \
        && timeout 5 sinfo -h -o %T 2>/dev/null | grep -qE "idle|mix|alloc"; then
    echo "export SLURM_CONF=$SLURM_CONF"
    exit 0
fi

cat > "$SLURM_CONF" <<CONF
ClusterName=nandoctor
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=6817
SlurmdPort=6818
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
    if sinfo -h -o %T 2>/dev/null | grep -qE "^(idle|mix|alloc)"; then
        echo "export SLURM_CONF=$SLURM_CONF"
        exit 0
    fi
    sleep 0.5
done
echo "slurm did not come up; see $DIR/slurmctld.log and $DIR/slurmd.log" >&2
exit 1
