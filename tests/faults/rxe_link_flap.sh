#!/usr/bin/env bash
# rxe_link_flap.sh: what a link flap does to rdma_cm on Soft-RoCE, without rdmarpc.
# Manual (not in CI): it documents a kernel behaviour that decides what faults_rpc_link can
# assert (docs/faults.md, "Link down").
#
# Two VMs (tools/rxe-vm --hosts 2), rping servers on both. Round `quiet`: a's link goes down for
# 8 s with no RDMA traffic. Round `busy`: the same while an rping connection runs from a to b
# (its QP dies during the outage and rdma_cm sends a DREQ with the link down). Round `busykill`:
# as busy, but at link up every process that held the dead connection exits (a's rping client;
# the rping servers on both sides are restarted), so no cm_id of it stays alive; `killclient`:
# only a's client exits; `killserver`: only the servers restart; `killserver-a`, `killserver-b`:
# only that side's server restarts; `killserver-b-down`: b's server restarts while a's link is
# still down (its dead connection is destroyed before a DREQ can reach a). After link up,
# a and b each try fresh rping connections (8 s each, every 10 s, until one connects or
# RXE_FLAP_PROBE_S seconds, default 60, have passed), then both flush their neighbour tables and
# try again, then a deletes and re-adds its rxe link and tries once more. Round
# `quiet-connect-down`: no traffic, but a tries one rping connection while its link is down (its
# rdma_cm sends a REQ MAD with the link down). Round `killclient-down`: as busy, but a's rping
# client is killed 1 s into the outage (its rdma_cm sends a DREQ with the link down).
#
#   [RXE_FLAP_PROBE_S=600] rxe_link_flap.sh path/to/tools/rxe-vm [ROUND]...   (host side;
#       ROUND: quiet quiet-connect-down busy busykill killclient killclient-down killserver killserver-a killserver-b killserver-b-down)
#   rxe_link_flap.sh --side ROUND a|b                         (inside the VMs)
set -uo pipefail
probe_s=${RXE_FLAP_PROBE_S:-60}

if [ "${1:-}" != --side ]; then
  rxe_vm=${1:?usage: rxe_link_flap.sh path/to/tools/rxe-vm [ROUND]... (see the header)}
  shift
  self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  for round in "${@:-quiet busy}"; do
    for r in $round; do
      "$rxe_vm" --hosts 2 --timeout $((probe_s + 300)) --env RXE_FLAP_PROBE_S="$probe_s" --a "bash $(printf %q "$self") --side $r a" \
        --b "bash $(printf %q "$self") --side $r b" 2>&1 | grep -E '^\[[ab]\] rxe-link-flap'
    done
  done
  exit 0
fi

round=${2:?} side=${3:?}
ctl=$RXE_VM_CTL nic=$RXE_VM_NETDEV port=7484
say() { echo "rxe-link-flap: $round: $side: $*"; }
wait_flag() { local i; for ((i = 0; i < $2 * 2; i++)); do [ -e "$ctl/$1" ] && return 0; sleep 0.5; done; return 1; }
try_rping() {  # try_rping LABEL: one fresh rping connection to the peer, 8 s at most
  timeout -s KILL 8 rping -c -a "$RXE_VM_PEER_IP" -p $port -C 2 >/dev/null 2>&1
  local rc=$?
  if [ $rc = 0 ]; then say "$1: rping to the peer connected"; else say "$1: rping to the peer failed (rc $rc)"; fi
  return $rc
}

# Fresh rpings to the peer until one connects or probe_s seconds after link up have passed.
probe_after_link_up() {
  local t_up
  t_up=$(date +%s)
  while :; do
    try_rping "+$(($(date +%s) - t_up)) s after link up" && return 0
    [ $(($(date +%s) - t_up)) -ge "$probe_s" ] && { say "no rping connected within ${probe_s} s of link up"; return 1; }
    sleep 2
  done
}

start_server() {
  rping -s -P -a "$RXE_VM_SELF_IP" -p $port >/dev/null 2>&1 &
  server=$!
}
restart_server() {
  kill -9 $server 2>/dev/null
  wait $server 2>/dev/null
  start_server
  say "rping server restarted"
}

start_server
touch "$ctl/ready-$side"
if [ "$side" = b ]; then
  if [ "$round" = killserver-b-down ]; then
    wait_flag down 200 || { say "a never took its link down"; exit 1; }
    sleep 2
    restart_server
  fi
  wait_flag up 200 || { say "a never brought its link back"; exit 1; }
  case $round in busykill | killserver | killserver-b) restart_server ;; esac
  probe_after_link_up
  say "neighbour table: $(ip neigh show dev "$nic" | tr '\n' ';')"
  touch "$ctl/b-done"
  wait_flag a-flushed $((probe_s + 60))
  ip neigh flush dev "$nic"
  try_rping "after flushing both neighbour tables"
  touch "$ctl/b-flushed"
  wait_flag done 200
  exit 0
fi

wait_flag ready-b 100 || { say "b never started"; exit 1; }
sleep 1
try_rping "before the flap" || exit 1
if [ "$round" != quiet ] && [ "$round" != quiet-connect-down ]; then
  rping -c -a "$RXE_VM_PEER_IP" -p $port -C 100000000 >/dev/null 2>&1 &
  busy=$!
  sleep 3
fi
ip link set dev "$nic" down
touch "$ctl/down"
if [ "$round" = quiet-connect-down ]; then
  sleep 1
  out=$(timeout -s KILL 4 rping -c -v -a "$RXE_VM_PEER_IP" -p $port -C 2 2>&1)
  say "rping attempted with the link down (rc $?): $(tr '\n' ';' <<<"$out" | cut -c1-200)"
  sleep 3
elif [ "$round" = killclient-down ]; then
  sleep 1
  kill -9 $busy 2>/dev/null
  wait $busy 2>/dev/null
  say "busy rping client killed with the link down"
  sleep 7
else
  sleep 8
fi
ip link set dev "$nic" up
case $round in busykill | killclient)
  kill -9 $busy 2>/dev/null
  wait $busy 2>/dev/null
  say "busy rping client killed" ;;
esac
case $round in busykill | killserver | killserver-a) restart_server ;; esac
touch "$ctl/up"
probe_after_link_up
wait_flag b-done $((probe_s + 60))
say "neighbour table: $(ip neigh show dev "$nic" | tr '\n' ';')"
ip neigh flush dev "$nic"
touch "$ctl/a-flushed"
try_rping "after flushing both neighbour tables"
wait_flag b-flushed 60
say "send errors: $(rdma statistic show link rxe0/1 2>/dev/null | grep -o 'send_err [0-9]*')"
say "GSI QP: $(rdma res show qp | grep GSI | sed 's/.*\(state [A-Z]*\) \(sq-psn [0-9]*\).*/\1 \2/')"
kill -9 $server $(jobs -p) 2>/dev/null; sleep 1
rdma link delete rxe0 && rdma link add rxe0 type rxe netdev "$nic" && sleep 3
try_rping "after deleting and re-adding rxe0"
touch "$ctl/done"
