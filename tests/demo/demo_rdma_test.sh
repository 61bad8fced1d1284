#!/usr/bin/env bash
# demo_rdma_test (label rdma, inside the VM): the README's main demo runs to its
# table and exits by itself: four rows per size (raw rdma, raw tcp, rpc-rdma,
# rpc-tcp) and both ratio lines. It once hung after its rdma:// RPC rows
# because the server's parked workers kept the io_context running.
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
for row in rdma tcp rpc-rdma rpc-tcp; do
  n=$(grep -cE "^$row +(64|4096) +200 " "$out" || true)
  [ "$n" = 2 ] || { echo "demo_rdma_test: FAIL: expected 2 '$row' rows (64 and 4096 B, 200 iterations), found $n"; exit 1; }
done
grep -q '^raw ping-pong, TCP/RDMA (P50):  64 B: [0-9.]*x  4096 B: [0-9.]*x' "$out" || { echo "demo_rdma_test: FAIL: no raw ratio line"; exit 1; }
grep -q '^rdmarpc echo RPC, tcp:// / rdma:// (P50):  64 B: [0-9.]*x' "$out" || { echo "demo_rdma_test: FAIL: no RPC ratio line"; exit 1; }
echo "demo_rdma_test: PASS"
