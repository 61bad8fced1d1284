#!/usr/bin/env bash
# harness_two_host_netem: a real RDMA transfer crosses the emulated wire between two VMs, once
# clean and once with netem dropping 10% of a's frames. Both must succeed (RC retransmits), and
# the lossy one must show it: netem's drop count > 0 and rxe's retransmit counters above the
# clean run's.
#
#   two_host_netem.sh path/to/tools/rxe-vm     (host side: boots the VMs)
#   two_host_netem.sh --side a|b               (inside the VMs)
#
# Transfer: rping (rdmacm-utils) over rdma_cm, 10 validated iterations of 16 KiB: each one is a
# SEND, an RDMA READ of a's buffer, an RDMA WRITE into it and more SENDs, so requests, responses
# and ACKs all cross the lossy direction. b serves, a connects; the loss is on for the whole
# lossy run, connection setup included (the kernel CM retries lost REQ/REP/RTU). Notes:
# - Ack timeout: rping (like most rdma_cm users) leaves the QP ack timeout to rdma_cm, whose
#   RoCE default is about 0.5 s. It is non-zero, so rxe's retransmit timer is armed and a lost
#   single-packet message costs a timeout, not a hang; completer_retry_err counts those retries
#   (rcvd_seq_err counts the NAK-driven ones). A QP with timeout 0 would never retransmit on rxe.
# - It is slow: about 2 s per iteration under 10% loss on TCG (vs 0.15 s clean), mostly those
#   timeouts. perftest's ib_write_bw -R was tried first: with loss during its two-step rdma_cm
#   setup it was sometimes REJECTED (reason 8) and then crashed, and its duration mode reported
#   0 writes in a measured window full of stalls.
set -euo pipefail

if [ "${1:-}" != --side ]; then
  rxe_vm=${1:?usage: two_host_netem.sh path/to/tools/rxe-vm}
  command -v rping >/dev/null || { echo "harness_two_host_netem: needs rping on the host (rdmacm-utils)"; exit 1; }
  self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  rc=0
  "$rxe_vm" --hosts 2 --timeout 1500 \
    --a "bash $(printf %q "$self") --side a" --b "bash $(printf %q "$self") --side b" 2>&1 |
    tee "$log" || rc=$?
  [ "$rc" = 0 ] || { echo "harness_two_host_netem: FAIL (rxe-vm exited $rc)"; exit 1; }
  # The exit status already says a passed; the verdict line guards against a command that
  # silently did nothing.
  grep -q '^\[a\] netem-test: PASS' "$log" || { echo "harness_two_host_netem: FAIL (no PASS line from a)"; exit 1; }
  echo "harness_two_host_netem: PASS"
  exit 0
fi

side=${2:?}
dev=$RXE_VM_DEV ctl=$RXE_VM_CTL nic=$RXE_VM_NETDEV
ping_args=(-C 10 -S 16384 -V)
fail() {
  echo "netem-test: FAIL: $*"
  # Don't leave the other side waiting for a peer that gave up.
  touch "$ctl/poweroff-$([ "$side" = a ] && echo b || echo a)"
  exit 1
}
counters() { local f; for f in /sys/class/infiniband/"$dev"/ports/1/hw_counters/*; do echo "${f##*/} $(cat "$f")"; done; }
wait_for() {  # wait_for FILE SECONDS
  local i
  for ((i = 0; i < $2 * 5; i++)); do [ -e "$ctl/$1" ] && return 0; sleep 0.2; done
  fail "gave up waiting for $1 after $2 s"
}
port_of() { [ "$1" = clean ] && echo 7471 || echo 7472; }

