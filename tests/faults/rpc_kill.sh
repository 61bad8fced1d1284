#!/usr/bin/env bash
# faults_rpc_kill (issue 8, scenarios 3 and 5): a process is killed with SIGKILL under load,
# between two VMs. Calls of 64 B and 4 KiB (eager SENDs) and 64 KiB and 1 MiB (rendezvous: most
# of the time is spent in RDMA WRITEs) in turn, 8 in flight, 30 s deadlines, 30 s of calls before
# the kill (>= 1,000 calls a run).
#   server-killed: b's server is killed mid-run and restarted 3 s later while a keeps calling
#                  on one channel. Every call issued completes exactly once and none past its
#                  deadline + 2 s; the first failure comes within 5 s of the kill; after the
#                  restart the same channel reconnects and at least 20 calls in a row succeed;
#                  a's rdma resources are back at baseline afterwards.
#   client-killed: a's client process is killed mid-run. b's server must close that
#                  connection within 5 s and its rdma resources return to the listening baseline.
#
#   rpc_kill.sh path/to/tools/rxe-vm path/to/fault_rpc [SCENARIOS]   (host side: boots the VMs)
#   rpc_kill.sh --side SCENARIO a|b path/to/fault_rpc                 (inside the VMs)
set -euo pipefail
bound_ms=5000

if [ "${1:-}" != --side ]; then
  rxe_vm=${1:?usage: rpc_kill.sh path/to/tools/rxe-vm path/to/fault_rpc [SCENARIOS]}
  fault_rpc=${2:?}
  self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  fails=0
  for scenario in ${3:-server-killed client-killed}; do
    rc=0
    "$rxe_vm" --hosts 2 --timeout 400 \
      --a "bash $(printf %q "$self") --side $scenario a $(printf %q "$fault_rpc")" \
      --b "bash $(printf %q "$self") --side $scenario b $(printf %q "$fault_rpc")" 2>&1 | tee -a "$log" || rc=$?
    [ "$rc" = 0 ] || { echo "faults_rpc_kill: $scenario: FAIL (rxe-vm exited $rc)"; fails=$((fails + 1)); continue; }
    grep -q "^\[[ab]\] rpc-kill: $scenario: PASS" "$log" ||
      { echo "faults_rpc_kill: $scenario: FAIL (no PASS line)"; fails=$((fails + 1)); }
  done
  echo
  echo "faults_rpc_kill: summary"
  grep -E '^\[[ab]\] (fault-rpc|rpc-kill):' "$log" || true
  [ "$fails" = 0 ] || { echo "faults_rpc_kill: FAIL"; exit 1; }
  echo "faults_rpc_kill: PASS"
  exit 0
fi

scenario=${2:?} side=${3:?} fault_rpc=${4:?}
ctl=$RXE_VM_CTL port=7482
server_log=$ctl/b-server.log
fail() {
  echo "rpc-kill: $scenario: FAIL: $*"
  if [ "$side" = b ] && [ -f "$server_log" ]; then
    echo "rpc-kill: the server's log ends:"
    tail -n 30 "$server_log"
  fi
  wire_check || true  # the peer waits for done: a stalled emulated wire is not rdmarpc's failure
  touch "$ctl/done"
  exit 1
}
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"

serve() {  # starts the server in the background; sets $pid
  # info: the server logs event=disconnected (with the reason) for every connection it closes.
  RDMARPC_LOG=info "$fault_rpc" serve --listen="rdma://$RXE_VM_SELF_IP:$port" >>"$server_log" 2>&1 &
  pid=$!
  wait_listening "$port" "$pid" "$server_log"
}

if [ "$side" = b ]; then
  serve
  listening=$(res_counts)
  touch "$ctl/ready"
  if [ "$scenario" = server-killed ]; then
    wait_for kill-server 120
    kill -KILL "$pid"
    wait "$pid" || true
    echo "rpc-kill: server-killed: server killed; restarting it in 3 s"
    sleep 3
    serve
    touch "$ctl/server-back"
    wait_for done 300
    stop_server "$pid"
    exit 0
  fi
  wait_for client-killed 120
  t0=$(now_ms)
  line=$(wait_log "$server_log" 'event=disconnected' 30) || fail "the server still holds the killed client's connection after 30 s"
  t1=$(now_ms)
  echo "rpc-kill: client-killed: server closed the killed client's connection $((t1 - t0)) ms after the kill (bound $bound_ms ms): $line"
  [ $((t1 - t0)) -le $bound_ms ] || fail "killed client found after $((t1 - t0)) ms, bound $bound_ms ms"
  res_settle "$listening" 10 || true
  echo "rpc-kill: client-killed: rdma resources: listening $listening, after the kill $now (settled in $settle_ms ms)"
  [ "$now" = "$listening" ] || fail "rdma resources not back at the listening baseline ($listening -> $now)"
  stop_server "$pid"
  touch "$ctl/done"
  echo "rpc-kill: client-killed: PASS"
  exit 0
fi

# side a
wait_for ready 300
baseline=$(res_counts)
start_drive "$fault_rpc" "rdma://$RXE_VM_PEER_IP:$port" "$scenario" --expect=any --sizes=64,4096,65536,1048576
sleep 30
kill -0 $drive 2>/dev/null || { cat "$drive_out"; fail "the drive ended before the kill"; }
if [ "$scenario" = client-killed ]; then
  kill -KILL $drive
  wait $drive || true
  touch "$ctl/client-killed"
  echo "rpc-kill: client-killed: client killed with calls in flight"
  wait_for done 120
  exit 0
fi
t0=$(now_ms)
touch "$ctl/kill-server"
wait_for server-back 120
sleep 8  # the channel reconnects on the next call; let calls run on the new server
finish_drive
calls_at_least "$verdict" 1000
first=$first_failure_ms streak=$ok_streak
[ -n "$first" ] && [ "$first" != 0 ] || fail "no call failed although the server was killed"
echo "rpc-kill: server-killed: first call failed $((first - t0)) ms after the kill request (bound $bound_ms ms); $streak calls OK in a row after the restart"
[ $((first - t0)) -le $bound_ms ] || fail "killed server found after $((first - t0)) ms, bound $bound_ms ms"
[ "${streak:-0}" -ge 20 ] || fail "only ${streak:-0} calls succeeded after the restart (want >= 20): no reconnect?"
grep -m1 'event=disconnected' "$drive_out" | sed 's/^/rpc-kill: server-killed: /' || true
res_settle "$baseline" 10 || true
echo "rpc-kill: server-killed: rdma resources before $baseline, after $now (settled in $settle_ms ms)"
[ "$now" = "$baseline" ] || fail "rdma resources not back at baseline ($baseline -> $now)"
touch "$ctl/done"
echo "rpc-kill: server-killed: PASS"
