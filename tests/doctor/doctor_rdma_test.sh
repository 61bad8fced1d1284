#!/bin/bash
# `rdmarpc doctor` against a real device (label rdma; in the Soft-RoCE VM:
# `tools/rxe-vm -- ctest --test-dir build -L rdma -R doctor`). The device is
# RDMARPC_TEST_DEVICE, else the harness's RXE_VM_DEV (tests/support/rdma_env.h).
#   * the device's port 1 is ACTIVE and ok, a Soft-RoCE device is called one,
#     and there is a memlock finding;
#   * under `ulimit -l 64` memlock fails, with its fix line, and the exit
#     status is non-zero.
# Usage: doctor_rdma_test.sh <path to the rdmarpc binary>
set -u
BIN=$1
DEV=${RDMARPC_TEST_DEVICE:-${RXE_VM_DEV:-}}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

if [ -z "$DEV" ]; then
  echo "no test device: run inside tools/rxe-vm (RXE_VM_DEV) or set RDMARPC_TEST_DEVICE"
  exit 1
fi

# Unlimited locked memory where we may set it (root in the VM), so that the
# only thing this run can fail on is the device.
raised=0
if (ulimit -l unlimited) 2>/dev/null; then raised=1; fi

run() {  # run LIMIT ARGS...: the doctor under `ulimit -l LIMIT` (or as is)
  local limit=$1; shift
  if [ "$limit" = keep ]; then "$BIN" doctor "$@"; else sh -c 'ulimit -l "$0" && exec "$@"' "$limit" "$BIN" doctor "$@"; fi
}

limit=keep; [ $raised -eq 1 ] && limit=unlimited
out=$(run $limit --device "$DEV" --sample-ms 300 2>&1); rc=$?
echo "$out"
echo "--- exit status $rc"
esc=$(printf '%s' "$DEV" | sed 's/[.[\*^$]/\\&/g')
echo "$out" | grep -Eq "^ok +port +$esc/1 +ACTIVE" || fail "no 'ok port $DEV/1 ACTIVE' row"
echo "$out" | grep -Eq "^(ok|warn|fail) +memlock +host +RLIMIT_MEMLOCK" || fail "no memlock finding"
case "$DEV" in
  rxe*) echo "$out" | grep -Eq "^warn +soft_roce +$esc +$esc is Soft-RoCE" || fail "$DEV is not reported as Soft-RoCE" ;;
esac
if [ $raised -eq 1 ]; then
  echo "$out" | grep -Eq "^ok +memlock +host +RLIMIT_MEMLOCK unlimited" || fail "unlimited memlock is not ok"
  [ $rc -eq 0 ] || fail "exit status $rc with a healthy device and unlimited memlock, want 0"
fi

json=$(run $limit --json --device "$DEV" --sample-ms 0 2>/dev/null)
printf '%s' "$json" | DEV="$DEV" python3 -c '
import json, os, sys
dev = os.environ["DEV"]
doc = json.load(sys.stdin)
assert [d["name"] for d in doc["devices"]] == [dev], doc["devices"]
port = doc["devices"][0]["ports"][0]
assert port["port"] == 1 and port["state"] == "ACTIVE", port
assert port["active_mtu"] > 0 and port["max_mtu"] >= port["active_mtu"], port
if port["link_layer"] == "Ethernet":
    assert any(g["type"] == "RoCE v2" for g in port["gids"]), port["gids"]
by = {(f["check"], f["subject"]): f for f in doc["findings"]}
assert by[("port", dev + "/1")]["status"] == "ok", by[("port", dev + "/1")]
assert ("memlock", "host") in by
if dev.startswith("rxe"):
    assert by[("soft_roce", dev)]["status"] == "warn" and "Soft-RoCE" in by[("soft_roce", dev)]["message"]
' || fail "--json: unexpected document:"$'\n'"$json"

# A 64 KiB limit: memlock fails, says how to fix it, and the exit status says so.
out=$(run 64 --device "$DEV" --sample-ms 0 2>&1); rc=$?
echo "$out" | grep -A1 -E "memlock"
echo "--- exit status $rc under ulimit -l 64"
[ $rc -ne 0 ] || fail "exit status 0 under ulimit -l 64"
echo "$out" | grep -Eq "^fail +memlock +host +RLIMIT_MEMLOCK 64 KiB" || fail "memlock is not 'fail ... 64 KiB'"
echo "$out" | grep -A1 -E "^fail +memlock" | tail -1 | grep -Eq "^ +fix: .*ulimit -l unlimited.*LimitMEMLOCK=infinity" ||
  fail "the memlock finding has no fix line"
json=$(run 64 --json --device "$DEV" --sample-ms 0 2>/dev/null); rc=$?
[ $rc -ne 0 ] || fail "--json: exit status 0 under ulimit -l 64"
printf '%s' "$json" | python3 -c '
import json, sys
doc = json.load(sys.stdin)
m = [f for f in doc["findings"] if f["check"] == "memlock"][0]
assert m["status"] == "fail" and "ulimit -l" in m["fix"], m
assert doc["host"]["memlock"]["soft"] == 64 * 1024, doc["host"]["memlock"]
assert doc["status"] == "fail"
' || fail "--json under ulimit -l 64:"$'\n'"$json"

if [ $failures -ne 0 ]; then echo "$failures check(s) failed"; exit 1; fi
echo "all checks passed"