if [ "$side" = b ]; then
  counters >"$ctl/b-start"
  for round in clean lossy; do
    port=$(port_of "$round")
    timeout 900 rping -s -a "$RXE_VM_SELF_IP" -p "$port" "${ping_args[@]}" &
    pid=$!
    # rdma_cm listens are visible to `rdma res`: the client must not connect before that.
    for ((i = 0; i < 150; i++)); do
      rdma res show cm_id 2>/dev/null | grep -q "LISTEN.*:$port" && break
      sleep 0.2
    done
    rdma res show cm_id | grep -q "LISTEN.*:$port" || fail "server for the $round run never listened"
    touch "$ctl/ready-$round"
    # a's client validates every iteration and judges. rping's server can end non-zero after
    # a complete run when the client's DISCONNECT overtakes its last READ_ADV ("wait for
    # RDMA_READ_ADV state 10"; seen under loss): reported, not a failure. b's counters are
    # written either way, so a never waits for a peer that gave up.
    # It can also never end: after "wait for RDMA_READ_ADV state 10" the server may block for
    # good (seen under loss in CI). Once a's client has finished the round, the server gets 20 s
    # to end by itself, then it is stopped; b reports that and goes on.
    until_ts=
    while kill -0 "$pid" 2>/dev/null; do
      if [ -z "$until_ts" ] && [ -e "$ctl/a-done-$round" ]; then until_ts=$((SECONDS + 20)); fi
      if [ -n "$until_ts" ] && [ "$SECONDS" -ge "$until_ts" ]; then
        echo "netem-test: note: rping server of the $round run still running 20 s after a's client finished; stopping it"
        kill "$pid" 2>/dev/null || true
        break
      fi
      sleep 0.2
    done
    rc=0; wait "$pid" || rc=$?
    [ "$rc" = 0 ] || echo "netem-test: note: rping server of the $round run exited $rc"
    counters >"$ctl/b-$round"
  done
  exit 0
fi

# side a: the client, and the one that judges.
transfer() {  # transfer ROUND
  local round=$1 rc start=$SECONDS
  wait_for "ready-$round" 300
  rc=0; timeout 900 rping -c -a "$RXE_VM_PEER_IP" -p "$(port_of "$round")" "${ping_args[@]}" || rc=$?
  [ "$rc" = 0 ] || fail "$round transfer failed (rping exit $rc)"
  touch "$ctl/a-done-$round"
  echo "netem-test: $round transfer: 10 validated rping iterations of 16 KiB in $((SECONDS - start)) s"
}

# Resolve b's MAC while the wire is clean; rdma_cm's address resolution then needs no ARP.
busybox ping -c 2 -W 2 "$RXE_VM_PEER_IP" >/dev/null || fail "b does not answer pings"
counters >"$ctl/a-start"
transfer clean
counters >"$ctl/a-clean"
tc qdisc add dev "$nic" root netem loss 10% || fail "tc qdisc add netem failed"
transfer lossy
counters >"$ctl/a-lossy"
tc -s qdisc show dev "$nic"
dropped=$(tc -s qdisc show dev "$nic" | sed -n 's/.*(dropped \([0-9]*\),.*/\1/p' | head -n1)
tc qdisc del dev "$nic" root || true
wait_for b-lossy 300

# Deltas per counter, side and round; "evidence" sums the counters that only move when RC
# recovers from loss: retries (timer or NAK driven), duplicates, out-of-sequence packets.
report=$(awk '
  FNR == 1 { n = split(FILENAME, p, "/"); split(p[n], q, "-"); s = q[1]; r = q[2] }
  { v[s, r, $1] = $2; names[$1] = 1 }
  END {
    printf "%-24s %8s %8s %8s %8s\n", "counter (delta)", "a.clean", "a.lossy", "b.clean", "b.lossy"
    for (c in names) {
      ac = v["a","clean",c] - v["a","start",c]; al = v["a","lossy",c] - v["a","clean",c]
      bc = v["b","clean",c] - v["b","start",c]; bl = v["b","lossy",c] - v["b","clean",c]
      if (ac || al || bc || bl) printf "%-24s %8d %8d %8d %8d\n", c, ac, al, bc, bl
      if (c ~ /^(rcvd_seq_err|completer_retry_err|duplicate_request|out_of_seq_request)$/) {
        ec += ac + bc; el += al + bl
      }
    }
    printf "evidence %d %d\n", ec, el
  }' "$ctl"/a-start "$ctl"/a-clean "$ctl"/a-lossy "$ctl"/b-start "$ctl"/b-clean "$ctl"/b-lossy)
echo "$report" | grep -v '^evidence'
read -r _ ev_clean ev_lossy <<<"$(echo "$report" | grep '^evidence')"
echo "netem-test: netem dropped ${dropped:-?} frames; retransmit evidence clean=$ev_clean lossy=$ev_lossy" \
     "(rcvd_seq_err + completer_retry_err + duplicate_request + out_of_seq_request, both sides)"
[ "${dropped:-0}" -gt 0 ] || fail "netem reports no dropped frames"
[ "$ev_lossy" -gt "$ev_clean" ] || fail "rxe counters show no more retransmission under loss than without"
echo "netem-test: PASS"
