#!/usr/bin/env bash
# rxe_link_delete.sh: what `rdma link delete` does to a server process under load (issue 8,
# scenario 6). Manual (not in CI): it documents the kernel behaviour scenario 6 has to be built
# around (docs/faults.md, "`rdma link delete` under load"). With today's code the delete hangs
# until the server process exits, so expect the run to time out.
#
# Two VMs: fault_rpc serve on b, fault_rpc drive (64 KiB / 1 MiB, 8 in flight) from a; 5 s in,
# b runs `timeout 40 rdma link delete rxe0` and reports whether and when it returned, then
# re-adds the link; a drives 15 s more and prints its verdict.
#
#   rxe_link_delete.sh path/to/tools/rxe-vm path/to/fault_rpc       (host side)
#   rxe_link_delete.sh --side a|b path/to/fault_rpc                 (inside the VMs)
set -uo pipefail

if [ "${1:-}" != --side ]; then
  rxe_vm=${1:?usage: rxe_link_delete.sh path/to/tools/rxe-vm path/to/fault_rpc}
  fault_rpc=${2:?}
  self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  exec "$rxe_vm" --hosts 2 --timeout 400 \
    --a "bash $(printf %q "$self") --side a $(printf %q "$fault_rpc")" \
    --b "bash $(printf %q "$self") --side b $(printf %q "$fault_rpc")"
fi

side=${2:?} fault_rpc=${3:?}
ctl=$RXE_VM_CTL nic=$RXE_VM_NETDEV port=7483
fail() { echo "link-delete: FAIL: $*"; touch "$ctl/done"; exit 1; }
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"

if [ "$side" = b ]; then
  "$fault_rpc" serve --listen="rdma://$RXE_VM_SELF_IP:$port" >"$ctl/b-server.log" 2>&1 &
  pid=$!
  wait_listening "$port" "$pid" "$ctl/b-server.log"
  touch "$ctl/ready"
  wait_for delete 100
  echo "link-delete: b: rdma resources before: $(res_counts)"
  rdma res show
  t0=$(now_ms)
  timeout 40 rdma link delete rxe0
  echo "link-delete: b: rdma link delete exited $? after $(($(now_ms) - t0)) ms"
  rdma link show
  sleep 3
  out=$(rdma link add rxe0 type rxe netdev "$nic" 2>&1)
  echo "link-delete: b: rdma link add exited $? $out"
  touch "$ctl/readded"
  wait_for done 200
  echo "link-delete: b: server alive: $(kill -0 "$pid" 2>/dev/null && echo yes || echo no)"
  grep -v "level=info" "$ctl/b-server.log" | tail -20
  stop_server "$pid"
  exit 0
fi

wait_for ready 300
start_drive "$fault_rpc" "rdma://$RXE_VM_PEER_IP:$port" link-delete --expect=any
sleep 5
touch "$ctl/delete"
wait_for readded 100
sleep 15
finish_drive
echo "link-delete: a: $verdict"
touch "$ctl/done"
