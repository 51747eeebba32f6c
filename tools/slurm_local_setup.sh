#!/usr/bin/env bash
# A one-node SLURM cluster on this Debian machine: this host is controller and compute node.
# Installs Debian's packages if missing (slurmd slurmctld slurm-client munge), writes
# /etc/slurm/slurm.conf with the node's real CPUs and memory, starts munged, slurmctld and
# slurmd by hand (containers run no service manager) and waits until `sinfo` shows the node
# idle. Idempotent: daemons it already started are left running. Run as root.
#
#   bash tools/slurm_local_setup.sh          # install if needed, configure, start, wait for idle
#   bash tools/slurm_local_setup.sh status   # exit 0 when the node answers and is usable
#   bash tools/slurm_local_setup.sh stop     # stop the daemons this script started (by pid)
#
# Environment (defaults in brackets):
#   SLURM_STATE_DIR  [/run/sao-slurm]  pids of the daemons started here
#   SLURM_LOG_DIR    [/var/log/slurm]  daemon logs (named in every error)
#   PARTITION        [debug]           the one partition (default partition)
#   NODE_CPUS        [nproc]           CPUs= of the node
#   NODE_MEM_MB      [MemTotal - 5%]   RealMemory= of the node (MB)
#   WAIT_S           [180]             how long to wait for each daemon / the idle node
#
# Choices: proctrack/linuxproc + task/none (no cgroups needed), select/cons_tres with CR_Core,
# no accounting database (`sacct` is unavailable), job completions in $SLURM_LOG_DIR/jobcomp.log,
# JobRequeue=1. The node is named "localhost" (slurmd -N localhost), whatever the hostname.
# GPUs are not declared as gres; on a GPU machine jobs still see every GPU (no cgroup confinement).
set -euo pipefail

STATE_DIR="${SLURM_STATE_DIR:-/run/sao-slurm}"
LOG_DIR="${SLURM_LOG_DIR:-/var/log/slurm}"
PARTITION="${PARTITION:-debug}"
WAIT_S="${WAIT_S:-180}"
CONF=/etc/slurm/slurm.conf
NODE=localhost

say() { echo "slurm_local_setup: $*"; }
die() { echo "slurm_local_setup: ERROR: $*" >&2; exit 1; }

running() {  # name -> 0 when the daemon this script started is alive
    local f="$STATE_DIR/$1.pid"
    [[ -f "$f" ]] && kill -0 "$(cat "$f")" 2>/dev/null
}

node_state() { sinfo -h -n "$NODE" -o %T 2>/dev/null | head -n 1 || true; }

case "${1:-start}" in
    stop)
        for name in slurmd slurmctld munged; do  # by recorded pid, never by process name
            running "$name" || { rm -f "$STATE_DIR/$name.pid"; continue; }
            pid="$(cat "$STATE_DIR/$name.pid")"
            say "stopping $name (pid $pid)"
            kill -TERM "$pid"
            for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
            rm -f "$STATE_DIR/$name.pid"
        done
        exit 0 ;;
    status)
        command -v sinfo >/dev/null || die "sinfo not installed (run: bash $0)"
        state="$(node_state)"
        [[ "$state" =~ ^(idle|mixed|allocated|completing) ]] || die "node state '${state:-none}'"
        say "node $NODE is $state"
        exit 0 ;;
    start) ;;
    *) die "unknown command '$1' (use: start, status, stop)" ;;
esac

[[ "$(id -u)" == 0 ]] || die "must run as root (installs packages, writes /etc/slurm)"

# 1. Packages.
if ! command -v slurmctld >/dev/null || ! command -v slurmd >/dev/null \
        || ! command -v sbatch >/dev/null || ! command -v munged >/dev/null; then
    command -v apt-get >/dev/null || die "no apt-get: install slurmd slurmctld slurm-client munge"
    say "installing slurmd slurmctld slurm-client munge (apt-get)"
    t0=$SECONDS
    apt-get update -q || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        slurmd slurmctld slurm-client munge || die "apt-get install failed"
    say "installed in $(( SECONDS - t0 )) s"
fi

# 2. munge: key and runtime folders (the Debian package normally creates the key).
install -d -o munge -g munge -m 0700 /etc/munge /var/lib/munge /var/log/munge
install -d -o munge -g munge -m 0755 /run/munge
if [[ ! -s /etc/munge/munge.key ]]; then
    mungekey --create --keyfile=/etc/munge/munge.key 2>/dev/null \
        || dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
