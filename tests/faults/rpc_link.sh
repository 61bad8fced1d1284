#!/usr/bin/env bash
# faults_rpc_link (issue 8, scenario 2): a's link goes down under load, calls of 64 B and 4 KiB
# (eager SENDs) and 64 KiB and 1 MiB (RDMA WRITEs), 8 in flight, 30 s deadlines, one channel,
# 35 s of calls before the flap (>= 1,000 calls a round, checked).
#   link-short: a's wire cut for 0.3 s, timed on the host (tools/rxe-vm drops every frame to and
#               from a in qemu; no carrier change), inside RC's retry budget (ACK timeout 14 =
#               67 ms, 7 retries: ~0.5 s on hardware; unbounded on rxe) and keepalive's: every
#               call succeeds, and the cut dropped frames.
#   cut-long:   the same cut for 8 s, keepalive 1 s + 1 s on both ends: a side that hears
#               nothing for 1 s sends a PING, nothing back within 1 s more closes the
#               connection; calls fail UNAVAILABLE, the first within 5 s; then as link-long.
#               (With the default keepalive, 10 s + 10 s, the 8 s cut is ridden out: rxe
#               retries forever at retry count 7, so calls just wait.)
#   link-long:  `ip link set down` on a for 30 s (the port goes DOWN), the default keepalive
#               (10 s + 10 s, a tick of 2.5 s: a silent connection is closed within 25 s of its
#               last frame): calls fail UNAVAILABLE (no other status), the first within 27 s
#               of the link going down (sooner when a's QP has something to send: rxe finds no
#               route); after link up the same channel reconnects and at least 20 calls in a
#               row succeed. (An 8 s outage was used until 2026-12-05; when a's QP had nothing
#               outstanding, rxe retried b's frames until link up and no call failed.)
#   link-keepalive: `ip link set down` for 8 s with keepalive 1 s + 1 s on both ends (bound
#               5 s), so both sides declare the connection dead while the link is down (the
#               case that left Debian 6.1's rxe refusing every rdma_cm connection before
#               rdmarpc held DREQs for the port).
# RPC_LINK_RECOVER_S (default 20): how long calls run after link up before the verdict.
# All: every call completes exactly once, none past its deadline + 2 s, a's rdma resources
# back at baseline.
#
#   rpc_link.sh path/to/tools/rxe-vm path/to/fault_rpc [SCENARIOS]   (host side: boots the VMs;
#       default: link-short cut-long link-long link-keepalive)
#   rpc_link.sh --side SCENARIO a|b path/to/fault_rpc                 (inside the VMs)
set -euo pipefail
bound_ms=5000

if [ "${1:-}" != --side ]; then
  rxe_vm=${1:?usage: rpc_link.sh path/to/tools/rxe-vm path/to/fault_rpc [SCENARIOS]}
  fault_rpc=${2:?}
  self=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
  log=$(mktemp)
  trap 'rm -f "$log"' EXIT
  fails=0
  for scenario in ${3:-link-short cut-long link-long link-keepalive}; do
    rc=0
    "$rxe_vm" --hosts 2 --timeout 500 --env RPC_LINK_RECOVER_S="${RPC_LINK_RECOVER_S:-20}" --env RPC_LINK_PCAP="${RPC_LINK_PCAP:-}" \
      --env RPC_LINK_ACK_TIMEOUT="${RPC_LINK_ACK_TIMEOUT:-}" \
      --a "bash $(printf %q "$self") --side $scenario a $(printf %q "$fault_rpc")" \
      --b "bash $(printf %q "$self") --side $scenario b $(printf %q "$fault_rpc")" 2>&1 | tee -a "$log" || rc=$?
    [ "$rc" = 0 ] || { echo "faults_rpc_link: $scenario: FAIL (rxe-vm exited $rc)"; fails=$((fails + 1)); continue; }
    grep -q "^\[a\] rpc-link: $scenario: PASS" "$log" ||
      { echo "faults_rpc_link: $scenario: FAIL (no PASS line)"; fails=$((fails + 1)); }
  done
  echo
  echo "faults_rpc_link: summary"
  grep -E '^\[[ab]\] (fault-rpc|rpc-link):' "$log" || true
  [ "$fails" = 0 ] || { echo "faults_rpc_link: FAIL"; exit 1; }
  echo "faults_rpc_link: PASS"
  exit 0
fi

scenario=${2:?} side=${3:?} fault_rpc=${4:?}
ctl=$RXE_VM_CTL nic=$RXE_VM_NETDEV port=7483
# What each side's rdma_cm did with its connections (b's server log is in the shared directory).
cm_story() {
  echo "rpc-link: b's server:"
  grep -E 'cm_id_released|connection_failed|event=cm |accept' "$ctl/b-server.log" 2>/dev/null | head -n 30 || true
  echo "rpc-link: a's client:"
  grep -E 'cm_id_released' "${drive_out:-/dev/null}" 2>/dev/null | head -n 20 || true
}
fail() {
  echo "rpc-link: $scenario: FAIL: $*"
  [ "$side" = a ] && cm_story
  ip link set dev "$nic" up 2>/dev/null || true
  # The peer waits for done: pings tell a stalled emulated wire from an rdmarpc failure.
  wire_check || true
  touch "$ctl/done"
  exit 1
}
# shellcheck source=common.sh
. "$(dirname "$0")/common.sh"

