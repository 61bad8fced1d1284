#!/usr/bin/env bash
# demo_rdma_test (label rdma, inside the VM): the README's main demo runs to its
# table and exits by itself: seven rows per size (raw rdma, raw tcp blocking
# and spinning, rpc-rdma and rpc-tcp event-driven and busy) and the four ratio
# lines. It once hung after its rdma:// RPC rows because the server's parked
# workers kept the io_context running; the busy rows must end too (a busy
# poller never runs out of work by itself).
#   demo_rdma_test.sh path/to/rdmarpc_demo
set -euo pipefail
demo=${1:?usage: demo_rdma_test.sh path/to/rdmarpc_demo}
[ -n "${RXE_VM_SELF_IP:-}" ] || { echo "demo_rdma_test: RXE_VM_SELF_IP unset: run inside tools/rxe-vm"; exit 1; }
out=$(mktemp)
trap 'rm -f "$out"' EXIT
rc=0
timeout 300 "$demo" --iters 200 --sizes 64,4096 >"$out" 2>&1 || rc=$?
cat "$out"
[ "$rc" = 0 ] || { echo "demo_rdma_test: FAIL: the demo exited with $rc (124: still running after 300 s)"; exit 1; }
for row in rdma tcp tcp-spin rpc-rdma rpc-tcp rpc-rdma-busy rpc-tcp-busy; do
  n=$(grep -cE "^$row +(64|4096) +200 " "$out" || true)
  [ "$n" = 2 ] || { echo "demo_rdma_test: FAIL: expected 2 '$row' rows (64 and 4096 B, 200 iterations), found $n"; exit 1; }
done
ratios=$(grep -cE ' 64 B: [0-9.]+x  4096 B: [0-9.]+x$' "$out" || true)
[ "$ratios" = 4 ] || { echo "demo_rdma_test: FAIL: expected 4 ratio lines (raw blocking, raw spinning, RPC event, RPC busy), found $ratios"; exit 1; }
echo "demo_rdma_test: PASS"
