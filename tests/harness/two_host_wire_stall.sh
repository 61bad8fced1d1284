#!/usr/bin/env bash
# harness_two_host_wire_stall: when a two-VM command fails after a guest's kernel logged
# "NETDEV WATCHDOG" (the emulated wire stalled), rxe-vm must name it as a harness fault and run
# the command again from a fresh boot (RXE_VM_WIRE_RETRIES, default 1), returning the retry's
# status; with no retries left it must return 123. Side a fakes the stall on its first attempt by
# writing the watchdog's line to the kernel log, then fails; on the second it passes.
# The same for a stall no watchdog sees (frames into a guest lost): a failing fault script calls
# wire_check (tests/faults/common.sh), which pings the peer and, with no answer, writes
# $RXE_VM_CTL/wire-dead-X. The third run checks that path for real: side a has the host cut its
# wire (every frame dropped in qemu) and runs wire_check during the cut; with no retries left
# rxe-vm must return 123 and name the failed ping.
#
#   two_host_wire_stall.sh path/to/tools/rxe-vm          (host side: boots the VMs)
#   two_host_wire_stall.sh --side a|b MARK_DIR watchdog|ping  (inside the VMs)
set -euo pipefail

if [ "${1:-}" != --side ]; then
  rxe_vm=${1:?usage: two_host_wire_stall.sh path/to/tools/rxe-vm}
  self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  marks=$(mktemp -d) log=$(mktemp)
  trap 'rm -rf "$marks" "$log"' EXIT
  run() {  # $1: how side a's wire stalls (watchdog: a faked watchdog line; ping: a real cut)
    rm -f "$marks"/*
    "$rxe_vm" --hosts 2 --timeout 300 \
      --a "bash $(printf %q "$self") --side a $(printf %q "$marks") $1" \
      --b "bash $(printf %q "$self") --side b $(printf %q "$marks") $1" 2>&1 | tee "$log"
  }
  fail() { echo "harness_two_host_wire_stall: FAIL ($*)"; exit 1; }
  rc=0
  run watchdog || rc=$?
  [ "$rc" = 0 ] || fail "with one retry expected the second attempt's status 0, got $rc"
  grep -q '^rxe-vm: HARNESS FAULT: the emulated wire stalled (vm a: ' "$log" || fail "no harness-fault report"
  grep -q '^rxe-vm: running it again from a fresh boot' "$log" || fail "no retry announced"
  grep -q '^\[a\] wire-stall-test: second attempt passed' "$log" || fail "the command did not run again"
  rc=0
  RXE_VM_WIRE_RETRIES=0 run watchdog || rc=$?
  [ "$rc" = 123 ] || fail "with no retries expected 123, got $rc"
  rc=0
  RXE_VM_WIRE_RETRIES=0 run ping || rc=$?
  [ "$rc" = 123 ] || fail "a failed wire check with no retries: expected 123, got $rc"
  grep -q '^\[a\] wire-stall-test: the attempt fails after the (real) cut' "$log" ||
    fail "side a did not get as far as the cut"
  grep -q '^rxe-vm: HARNESS FAULT: the emulated wire stalled (vm a: vm a cannot ping 169.254.77.2' "$log" ||
    fail "no harness-fault report naming the failed ping"
  echo "harness_two_host_wire_stall: PASS"
  exit 0
fi

side=${2:?} marks=${3:?} mode=${4:?}
if [ "$side" = b ]; then
  [ "$mode" = ping ] || exit 0
  # Stays up until a is done, so a's pings are answered unless the wire itself drops them.
  for ((i = 0; i < 600; i++)); do [ -e "$RXE_VM_CTL/done" ] && exit 0; sleep 0.2; done
  exit 0
fi
if [ "$mode" = ping ]; then
  fail() { echo "wire-stall-test: $*"; touch "$RXE_VM_CTL/done"; exit 1; }
  # shellcheck source=../faults/common.sh
  . "$(dirname "$0")/../faults/common.sh"
  wire_check || fail "wire_check found a working wire before the cut"
  echo 15000 >"$RXE_VM_CTL/cut-a.req"
  mv "$RXE_VM_CTL/cut-a.req" "$RXE_VM_CTL/cut-a"
  sleep 1
  ! wire_check || fail "wire_check found a working wire during the cut"
  wait_for cut-a.done 30
  fail "the attempt fails after the (real) cut"
fi
if [ ! -e "$marks/first" ]; then
  touch "$marks/first"
  # Priority 2 (crit) passes the quiet console's loglevel=3, as the real watchdog line does.
  echo "<2>virtio_net virtio1 eth0: NETDEV WATCHDOG: CPU: 0: transmit queue 0 timed out 5000 ms (faked by harness_two_host_wire_stall)" >/dev/kmsg
  sleep 1
  echo "wire-stall-test: first attempt fails after the (fake) stall"
  exit 1
fi
echo "wire-stall-test: second attempt passed"