both_ends=()
# RPC_LINK_PCAP=DIR: each side records its rdma_cm MADs (RoCEv2 packets to QP 1) in DIR/SIDE.pcap.
if [ -n "${RPC_LINK_PCAP:-}" ]; then
  tcpdump -i "$nic" -nn -U -w "$RPC_LINK_PCAP/$side.pcap" 'udp port 4791 and (udp[12:4] & 0xffffff) = 1' 2>/dev/null &
fi
# Options both ends get.
case $scenario in link-keepalive|cut-long) both_ends=(--keepalive-ms=1000,1000) ;; esac
# RPC_LINK_ACK_TIMEOUT=N: link-short with another RC ACK timeout on both ends (2^N x 4.096 us).
[ "$scenario" = link-short ] && [ -n "${RPC_LINK_ACK_TIMEOUT:-}" ] && both_ends=(--ack-timeout="$RPC_LINK_ACK_TIMEOUT")
if [ "$side" = b ]; then
  RDMARPC_LOG=info "$fault_rpc" serve --listen="rdma://$RXE_VM_SELF_IP:$port" "${both_ends[@]}" >"$ctl/b-server.log" 2>&1 &
  pid=$!
  wait_listening "$port" "$pid" "$ctl/b-server.log"
  touch "$ctl/ready"
  wait_for done 350
  stop_server "$pid"
  exit 0
fi

# side a
busybox ping -c 2 -W 2 "$RXE_VM_PEER_IP" >/dev/null || fail "b does not answer pings"
wait_for ready 300
baseline=$(res_counts)
case $scenario in
  link-short) cut_ms=300 expect=ok ;;
  cut-long) cut_ms=8000 expect=any ;;
  link-long|link-keepalive) cut_ms='' expect=any ;;
  *) fail "unknown scenario $scenario" ;;
esac
RDMARPC_LOG=info start_drive "$fault_rpc" "rdma://$RXE_VM_PEER_IP:$port" "$scenario" --expect=$expect "${both_ends[@]}" \
  --sizes=64,4096,65536,1048576
sleep 35  # calls before the flap: >= 1,000 calls a round (calls_at_least)
kill -0 $drive 2>/dev/null || { cat "$drive_out"; fail "the drive ended before the link went down"; }
t0=$(now_ms)
if [ -n "$cut_ms" ]; then
  # The wire cut from the host for exactly cut_ms (tools/rxe-vm: a qemu filter drops every
  # frame to and from a; the guests' NICs see no carrier change).
  echo "$cut_ms" >"$ctl/cut-a.req"
  mv "$ctl/cut-a.req" "$ctl/cut-a"
  wait_for cut-a.done 30
  cut=$(cat "$ctl/cut-a.done")
  case $cut in down_unix_ms=*) ;; *) fail "the host could not cut the wire: $cut" ;; esac
  field() { sed -n "s/.*$1=\([0-9]*\).*/\1/p" <<<"$cut"; }
  down=$(field down_unix_ms) up=$(field up_unix_ms) dropped=$(field dropped_frames)
  # The outage on our clock (calls' times are ours).
  offset=$(host_clock_offset_ms)
  t0=$((down - offset)) t1=$((up - offset))
  echo "rpc-link: $scenario: a's wire was cut for $((up - down)) ms, $dropped frames dropped (host clock, $offset ms ahead of ours)"
  [ "${dropped:-0}" -gt 0 ] || fail "the cut dropped no frame: it cut nothing"
else
  ip link set dev "$nic" down
  if [ "$scenario" = link-long ]; then sleep 30; bound_ms=27000; else sleep 8; fi
  ip link set dev "$nic" up
  t1=$(now_ms)
  echo "rpc-link: $scenario: link was down for $((t1 - t0)) ms"
fi
ip -br addr show dev "$nic"; ip route; rdma link show
sleep "${RPC_LINK_RECOVER_S:-20}"  # recovery, reconnect, calls on the new connection
finish_drive
calls_at_least "$verdict" 1000
cm_story
if [ "$scenario" = link-short ]; then
  echo "rpc-link: $scenario: slowest call $(sed -n 's/.*max_latency_ms=\([0-9]*\).*/\1/p' <<<"$verdict") ms"
else
  [ -n "$first_failure_ms" ] && [ "$first_failure_ms" != 0 ] || fail "no call failed during a $((t1 - t0)) ms outage"
  recovery="never"
  [ -n "$recovered_ms" ] && [ "$recovered_ms" != 0 ] && recovery="$((recovered_ms - t1)) ms after link up"
  echo "rpc-link: $scenario: first call failed $((first_failure_ms - t0)) ms after the link went down (bound $bound_ms ms); calls succeed again $recovery; $ok_streak calls OK in a row since"

  [ $((first_failure_ms - t0)) -le $bound_ms ] || fail "the outage was noticed after $((first_failure_ms - t0)) ms, bound $bound_ms ms"
  [ "${ok_streak:-0}" -ge 20 ] || fail "only ${ok_streak:-0} calls succeeded after link up (want >= 20): no reconnect?"
  statuses=$(sed -n 's/.*statuses={\([^}]*\)}.*/\1/p' <<<"$verdict")
  if grep -qvE '^(OK|UNAVAILABLE)=' <<<"$(tr ',' '\n' <<<"$statuses")"; then
    fail "statuses other than OK and UNAVAILABLE: $statuses"
  fi
fi
res_settle "$baseline" 10 || true
echo "rpc-link: $scenario: rdma resources before $baseline, after $now"
[ "$now" = "$baseline" ] || fail "rdma resources not back at baseline ($baseline -> $now)"
touch "$ctl/done"
echo "rpc-link: $scenario: PASS"
