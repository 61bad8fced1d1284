#!/usr/bin/env bash
# faults_rpc_netem (issue 8, scenario 1): RPCs between two VMs over Soft-RoCE while netem
# hurts a's side of the wire. Rounds: clean, 1% loss, 10% loss, 50 ms delay. Each round makes
# CALLS echo calls (64 B and 4 KiB eager, 64 KiB and 256 KiB rendezvous, 8 in flight, 30 s
# deadline) and must see: every call OK and completed exactly once, none later than its
# deadline + 2 s, payloads intact, no handler run twice on the server (fault_rpc judges),
# and afterwards a's QP/CQ/MR/PD counts (`rdma res`) back at their baseline (within 10 s).
# The 10% round leaves out 256 KiB unless FULL is given: nearly every one of its ~256 frames
# meets a loss, and with it the round took 627 s on TCG (1,000 calls, all OK) instead of minutes.
#
#   rpc_netem.sh path/to/tools/rxe-vm path/to/fault_rpc [CALLS [full]]   (host side: boots the VMs)
#   rpc_netem.sh --side a|b path/to/fault_rpc CALLS [full]               (inside the VMs)
# FAULT_RPC_EXTRA (host side) is added to both fault_rpc commands, e.g.
# FAULT_RPC_EXTRA=--grant-windows=1 to run the rounds with windowed grants.
set -euo pipefail

if [ "${1:-}" != --side ]; then
  rxe_vm=${1:?usage: rpc_netem.sh path/to/tools/rxe-vm path/to/fault_rpc [CALLS]}
  fault_rpc=${2:?}
  calls=${3:-1000}
  full=${4:-}
  self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  rc=0
  "$rxe_vm" --hosts 2 --timeout 2200 \
    --a "FAULT_RPC_EXTRA=$(printf %q "${FAULT_RPC_EXTRA:-}") bash $(printf %q "$self") --side a $(printf %q "$fault_rpc") $calls $full" \
    --b "FAULT_RPC_EXTRA=$(printf %q "${FAULT_RPC_EXTRA:-}") bash $(printf %q "$self") --side b $(printf %q "$fault_rpc") $calls $full" 2>&1 | tee "$log" || rc=$?
  echo
  echo "faults_rpc_netem: summary"
  grep -E '^\[[ab]\] (fault-rpc|rpc-netem):' "$log" || true
  [ "$rc" = 0 ] || { echo "faults_rpc_netem: FAIL (rxe-vm exited $rc)"; exit 1; }
  grep -q '^\[a\] rpc-netem: PASS' "$log" || { echo "faults_rpc_netem: FAIL (no PASS line from a)"; exit 1; }
  echo "faults_rpc_netem: PASS"
  exit 0
fi

side=${2:?} fault_rpc=${3:?} calls=${4:?} full=${5:-}
ctl=$RXE_VM_CTL nic=$RXE_VM_NETDEV
port=7480
# Keepalive: PING after 10 s of silence, dead after 30 s more. Under 10% loss on TCG, RC's own
# recovery stalls a connection for up to ~10 s (max latency 9.4 s in a 1,000-call round), which
# the library's default (10 s + 10 s) can take for a dead peer; a peer declared dead under loss
# then meets rxe's CM trouble on reconnect (docs/faults.md). The rounds judge RC under loss, so
# keepalive must stay out of the way; dead peers are faults_rpc_poweroff's job.
keepalive=10000,30000
fail() {
  echo "rpc-netem: FAIL: $*"
  if [ "$side" = b ] && [ -f "$ctl/b-server.log" ]; then
    echo "rpc-netem: the server's log ends:"
    tail -n 20 "$ctl/b-server.log"
  fi
  # The peer waits for rpc-netem-done: with netem gone, pings tell a stalled emulated wire from
  # an rdmarpc failure.
  [ "$side" = a ] && { tc qdisc del dev "$nic" root 2>/dev/null || true; }
  wire_check || true
  touch "$ctl/rpc-netem-done"   # releases b
  exit 1
}
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"

if [ "$side" = b ]; then
  "$fault_rpc" serve --listen="rdma://$RXE_VM_SELF_IP:$port" --keepalive-ms="$keepalive" ${FAULT_RPC_EXTRA:-} >"$ctl/b-server.log" 2>&1 &
  pid=$!
  wait_listening "$port" "$pid" "$ctl/b-server.log"
  touch "$ctl/rpc-netem-ready"
  for ((i = 0; i < 2000 * 5; i++)); do [ -e "$ctl/rpc-netem-done" ] && break; sleep 0.2; done
  # A graceful shutdown (500 ms grace) must end the server promptly even if a
  # client vanished without its disconnect reaching b (netem ate it).
  stop_server "$pid"
  echo "rpc-netem: server exited after SIGTERM"
  # What the server saw go wrong (keepalive deaths with the connection's
  # counters, failed work completions), even when only a's round failed.
  warnings=$(grep -c -E 'level=(warn|error)' "$ctl/b-server.log" || true)
  echo "rpc-netem: server logged ${warnings:-0} warnings/errors"
  grep -E 'level=(warn|error)' "$ctl/b-server.log" | tail -n 20 | sed 's/^/rpc-netem: server: /' || true
  exit 0
fi

# side a: drives the rounds and judges.
busybox ping -c 2 -W 2 "$RXE_VM_PEER_IP" >/dev/null || fail "b does not answer pings"
wait_for rpc-netem-ready 300
baseline=$(res_counts)
echo "rpc-netem: rdma resources before: $baseline"
target="rdma://$RXE_VM_PEER_IP:$port"
round() {  # round LABEL SIZES NETEM-ARGS...
  local label=$1 sizes=$2; shift 2
  if [ $# -gt 0 ]; then tc qdisc add dev "$nic" root netem "$@" || fail "tc netem $* failed"; fi
  local rc=0
  "$fault_rpc" drive --target="$target" --calls="$calls" --concurrency=8 --deadline-ms=30000 --bound-ms=2000 \
               --sizes="$sizes" --label="$label" --expect=ok --keepalive-ms="$keepalive" ${FAULT_RPC_EXTRA:-} || rc=$?
  if [ $# -gt 0 ]; then
    tc -s qdisc show dev "$nic" | sed -n 's/.*\(Sent .*dropped [0-9]*\).*/rpc-netem: '"$label"' netem: \1/p' | head -n1
    tc qdisc del dev "$nic" root || true
  fi
  res_settle "$baseline" 10 || true  # the channel's connection is closed; its resources go
  echo "rpc-netem: $label: rdma resources after: $now (settled in $settle_ms ms)"
  [ "$now" = "$baseline" ] || fail "$label: rdma resources not back at baseline ($baseline -> $now)"
  [ $rc = 0 ] || fail "$label: fault_rpc judged the round failed"
}
all_sizes=64,4096,65536,262144
lossy_sizes=64,4096,65536
[ "$full" = full ] && lossy_sizes=$all_sizes
round clean "$all_sizes"
round loss-1pct "$all_sizes" loss 1%
round loss-10pct "$lossy_sizes" loss 10%
round delay-50ms "$all_sizes" delay 50ms
touch "$ctl/rpc-netem-done"
echo "rpc-netem: PASS"
