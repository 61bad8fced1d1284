#!/usr/bin/env bash
# rxe_link_delete.sh: `rdma link delete` under load on the server's side, and the
# link added back (issue 8, scenario 6; ctest faults_rxe_link_delete).
#
# Two VMs: fault_rpc serve on b, fault_rpc drive from a (64 B and 4 KiB calls go
# eager, 64 KiB and 256 KiB by RDMA WRITE; 8 in flight, 30 s deadlines, keepalive
# 1 s / 1 s on both ends). 8 s in, b deletes its rxe link under load. The
# kernel's unregistration waits, uninterruptibly, until every object on the
# device is gone and its ibv_context closed (rxe cannot disassociate contexts),
# so it returns only if the server lets go of everything on the device by
# itself (docs/faults.md, "`rdma link delete` under load"). Checked:
#   - the delete returns within 120 s and the server process lives on. It
#     takes 0.4-3 s when rxe behaves; in most runs, though, rxe (Debian's 6.1)
#     holds a reference to a QP it was asked to destroy and gives up waiting
#     for it after its fixed 50 s (__rxe_cleanup, a WARN in dmesg, printed
#     below when seen), and the delete takes 51-54 s; 120 s leaves room for a
#     second such wait. Without the library's release it never returns;
#   - the client's calls fail UNAVAILABLE (nothing else), the first within 5 s
#     of the delete's start (b's kernel CM sends a DREQ as the device's cm_ids
#     go; were it lost, keepalive, 1 s + 1 s, would find the silence), each
#     exactly once, none past its deadline plus 2 s (fault_rpc's verdict); at
#     least 1,000 calls in all;
#   - after `rdma link add` the server listens again on the same port by
#     itself, and the client's same channel reconnects: >= 20 calls OK in a row;
#   - both sides' rdma resources (qp/cq/mr/pd) back at their baselines once
#     the client is done.
#
# Then the same on one VM with client and server on the deleted device: both
# processes let go of it (the client's channel drops its context too), and the
# client's same channel reconnects once the server listens again.
#
#   rxe_link_delete.sh path/to/tools/rxe-vm path/to/fault_rpc [two-hosts one-host]   (host side)
#   rxe_link_delete.sh --side a|b|one path/to/fault_rpc                               (inside the VMs)
set -euo pipefail
delete_bound_ms=120000 detect_bound_ms=5000 keepalive=1000,1000

if [ "${1:-}" != --side ]; then
  rxe_vm=${1:?usage: rxe_link_delete.sh path/to/tools/rxe-vm path/to/fault_rpc [ROUNDS]}
  fault_rpc=${2:?}
  self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  fails=0
  for round in ${3:-two-hosts one-host}; do
    rc=0
    if [ "$round" = two-hosts ]; then
      "$rxe_vm" --hosts 2 --timeout 400 \
        --a "bash $(printf %q "$self") --side a $(printf %q "$fault_rpc")" \
        --b "bash $(printf %q "$self") --side b $(printf %q "$fault_rpc")" 2>&1 | tee -a "$log" || rc=$?
      sides="a b"
    else
      "$rxe_vm" --vm --timeout 400 -- bash "$self" --side one "$fault_rpc" 2>&1 | sed 's/^/[one] /' | tee -a "$log" ||
        rc=$?
      sides=one
    fi
    [ "$rc" = 0 ] || { echo "faults_rxe_link_delete: $round: FAIL (rxe-vm exited $rc)"; fails=$((fails + 1)); continue; }
    for s in $sides; do
      grep -q "^\[$s\] link-delete: $s: PASS" "$log" ||
        { echo "faults_rxe_link_delete: $round: FAIL (no PASS from $s)"; fails=$((fails + 1)); }
    done
  done
  echo
  echo "faults_rxe_link_delete: summary"
  grep -E '^\[(a|b|one)\] (fault-rpc|link-delete):' "$log" || true
  [ "$fails" = 0 ] || { echo "faults_rxe_link_delete: FAIL"; exit 1; }
  echo "faults_rxe_link_delete: PASS"
  exit 0
fi

side=${2:?} fault_rpc=${3:?}
ctl=$RXE_VM_CTL nic=$RXE_VM_NETDEV port=7483
server_log=$ctl/server.log
fail() {
  echo "link-delete: $side: FAIL: $*"
  if [ "$side" != a ] && [ -f "$server_log" ]; then
    echo "link-delete: the server's log ends:"
    tail -n 30 "$server_log"
  fi
  touch "$ctl/done"
  exit 1
}
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"

serve() {  # in the background, each log line led by unix ms; sets $pid and $listening
  RDMARPC_LOG=info "$fault_rpc" serve --listen="rdma://$RXE_VM_SELF_IP:$port" --keepalive-ms=$keepalive \
    > >(while IFS= read -r l; do printf '%s %s\n' "$(now_ms)" "$l"; done >"$server_log") 2>&1 &
  pid=$!
  wait_listening "$port" "$pid" "$server_log"
  listening=$(res_counts)
}

