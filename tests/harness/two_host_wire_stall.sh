#!/usr/bin/env bash
# harness_two_host_wire_stall: when a two-VM command fails after a guest's kernel logged
# "NETDEV WATCHDOG" (the emulated wire stalled), rxe-vm must name it as a harness fault and run
# the command again from a fresh boot (RXE_VM_WIRE_RETRIES, default 1), returning the retry's
# status; with no retries left it must return 123. Side a fakes the stall on its first attempt by
# writing the watchdog's line to the kernel log, then fails; on the second it passes.
#
#   two_host_wire_stall.sh path/to/tools/rxe-vm        (host side: boots the VMs)
#   two_host_wire_stall.sh --side a|b MARK_DIR         (inside the VMs)
set -euo pipefail

if [ "${1:-}" != --side ]; then
  rxe_vm=${1:?usage: two_host_wire_stall.sh path/to/tools/rxe-vm}
  self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  marks=$(mktemp -d) log=$(mktemp)
  trap 'rm -rf "$marks" "$log"' EXIT
  run() {
    rm -f "$marks"/*
    "$rxe_vm" --hosts 2 --timeout 300 \
      --a "bash $(printf %q "$self") --side a $(printf %q "$marks")" \
      --b "bash $(printf %q "$self") --side b $(printf %q "$marks")" 2>&1 | tee "$log"
  }
  fail() { echo "harness_two_host_wire_stall: FAIL ($*)"; exit 1; }
  rc=0
  run || rc=$?
  [ "$rc" = 0 ] || fail "with one retry expected the second attempt's status 0, got $rc"
  grep -q '^rxe-vm: HARNESS FAULT: the emulated wire stalled (vm a: ' "$log" || fail "no harness-fault report"
  grep -q '^rxe-vm: running it again from a fresh boot' "$log" || fail "no retry announced"
  grep -q '^\[a\] wire-stall-test: second attempt passed' "$log" || fail "the command did not run again"
  rc=0
  RXE_VM_WIRE_RETRIES=0 run || rc=$?
  [ "$rc" = 123 ] || fail "with no retries expected 123, got $rc"
  echo "harness_two_host_wire_stall: PASS"
  exit 0
fi

side=${2:?} marks=${3:?}
[ "$side" = a ] || exit 0
if [ ! -e "$marks/first" ]; then
  touch "$marks/first"
  # Priority 2 (crit) passes the quiet console's loglevel=3, as the real watchdog line does.
  echo "<2>virtio_net virtio1 eth0: NETDEV WATCHDOG: CPU: 0: transmit queue 0 timed out 5000 ms (faked by harness_two_host_wire_stall)" >/dev/kmsg
  sleep 1
  echo "wire-stall-test: first attempt fails after the (fake) stall"
  exit 1
fi
echo "wire-stall-test: second attempt passed"
