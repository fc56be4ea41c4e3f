#!/usr/bin/env bash
# A SLURM cluster in a box, as root, beside (not instead of) the single-node SLURM of slurm-ci.sh:
# a private bridge and one network namespace per machine on it, each machine with its own address, its own host
# name (a UTS namespace) and its own /etc/hosts (ip netns exec's /etc/netns/NAME/hosts):
#   mrtbox-ctl  10.213.77.1   boxctl  slurmctld
#   mrtbox-n1   10.213.77.11  node1   slurmd -N node1
#   mrtbox-n2   10.213.77.12  node2   slurmd -N node2       (BOX_NODES=2..4 nodes)
#   this host   10.213.77.254 (on the bridge: the login node, where sbatch/squeue/scancel run with SLURM_CONF)
# Its own munged (own key and socket), its own slurm.conf; nothing listens in this host's namespace, so the
# default SLURM ports do not clash with slurm-ci.sh's daemons. Nothing but these addresses is ever contacted.
# usage: cluster-box.sh start|stop|status|env|exec NODE COMMAND...|restart-node NODE
#   start: idempotent (a running box is stopped first); prints the logs and fails when a node is not up in 30 s
#   stop: kills every process in the box's namespaces, removes the namespaces, the bridge, /etc/netns/mrtbox-*
#         and its munged; exactly what start made, nothing else
#   env: the line to eval in a shell that talks to the box (export SLURM_CONF=...)
#   exec node1 COMMAND...: run COMMAND on node1 (its namespace, host name and /etc/hosts), e.g. a moonrt launch
#   restart-node node2: after a test killed every process of node2: its slurmd again, the node back in service
set -euo pipefail
S=${BOX_DIR:-/var/spool/moonrt-box}
NODES=${BOX_NODES:-2}
CPUS=${BOX_CPUS:-4}           # per node, > real cores: 2 tasks per node without --overcommit
NET=10.213.77
BR=mrtbox0
CTL=mrtbox-ctl
CONF=$S/slurm.conf
MUNGE_SOCK=$S/munge/munge.socket
[[ "$NODES" =~ ^[2-4]$ ]] || { echo "cluster-box.sh: BOX_NODES=$NODES: expected 2, 3 or 4" >&2; exit 2; }

ns_names() { echo "$CTL"; for i in $(seq "$NODES"); do echo "mrtbox-n$i"; done; }