fi
chown munge:munge /etc/munge/munge.key
chmod 0400 /etc/munge/munge.key

# 3. slurm.conf describing this machine.
NODE_CPUS="${NODE_CPUS:-$(nproc)}"
mem_mb=$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1024 ))
NODE_MEM_MB="${NODE_MEM_MB:-$(( mem_mb * 95 / 100 ))}"
install -d -m 0755 /etc/slurm /var/spool/slurmctld /var/spool/slurmd "$LOG_DIR" "$STATE_DIR"
new_conf="$(cat <<EOF
# One-node cluster written by tools/slurm_local_setup.sh (sao_megatron).
ClusterName=sao-local
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CryptoType=crypto/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
ReturnToService=2
JobRequeue=1
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=$STATE_DIR/slurmctld.daemon.pid
SlurmdPidFile=$STATE_DIR/slurmd.daemon.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG_DIR/jobcomp.log
KillWait=60
MinJobAge=600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$NODE_CPUS RealMemory=$NODE_MEM_MB State=UNKNOWN
PartitionName=$PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
EOF
)"
conf_changed=0
if [[ ! -f "$CONF" ]] || [[ "$(cat "$CONF")" != "$new_conf" ]]; then
    printf '%s\n' "$new_conf" > "$CONF"
    conf_changed=1
    say "wrote $CONF (CPUs=$NODE_CPUS RealMemory=${NODE_MEM_MB}MB)"
fi

# 4. Daemons, in the foreground mode (-D) under setsid, pids recorded in $STATE_DIR.
start() {  # name logfile command...
    local name="$1" logf="$2"; shift 2
    if running "$name"; then
        say "$name already running (pid $(cat "$STATE_DIR/$name.pid"))"
        return
    fi
    # Close every inherited descriptor above 2 first: a daemon must not hold its caller's open
    # files (a `flock` held by the caller would otherwise stay locked for the daemon's life).
    (
        for fd in /proc/self/fd/*; do
            n="${fd##*/}"
            (( n > 2 )) && eval "exec $n>&-" 2>/dev/null
        done
        exec setsid "$@"
    ) >>"$LOG_DIR/$name.stdout" 2>&1 < /dev/null &
    echo $! > "$STATE_DIR/$name.pid"
    say "started $name (pid $!, log $logf)"
}
wait_for() {  # what logfile test-command...
    local what="$1" logf="$2"; shift 2
    local t0=$SECONDS
    until "$@"; do
        (( SECONDS - t0 < WAIT_S )) || die "$what not ready after ${WAIT_S} s; see $logf"
        sleep 1
    done
    say "$what ready after $(( SECONDS - t0 )) s"
}
munge_ok() { munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; }
ctld_ok() { scontrol ping 2>/dev/null | grep -q UP; }
node_idle() { [[ "$(node_state)" == idle* ]]; }

if (( conf_changed )) && { running slurmctld || running slurmd; }; then
    say "configuration changed: restarting slurmctld and slurmd"
    for name in slurmd slurmctld; do
        running "$name" || continue
        pid="$(cat "$STATE_DIR/$name.pid")"; kill -TERM "$pid"
        for _ in $(seq 1 60); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
    done
fi

start munged "$LOG_DIR/munged.stdout" \
    setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged --foreground
wait_for munged "$LOG_DIR/munged.stdout" munge_ok
start slurmctld "$LOG_DIR/slurmctld.log" /usr/sbin/slurmctld -D -i
wait_for slurmctld "$LOG_DIR/slurmctld.log" ctld_ok
start slurmd "$LOG_DIR/slurmd.log" /usr/sbin/slurmd -D -N "$NODE"
# A node that was down (e.g. after a restart) comes back with RESUME.
t0=$SECONDS
until node_idle; do
    state="$(node_state)"
    if [[ "$state" =~ ^(down|drain|fail) ]]; then
        scontrol update NodeName="$NODE" State=RESUME 2>/dev/null || true
    elif [[ "$state" =~ ^(mixed|allocated|completing) ]]; then
        break  # busy with jobs already: usable
    fi
    (( SECONDS - t0 < WAIT_S )) \
        || die "node $NODE is '${state:-not registered}' after ${WAIT_S} s; see $LOG_DIR/slurmd.log and $LOG_DIR/slurmctld.log"
    sleep 1
done
say "node $NODE is $(node_state) after $(( SECONDS - t0 )) s"
sinfo
say "one-node SLURM is up (stop: bash $0 stop)"
