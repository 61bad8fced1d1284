#!/usr/bin/env bash
# harness_exit_status: tools/rxe-vm hands back the command's exit status and output, and the
# command finds a working rxe0. Each VM boot costs 10-30 s under TCG, so checks share boots.
#
#   exit_status.sh path/to/tools/rxe-vm
set -euo pipefail
rxe_vm=${1:?usage: exit_status.sh path/to/tools/rxe-vm}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"

command -v ibv_devices >/dev/null || { echo "harness_exit_status: needs ibv_devices on the host (ibverbs-utils)"; exit 1; }

failures=0
check() {  # check DESCRIPTION CONDITION...
  local what=$1; shift
  if "$@"; then echo "ok:   $what"; else echo "FAIL: $what"; failures=$((failures + 1)); fi
}
# Runs the harness with stdout/stderr kept in files (shown afterwards); sets $rc.
run() {
  local name=$1; shift
  rc=0
  "$rxe_vm" "$@" >"$work/$name.out" 2>"$work/$name.err" || rc=$?
  sed 's/^/  | /' "$work/$name.out"; sed 's/^/  ! /' "$work/$name.err"
  echo "rxe-vm $(printf '%q ' "$@")-> exit $rc"
}
has() { grep -qE -- "$2" "$work/$1"; }

# --help documents the modes; no VM needed.
"$rxe_vm" --help >"$work/help.out"
check "--help exits 0 and explains RXE_VM_MODE" has help.out 'RXE_VM_MODE'

run true -- true
check "'-- true' exits 0" test "$rc" = 0
check "boot time is reported" has true.err '^rxe-vm: vm up in [0-9.]+s$'

run false -- false
check "'-- false' exits 1 (the command's status, not a harness error)" test "$rc" = 1

# One boot for the remaining checks: status 7, streamed output, rxe0 in rdma and verbs,
# environment and working directory.
run probe --env RXE_TEST_FOO=bar -- sh -c '
  echo marker-XYZ
  rdma link show
  ibv_devices
  echo "env RXE_VM=$RXE_VM DEV=$RXE_VM_DEV IP=$RXE_VM_SELF_IP NETDEV=$RXE_VM_NETDEV"
  echo "cwd $(pwd) foo=$RXE_TEST_FOO"
  ulimit -l
  test -d "$RXE_VM_CTL" && echo ctl-visible
  echo to-stderr >&2
  exit 7'
check "exit status 7 comes back" test "$rc" = 7
check "stdout carries marker-XYZ" has probe.out '^marker-XYZ$'
check "'rdma link show' lists rxe0 ACTIVE on the dummy netdev" has probe.out '^link rxe0/1 state ACTIVE .*netdev rxevm0'
check "'ibv_devices' lists rxe0" has probe.out '^[[:space:]]+rxe0[[:space:]]+[0-9a-f]{16}'
check "RXE_VM_* exported" has probe.out '^env RXE_VM=1 DEV=rxe0 IP=10.77.0.1 NETDEV=rxevm0$'
check "runs in the caller's directory, --env passes variables" has probe.out "^cwd $work foo=bar\$"
check "locked memory is unlimited" has probe.out '^unlimited$'
check "RXE_VM_CTL is visible in the VM" has probe.out '^ctl-visible$'
check "stderr stays on stderr" has probe.err '^to-stderr$'
check "stdout has no stderr line" bash -c "! grep -q to-stderr '$work/probe.out'"

# Never a silent pass: a command that outlives --timeout is a failure, and says so.
run timeout --timeout 20 -- sleep 600
check "timeout exits 124" test "$rc" = 124
check "timeout is explained" has timeout.err 'timed out after 20 s'
# The harness keeps a timed-out run's directory for debugging; this one was on purpose.
kept=$(sed -n 's/^rxe-vm: run directory kept: //p' "$work/timeout.err")
case $kept in /*/rxe-vm.*) rm -rf "$kept" ;; esac

if [ "$failures" -ne 0 ]; then echo "harness_exit_status: $failures check(s) failed"; exit 1; fi
echo "harness_exit_status: PASS"
