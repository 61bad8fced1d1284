#!/usr/bin/env bash
# harness_two_host_poweroff: a asks the harness to pull b's plug while b sleeps; the harness
# must power b off through QMP, say so, and return a's status (0). a checks that b really
# vanished from the wire.
#
#   two_host_poweroff.sh path/to/tools/rxe-vm     (host side: boots the VMs)
#   two_host_poweroff.sh --side a|b               (inside the VMs)
set -euo pipefail

if [ "${1:-}" != --side ]; then
  rxe_vm=${1:?usage: two_host_poweroff.sh path/to/tools/rxe-vm}
  self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  rc=0 start=$SECONDS
  # b sleeps 600 s; a timeout well below that shows a missed power-off as a failure.
  "$rxe_vm" --hosts 2 --timeout 400 \
    --a "bash $(printf %q "$self") --side a" --b "bash $(printf %q "$self") --side b" 2>&1 |
    tee "$log" || rc=$?
  took=$((SECONDS - start))
  echo "harness_two_host_poweroff: rxe-vm exited $rc after $took s"
  [ "$rc" = 0 ] || { echo "harness_two_host_poweroff: FAIL (expected a's status 0)"; exit 1; }
  grep -q '^rxe-vm: vm b was powered off on request' "$log" ||
    { echo "harness_two_host_poweroff: FAIL (no power-off report for b)"; exit 1; }
  grep -q '^\[a\] poweroff-test: b is gone' "$log" ||
    { echo "harness_two_host_poweroff: FAIL (a did not see b disappear)"; exit 1; }
  echo "harness_two_host_poweroff: PASS"
  exit 0
fi

ctl=$RXE_VM_CTL peer=$RXE_VM_PEER_IP
if [ "$2" = b ]; then
  touch "$ctl/b-up"
  exec sleep 600
fi

# side a
for ((i = 0; i < 1500; i++)); do [ -e "$ctl/b-up" ] && break; sleep 0.2; done
[ -e "$ctl/b-up" ] || { echo "poweroff-test: b never came up"; exit 1; }
# Debian's ping may be absent; busybox's is always there (we booted with it).
ping1() { busybox ping -c 1 -W 2 "$peer" >/dev/null 2>&1; }
for ((i = 0; i < 10; i++)); do ping1 && break; sleep 1; done
ping1 || { echo "poweroff-test: b does not answer pings before the power-off"; exit 1; }
echo "poweroff-test: b answers; pulling its plug"
touch "$ctl/poweroff-b"
for ((i = 0; i < 60; i++)); do
  if ! ping1 && ! ping1; then echo "poweroff-test: b is gone"; exit 0; fi
  sleep 1
done
echo "poweroff-test: b still answers 60 s after the power-off request"
exit 1
