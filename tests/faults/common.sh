# Helpers for the fault scripts' VM sides (sourced; each script defines fail()).
#   RXE_VM_CTL: the directory both VMs and the host share (tools/rxe-vm).

# "qp=N cq=N mr=N pd=N " from `rdma res`: compared before and after a scenario.
res_counts() { local t; for t in qp cq mr pd; do printf '%s=%s ' "$t" "$(rdma res show "$t" 2>/dev/null | grep -c .)"; done; }

now_ms() { date +%s%3N; }

# wire_check: for a fault script's fail() on a side whose wire should work again (no cut, link
# up, no netem left): does the peer still answer pings? Five pings, 8 s. If none is answered the
# emulated wire itself has stalled (docs/faults.md, "The wire"): rdmarpc cannot stop the kernel
# answering ARP and ICMP, so the failure says nothing about it. Then the reason goes to
# $RXE_VM_CTL/wire-dead-<this vm>, which tools/rxe-vm reports as a harness fault (exit 123, run
# again from a fresh boot). Returns 1 when the wire is dead.
wire_check() {
  local out neigh
  if out=$(busybox ping -c 5 -W 3 "$RXE_VM_PEER_IP" 2>&1); then
    echo "wire check: $RXE_VM_PEER_IP answers pings ($(grep -m1 'packets' <<<"$out"))"
    return 0
  fi
  neigh=$(ip neigh show "$RXE_VM_PEER_IP" 2>/dev/null | head -n 1 || true)
  neigh=${neigh%% }
  echo "vm $RXE_VM_HOST cannot ping $RXE_VM_PEER_IP ($(grep -m1 'packets' <<<"$out" || echo no reply); neighbour: ${neigh:-none})" \
    | tee "$RXE_VM_CTL/wire-dead-$RXE_VM_HOST.tmp"
  mv "$RXE_VM_CTL/wire-dead-$RXE_VM_HOST.tmp" "$RXE_VM_CTL/wire-dead-$RXE_VM_HOST"
  return 1
}

# host_clock_offset_ms: the host's clock minus this guest's, in ms (a file touched through 9p
# gets the host's time as its mtime). For turning tools/rxe-vm's host timestamps into ours.
host_clock_offset_ms() {
  local f=$RXE_VM_CTL/.clock-$$ g h
  g=$(now_ms)
  touch "$f"
  h=$(stat -c %.3Y "$f" | tr -d .)
  rm -f "$f"
  echo $((h - g))
}

# res_settle EXPECTED SECONDS: polls res_counts until it equals EXPECTED or
# SECONDS pass (teardown finishes on the process's own threads, a moment after
# the disconnect is logged). Sets $now to the last counts and $settle_ms to
# the wait; returns 1 if they never matched.
res_settle() {
  local t0 i
  t0=$(now_ms)
  for ((i = 0; i < $2 * 5; i++)); do
    now=$(res_counts)
    settle_ms=$(($(now_ms) - t0))
    [ "$now" = "$1" ] && return 0
    sleep 0.2
  done
  return 1
}

# wait_for FILE SECONDS: a flag file in $RXE_VM_CTL, or fail.
wait_for() {
  local i
  for ((i = 0; i < $2 * 5; i++)); do [ -e "$RXE_VM_CTL/$1" ] && return 0; sleep 0.2; done
  fail "gave up waiting for $1 after $2 s"
}

# wait_listening PORT PID LOG: until rdma_cm shows a listener on PORT (the
# server process PID must stay alive meanwhile; LOG is shown if it dies).
wait_listening() {
  local i
  for ((i = 0; i < 150; i++)); do
    rdma res show cm_id 2>/dev/null | grep -q "LISTEN.*:$1" && return 0
    kill -0 "$2" 2>/dev/null || { cat "$3"; fail "the server died before listening"; }
    sleep 0.2
  done
  fail "the server never listened on port $1"
}

# stop_server PID: SIGTERM, and it must be gone within 30 s (graceful shutdown).
stop_server() {
  local i
  kill -TERM "$1"
  for ((i = 0; i < 150; i++)); do kill -0 "$1" 2>/dev/null || break; sleep 0.2; done
  if kill -0 "$1" 2>/dev/null; then
    echo "the server's threads 30 s after SIGTERM:"
    ps -L -o tid,stat,wchan:32,comm -p "$1" || true
    kill -KILL "$1"
    fail "the server was still running 30 s after SIGTERM"
  fi
  wait "$1" || true
}

# wait_log FILE PATTERN SECONDS: until PATTERN appears in FILE; prints the line.
wait_log() {
  local i
  for ((i = 0; i < $3 * 10; i++)); do
    grep -m1 -E "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# start_drive FAULT_RPC TARGET LABEL [ARGS...]: fault_rpc drive in the background
# until $RXE_VM_CTL/stop-drive exists: 64 KiB and 1 MiB calls, 8 in flight, 30 s
# deadlines, 2 s bound. Sets $drive (pid) and $drive_out (its output file).
start_drive() {
  local fault_rpc=$1 target=$2 label=$3
  shift 3
  drive_out=$(mktemp)
  "$fault_rpc" drive --target="$target" --calls=1000000 --concurrency=8 --deadline-ms=30000 --bound-ms=2000 \
    --sizes=65536,1048576 --label="$label" --until-file="$RXE_VM_CTL/stop-drive" "$@" >"$drive_out" 2>&1 &
  drive=$!
}

# calls_at_least VERDICT MIN: the fault-rpc verdict line issued >= MIN calls (issue 8: every
# scenario runs at least 1,000), or fail.
calls_at_least() {
  local n
  n=$(sed -n 's/.* calls=\([0-9]*\) .*/\1/p' <<<"$1")
  [ "${n:-0}" -ge "$2" ] || fail "only ${n:-0} calls were issued (want >= $2)"
}

# finish_drive: stops the drive started by start_drive and judges it; sets
# $verdict (its fault-rpc line), $first_failure_ms (unix ms, 0: none), $ok_streak and
# $recovered_ms (unix ms of the first OK after the last failure, 0: none).
finish_drive() {
  local rc=0
  touch "$RXE_VM_CTL/stop-drive"
  wait "$drive" || rc=$?
  grep -v '^rdmarpc level=' "$drive_out" || true
  verdict=$(grep '^fault-rpc: ' "$drive_out" || true)
  [ -n "$verdict" ] || fail "no verdict from fault_rpc (exit $rc)"
  if [ "$rc" != 0 ]; then
    echo "the drive's last log lines:"
    grep '^rdmarpc level=' "$drive_out" | tail -n 8
    fail "fault_rpc judged the run failed"
  fi
  first_failure_ms=$(sed -n 's/.*first_failure_unix_ms=\([0-9]*\).*/\1/p' <<<"$verdict")
  ok_streak=$(sed -n 's/.*ok_since_last_failure=\([0-9]*\).*/\1/p' <<<"$verdict")
  recovered_ms=$(sed -n 's/.*recovered_unix_ms=\([0-9]*\).*/\1/p' <<<"$verdict")
}
