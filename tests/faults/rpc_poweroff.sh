#!/usr/bin/env bash
# faults_rpc_poweroff (issue 8, scenarios 3-5 at the RPC level): a host dies under load and
# the survivor must notice within a stated bound, fail or free what the dead side held,
# and lose nothing else. Two boots of the two-VM topology:
#   server-dies: a drives echo calls (64 B..256 KiB, 8 in flight, 30 s deadlines) at b's
#                server and pulls b's plug. Every call issued completes exactly once, none
#                past its deadline + 2 s; the first failure comes within the bound of the
#                power-off; a's rdma resources return to their baseline.
#   client-dies: b serves; a drives calls and pulls its own plug. b's server must close that
#                client's connection (keepalive or a failed send) within the bound, and b's
#                rdma resources return to their baseline.
# Keepalive 1000 ms / 1000 ms on both ends: bound = interval + timeout + 2 sweeps (500 ms)
# + 2 s for the power-off itself and TCG = 5 s.
#
#   rpc_poweroff.sh path/to/tools/rxe-vm path/to/fault_rpc           (host side: boots the VMs)
#   rpc_poweroff.sh --side SCENARIO a|b path/to/fault_rpc            (inside the VMs)
set -euo pipefail
bound_ms=5000
keepalive=1000,1000

if [ "${1:-}" != --side ]; then
  rxe_vm=${1:?usage: rpc_poweroff.sh path/to/tools/rxe-vm path/to/fault_rpc}
  fault_rpc=${2:?}
  self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  fails=0
  for scenario in ${3:-server-dies client-dies}; do
    rc=0
    "$rxe_vm" --hosts 2 --timeout 400 \
      --a "bash $(printf %q "$self") --side $scenario a $(printf %q "$fault_rpc")" \
      --b "bash $(printf %q "$self") --side $scenario b $(printf %q "$fault_rpc")" 2>&1 | tee -a "$log" || rc=$?
    [ "$rc" = 0 ] || { echo "faults_rpc_poweroff: $scenario: FAIL (rxe-vm exited $rc)"; fails=$((fails + 1)); continue; }
    grep -q "^\[[ab]\] rpc-poweroff: $scenario: PASS" "$log" ||
      { echo "faults_rpc_poweroff: $scenario: FAIL (no PASS line)"; fails=$((fails + 1)); }
  done
  echo
  echo "faults_rpc_poweroff: summary"
  grep -E '^\[[ab]\] (fault-rpc|rpc-poweroff):' "$log" || true
  [ "$fails" = 0 ] || { echo "faults_rpc_poweroff: FAIL"; exit 1; }
  echo "faults_rpc_poweroff: PASS"
  exit 0
fi

scenario=${2:?} side=${3:?} fault_rpc=${4:?}
ctl=$RXE_VM_CTL port=7481
fail() {
  echo "rpc-poweroff: $scenario: FAIL: $*"
  if [ "$side" = b ] && [ -f "$ctl/b-server.log" ]; then
    echo "rpc-poweroff: the server's log ends:"
    tail -n 30 "$ctl/b-server.log"
  fi
  touch "$ctl/done"
  exit 1
}
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"

if [ "$side" = b ]; then
  baseline=$(res_counts)
  # info: the server logs event=disconnected (with the reason) for every connection it closes.
  RDMARPC_LOG=info "$fault_rpc" serve --listen="rdma://$RXE_VM_SELF_IP:$port" --keepalive-ms=$keepalive >"$ctl/b-server.log" 2>&1 &
  pid=$!
  wait_listening "$port" "$pid" "$ctl/b-server.log"
  listening=$(res_counts)
  touch "$ctl/ready"
  if [ "$scenario" = client-dies ]; then
    wait_for poweroff-a 120
    t0=$(now_ms)
    line=$(wait_log "$ctl/b-server.log" 'event=disconnected' 30) ||
      fail "the server still holds the dead client's connection 30 s after a's power-off"
    t1=$(now_ms)
    echo "rpc-poweroff: client-dies: server closed the dead client's connection $((t1 - t0)) ms after the power-off request (bound $bound_ms ms): $line"
    [ $((t1 - t0)) -le $bound_ms ] || fail "dead client found after $((t1 - t0)) ms, bound $bound_ms ms"
    res_settle "$listening" 10 || true
    echo "rpc-poweroff: client-dies: rdma resources: listening $listening, after the client's death $now (settled in $settle_ms ms)"
    [ "$now" = "$listening" ] || fail "rdma resources not back at the listening baseline ($listening -> $now)"
    stop_server "$pid"
    echo "rpc-poweroff: client-dies: PASS"
    exit 0
  fi
  # server-dies: a pulls our plug; "done" comes only if a failed before that.
  wait_for done 600
  kill -KILL $pid
  exit 0
fi

# side a
wait_for ready 300
baseline=$(res_counts)
target="rdma://$RXE_VM_PEER_IP:$port"
out=$(mktemp)
"$fault_rpc" drive --target="$target" --calls=1000000 --concurrency=8 --deadline-ms=30000 --bound-ms=2000 \
  --sizes=64,4096,65536,262144 --label="$scenario" --expect=any --keepalive-ms=$keepalive \
  --stop-on-failure --server-gone >"$out" 2>&1 &
drive=$!
sleep 30  # >= 1,000 calls before the power-off
# Before the power-off b must answer: if the drive ended, pings tell a stalled emulated wire (a
# harness fault, docs/faults.md) from an rdmarpc failure.
kill -0 $drive 2>/dev/null || { cat "$out"; wire_check || true; fail "the drive ended before the power-off"; }
if [ "$scenario" = client-dies ]; then
  echo "rpc-poweroff: client-dies: pulling our own plug with calls in flight"
  touch "$ctl/poweroff-a"
  exec sleep 600
fi
t0=$(now_ms)
touch "$ctl/poweroff-b"
rc=0
wait $drive || rc=$?
grep -v '^rdmarpc level=' "$out" || true
line=$(grep '^fault-rpc: ' "$out" || true)
[ -n "$line" ] || fail "no verdict from fault_rpc (exit $rc)"
[ "$rc" = 0 ] || fail "fault_rpc judged the run failed"
calls_at_least "$line" 1000
first=$(sed -n 's/.*first_failure_unix_ms=\([0-9]*\).*/\1/p' <<<"$line")
[ -n "$first" ] && [ "$first" != 0 ] || fail "no call failed after the server's power-off"
echo "rpc-poweroff: server-dies: first call failed $((first - t0)) ms after the power-off request (bound $bound_ms ms)"
[ $((first - t0)) -le $bound_ms ] || fail "dead server found after $((first - t0)) ms, bound $bound_ms ms"
grep -m1 'event=disconnected' "$out" | sed 's/^/rpc-poweroff: server-dies: /' || true
res_settle "$baseline" 10 || true
echo "rpc-poweroff: server-dies: rdma resources before $baseline, after $now (settled in $settle_ms ms)"
[ "$now" = "$baseline" ] || fail "rdma resources not back at baseline ($baseline -> $now)"
echo "rpc-poweroff: server-dies: PASS"