# delete_and_readd: deletes rxe0 under load and checks it returns, then adds it
# back and waits for the server to listen again. Sets $deleted_at (unix ms).
delete_and_readd() {
  local rc=0 took t0 line
  echo "link-delete: $side: rdma resources under load: $(res_counts)"
  deleted_at=$(now_ms)
  echo "link-delete: $side: rdma link delete rxe0 at unix ms $deleted_at"
  echo "$deleted_at" >"$ctl/delete-started"  # a measures from here: flag files cross 9p with seconds of lag
  timeout 150 rdma link delete rxe0 || rc=$?
  took=$(($(now_ms) - deleted_at))
  echo "link-delete: $side: rdma link delete exited $rc after $took ms (bound $delete_bound_ms ms)"
  if [ "$took" -gt 10000 ]; then
    echo "link-delete: $side: the kernel's messages about the wait:"
    dmesg | grep -E -A4 'WARNING|rxe' | grep -v '^\s*$' | tail -n 12 | sed "s/^/link-delete: $side: dmesg: /" || true
  fi
  [ "$rc" = 0 ] || fail "rdma link delete did not finish (exit $rc): something still holds the device"
  [ "$took" -le "$delete_bound_ms" ] || fail "rdma link delete took $took ms, bound $delete_bound_ms ms"
  kill -0 "$pid" 2>/dev/null || fail "the server died when its device was deleted"
  grep -E 'event=(listener_lost|context_dropped|removed_device_released)' "$server_log" | head -n 4 |
    sed "s/^/link-delete: $side: /" || true
  sleep 3
  rdma link add rxe0 type rxe netdev "$nic" || fail "rdma link add rxe0 failed"
  t0=$(now_ms)
  line=$(wait_log "$server_log" 'event=listening .*reason="device back"' 30) ||
    fail "the server did not listen again within 30 s of rdma link add"
  echo "link-delete: $side: listening again $(($(now_ms) - t0)) ms after rdma link add: $line"
}

drive() {  # starts the client's calls (start_drive, common.sh)
  start_drive "$fault_rpc" "rdma://$1:$port" "link-delete-$side" --expect=any \
    --sizes=64,4096,65536,262144 --keepalive-ms=$keepalive
}

# judge STARTED_MS: stops the drive and checks its verdict.
judge() {
  local started=$1 statuses calls kv
  finish_drive
  local first=$first_failure_ms streak=$ok_streak
  [ -n "$first" ] && [ "$first" != 0 ] || fail "no call failed although the server's device was deleted"
  echo "link-delete: $side: first call failed $((first - started)) ms after the delete started (bound $detect_bound_ms ms); $streak calls OK in a row after the link came back"
  [ $((first - started)) -le $detect_bound_ms ] ||
    fail "the delete was noticed after $((first - started)) ms, bound $detect_bound_ms ms"
  statuses=$(sed -n 's/.*statuses={\([^}]*\)}.*/\1/p' <<<"$verdict")
  for kv in ${statuses//,/ }; do
    case ${kv%%=*} in OK | UNAVAILABLE) ;; *) fail "calls ended ${kv%%=*} (want OK or UNAVAILABLE): $statuses" ;; esac
  done
  calls=$(sed -n 's/.* calls=\([0-9]*\) .*/\1/p' <<<"$verdict")
  [ "${calls:-0}" -ge 1000 ] || fail "only ${calls:-0} calls in the run (want >= 1,000)"
  [ "${streak:-0}" -ge 20 ] || fail "only ${streak:-0} calls succeeded after the link came back (want >= 20): no reconnect?"
  grep -E -m3 'event=(disconnected|context_dropped)' "$drive_out" | sed "s/^/link-delete: $side: /" || true
}

case $side in
  one)  # client and server on the one device that goes
    serve
    drive "$RXE_VM_SELF_IP"
    sleep 8
    kill -0 "$drive" 2>/dev/null || { cat "$drive_out"; fail "the drive ended before the delete"; }
    delete_and_readd
    kill -0 "$drive" 2>/dev/null || { cat "$drive_out"; fail "the client died when its device was deleted"; }
    grep -q 'event=context_dropped' "$drive_out" || fail "the client's channel kept its removed context"
    sleep 12  # the channel reconnects on the next call; let calls run on the new device
    judge "$deleted_at"
    res_settle "$listening" 10 || true
    echo "link-delete: one: rdma resources with the server alone listening $listening, after the client left $now (settled in $settle_ms ms)"
    [ "$now" = "$listening" ] || fail "rdma resources not back at the listening baseline ($listening -> $now)"
    stop_server "$pid"
    echo "link-delete: one: PASS"
    ;;
  b)
    serve
    touch "$ctl/ready"
    wait_for delete 100
    delete_and_readd
    touch "$ctl/relistening"
    wait_for drive-done 200
    res_settle "$listening" 10 || true
    echo "link-delete: b: rdma resources while listening $listening, after the client left $now (settled in $settle_ms ms)"
    [ "$now" = "$listening" ] || fail "rdma resources not back at the listening baseline ($listening -> $now)"
    kill -0 "$pid" 2>/dev/null || fail "the server died"
    stop_server "$pid"
    touch "$ctl/done"
    echo "link-delete: b: PASS"
    ;;
  a)
    wait_for ready 300
    baseline=$(res_counts)
    drive "$RXE_VM_PEER_IP"
    sleep 8
    kill -0 "$drive" 2>/dev/null || { cat "$drive_out"; fail "the drive ended before the delete"; }
    touch "$ctl/delete"
    wait_for relistening 220
    sleep 12  # the channel reconnects on the next call; let calls run on the new device
    judge "$(cat "$ctl/delete-started")"  # b's clock; both VMs set theirs from the host's at boot
    touch "$ctl/drive-done"
    res_settle "$baseline" 10 || true
    echo "link-delete: a: rdma resources before $baseline, after $now (settled in $settle_ms ms)"
    [ "$now" = "$baseline" ] || fail "rdma resources not back at baseline ($baseline -> $now)"
    wait_for done 120
    echo "link-delete: a: PASS"
    ;;
  *) fail "unknown side $side" ;;
esac
