# Helpers for the fault scripts' VM sides (sourced; each script defines fail()).
#   RXE_VM_CTL: the directory both VMs and the host share (tools/rxe-vm).

# "qp=N cq=N mr=N pd=N " from `rdma res`: compared before and after a scenario.
res_counts() { local t; for t in qp cq mr pd; do printf '%s=%s ' "$t" "$(rdma res show "$t" 2>/dev/null | grep -c .)"; done; }

now_ms() { date +%s%3N; }

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