logs() {
  echo "--- cluster-box logs (tail) ---" >&2
  tail -n 30 "$S"/log/*.log >&2 2>/dev/null || true
}

netns_up() {  # netns_up NS ADDR HOSTNAME VETH
  local ns=$1 addr=$2 host=$3 veth=$4
  ip netns add "$ns"
  ip link add "$veth" type veth peer name eth0 netns "$ns"
  ip link set "$veth" master "$BR" up
  ip -n "$ns" addr add "$addr/24" dev eth0
  ip -n "$ns" link set eth0 up
  ip -n "$ns" link set lo up
  mkdir -p "/etc/netns/$ns"
  {
    echo "127.0.0.1 localhost"
    echo "::1 localhost ip6-localhost ip6-loopback"
    echo "$NET.1 boxctl"
    for i in $(seq "$NODES"); do echo "$NET.$((10 + i)) node$i"; done
  } > "/etc/netns/$ns/hosts"
}

in_box() {  # in_box NS HOSTNAME COMMAND...: run COMMAND in the namespace under its own host name and /etc/hosts
  # (not `ip netns exec`: it remounts /sys, without the cgroup mounts slurmd needs)
  local ns=$1 host=$2; shift 2
  nsenter --net="/run/netns/$ns" unshare --uts --mount -- \
    sh -c 'mount --bind "/etc/netns/$1/hosts" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' sh "$ns" "$host" "$@"
}

case "${1:-}" in
start)
  [ "$(id -u)" = 0 ] || { echo "cluster-box.sh: needs root (network namespaces)" >&2; exit 1; }
  if ! command -v ip >/dev/null || ! command -v ss >/dev/null; then   # iproute2: the box's network and the tests' ss
    command -v apt-get >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 >/dev/null || true
  fi
  for t in slurmctld slurmd munged ip ss nsenter unshare; do
    command -v "$t" >/dev/null || { echo "cluster-box.sh: $t not found (bash .ci/slurm-ci.sh install)" >&2; exit 1; }
  done
  if [ -e "$S/up" ] || ip link show "$BR" >/dev/null 2>&1 || ip netns list | grep -q '^mrtbox-'; then
    bash "$0" stop
  fi
  if ip -4 route show | grep -q "^$NET\."; then
    echo "cluster-box.sh: $NET.0/24 is routed on this host already; not creating the box there" >&2; exit 1
  fi
  rm -rf "$S"/ctld "$S"/d "$S"/log   # a fresh cluster: no jobs of an earlier run
  mkdir -p "$S"/{ctld,d,log,munge}
  chmod 755 "$S/munge"
  touch "$S/up"
  trap 'rc=$?; if [ "$rc" != 0 ]; then logs; bash "$0" stop || true; fi' EXIT
  # the network: a bridge with the login node's address, one namespace per machine
  [ -d /etc/netns ] || { mkdir /etc/netns; touch "$S/made-etc-netns"; }
  ip link add "$BR" type bridge
  ip addr add "$NET.254/24" dev "$BR"
  ip link set "$BR" up
  netns_up "$CTL" "$NET.1" boxctl mrtbox-c
  for i in $(seq "$NODES"); do netns_up "mrtbox-n$i" "$NET.$((10 + i))" "node$i" "mrtbox-$i"; done
  # munge: a key and a daemon of the box's own
  [ -s "$S/munge/munge.key" ] || dd if=/dev/urandom bs=1 count=1024 of="$S/munge/munge.key" status=none
  chmod 400 "$S/munge/munge.key"
  munged -f --socket="$MUNGE_SOCK" --key-file="$S/munge/munge.key" --pid-file="$S/munge/munged.pid" \
    --seed-file="$S/munge/seed" --log-file="$S/log/munged.log"
  MEM=2000
  {
    cat <<CONF
ClusterName=box
SlurmctldHost=boxctl($NET.1)
SlurmUser=root
SlurmdUser=root
SlurmdParameters=config_overrides
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCK
MpiDefault=none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=2
ReturnToService=2
StateSaveLocation=$S/ctld
SlurmdSpoolDir=$S/d/%n
SlurmctldPidFile=$S/slurmctld.pid
SlurmdPidFile=$S/slurmd-%n.pid
SlurmctldLogFile=$S/log/slurmctld.log
SlurmdLogFile=$S/log/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=10
KillWait=5
CONF
    for i in $(seq "$NODES"); do
      echo "NodeName=node$i NodeAddr=$NET.$((10 + i)) NodeHostname=node$i CPUs=$CPUS RealMemory=$MEM State=UNKNOWN"
    done
    echo "PartitionName=box Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8"
  } > "$CONF"
  in_box "$CTL" boxctl slurmctld -f "$CONF"
  for i in $(seq "$NODES"); do
    mkdir -p "$S/d/node$i"
    in_box "mrtbox-n$i" "node$i" slurmd -f "$CONF" -N "node$i"
  done
  up=0
  for _ in $(seq 60); do
    n=$(SLURM_CONF=$CONF sinfo -h -N -o '%N %t' 2>/dev/null | grep -cE ' (idle|mix|alloc)$' || true)
    if [ "$n" = "$NODES" ]; then up=1; break; fi
    sleep 0.5
  done
  SLURM_CONF=$CONF sinfo -N || true
  if [ "$up" = 0 ]; then echo "cluster-box.sh: $NODES nodes did not all become idle in 30 s" >&2; exit 1; fi
  echo "cluster-box.sh: up; talk to it with: export SLURM_CONF=$CONF"
  ;;
stop)
  # every process in the box's namespaces (daemons, job steps, ranks), then the namespaces and the bridge
  for ns in $(ip netns list | awk '/^mrtbox-/{print $1}'); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] && kill -TERM $pids 2>/dev/null || true
  done
  for _ in $(seq 20); do
    left=0
    for ns in $(ip netns list | awk '/^mrtbox-/{print $1}'); do
      [ -n "$(ip netns pids "$ns" 2>/dev/null)" ] && left=1
    done
    [ "$left" = 0 ] && break; sleep 0.25
  done
  for ns in $(ip netns list | awk '/^mrtbox-/{print $1}'); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
    ip netns del "$ns"
    rm -rf "/etc/netns/$ns"
  done
  if ip link show "$BR" >/dev/null 2>&1; then ip link del "$BR"; fi
  if [ -e "$S/made-etc-netns" ]; then rmdir /etc/netns 2>/dev/null || true; rm -f "$S/made-etc-netns"; fi
  if [ -s "$S/munge/munged.pid" ]; then
    pid=$(cat "$S/munge/munged.pid")
    # only our munged: the one serving the box's socket
    if tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q -- "--socket=$MUNGE_SOCK"; then
      kill "$pid" 2>/dev/null || true
      for _ in $(seq 20); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
    fi
    rm -f "$S/munge/munged.pid"
  fi
  rm -f "$S/up"
  # what must be gone now: say what is not, and fail
  left=$(ip netns list | awk '/^mrtbox-/{print "namespace " $1}'; ip link show "$BR" >/dev/null 2>&1 && echo "bridge $BR"
         ls -d /etc/netns/mrtbox-* 2>/dev/null; pgrep -af "(slurmctld|slurmd|munged) .*$S" | sed 's/^/process /' || true)
  if [ -n "$left" ]; then echo "cluster-box.sh stop: left behind:" >&2; echo "$left" >&2; exit 1; fi
  ;;
status)
  ip netns list | grep '^mrtbox-' || { echo "cluster-box.sh: not running"; exit 3; }
  SLURM_CONF=$CONF sinfo -N; SLURM_CONF=$CONF squeue ;;
env)
  echo "export SLURM_CONF=$CONF" ;;
exec)
  node=${2:-}; shift 2 || true
  [[ "$node" =~ ^node[1-4]$ ]] && [ -e "/run/netns/mrtbox-n${node#node}" ] \
    || { echo "cluster-box.sh exec: node '$node' is not a running node of the box" >&2; exit 2; }
  [ $# -gt 0 ] || { echo "cluster-box.sh exec $node: no command" >&2; exit 2; }
  in_box "mrtbox-n${node#node}" "$node" "$@" ;;
restart-node)
  node=${2:-}
  [[ "$node" =~ ^node[1-4]$ ]] && [ -e "/run/netns/mrtbox-n${node#node}" ] \
    || { echo "cluster-box.sh restart-node: node '$node' is not a node of the box" >&2; exit 2; }
  pids=$(ip netns pids "mrtbox-n${node#node}")
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
  in_box "mrtbox-n${node#node}" "$node" slurmd -f "$CONF" -N "$node"
  SLURM_CONF=$CONF scontrol update NodeName="$node" State=RESUME 2>/dev/null || true
  for _ in $(seq 60); do
    SLURM_CONF=$CONF sinfo -h -N -n "$node" -o %t | grep -qE '^(idle|mix|alloc)$' && exit 0
    sleep 0.5
  done
  echo "cluster-box.sh: $node did not come back in 30 s" >&2; logs; exit 1 ;;
*) echo "usage: $0 start|stop|status|env|exec NODE COMMAND...|restart-node NODE" >&2; exit 2 ;;
esac
