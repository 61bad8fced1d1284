#!/bin/bash
# `rdmarpc doctor` on a host without any RDMA device (label unit): it says so,
# points to the Soft-RoCE harness, exits non-zero; --json is one valid JSON
# document; bad flags and commands exit 2 naming what was wrong.
# Usage: doctor_cli_test.sh <path to the rdmarpc binary>
set -u
BIN=$1
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
expect_rc() {  # expect_rc WANT GOT WHAT
  [ "$2" -eq "$1" ] || fail "$3: exit status $2, want $1"
}
expect_in() {  # expect_in TEXT NEEDLE WHAT
  case "$1" in *"$2"*) ;; *) fail "$3: no '$2' in output:"$'\n'"$1" ;; esac
}

if [ -n "$(ls -A /sys/class/infiniband 2>/dev/null)" ]; then
  echo "this host has RDMA devices ($(ls /sys/class/infiniband | tr '\n' ' ')): the no-device case cannot be tested"
  exit 77
fi

out=$("$BIN" doctor --sample-ms 0 2>&1); rc=$?
expect_rc 1 $rc "doctor without a device"
expect_in "$out" "no RDMA device found" "doctor without a device"
expect_in "$out" "tools/rxe-vm" "doctor without a device"
expect_in "$out" "rdma link add rxe0 type rxe netdev" "doctor without a device"
expect_in "$out" "result: FAIL" "doctor without a device"
echo "$out" | grep -Eq '^fail +devices +host +no RDMA device found' ||
  fail "the devices finding is not an aligned 'fail devices host' row:"$'\n'"$out"

json=$("$BIN" doctor --json --sample-ms 0 2>/dev/null); rc=$?
expect_rc 1 $rc "doctor --json without a device"
printf '%s' "$json" | python3 -c '
import json, sys
doc = json.load(sys.stdin)
assert doc["status"] == "fail", doc["status"]
assert doc["devices"] == [] and doc["present"] == [], doc["devices"]
by = {(f["check"], f["subject"]): f for f in doc["findings"]}
for f in doc["findings"]:
    assert f["status"] in ("ok", "warn", "fail"), f
    assert isinstance(f["message"], str) and "\n" not in f["message"], f
    assert (f["fix"] == "") == (f["status"] == "ok"), f
d = by[("devices", "host")]
assert d["status"] == "fail" and "tools/rxe-vm" in d["fix"], d
assert ("memlock", "host") in by and ("hugepages", "host") in by, list(by)
m = doc["host"]["memlock"]
assert m["need_min"] > 0 and m["need_full"] > m["need_min"], m
assert doc["summary"]["fail"] >= 1
' || fail "--json output is not the expected JSON document:"$'\n'"$json"

err=$("$BIN" doctor --bogus 2>&1 >/dev/null); rc=$?
expect_rc 2 $rc "unknown flag"
expect_in "$err" "unknown option '--bogus'" "unknown flag"

err=$("$BIN" frobnicate 2>&1 >/dev/null); rc=$?
expect_rc 2 $rc "unknown command"
expect_in "$err" "unknown command 'frobnicate'" "unknown command"

err=$("$BIN" doctor --sample-ms soon 2>&1 >/dev/null); rc=$?
expect_rc 2 $rc "bad --sample-ms"
expect_in "$err" "--sample-ms 'soon'" "bad --sample-ms"

err=$("$BIN" doctor --device 2>&1 >/dev/null); rc=$?
expect_rc 2 $rc "--device without a value"
expect_in "$err" "--device needs" "--device without a value"

"$BIN" >/dev/null 2>&1; expect_rc 2 $? "no command"

out=$("$BIN" --help 2>&1); rc=$?
expect_rc 0 $rc "--help"
expect_in "$out" "doctor" "--help"
out=$("$BIN" doctor --help 2>&1); rc=$?
expect_rc 0 $rc "doctor --help"
expect_in "$out" "--sample-ms N" "doctor --help"

if [ $failures -ne 0 ]; then echo "$failures check(s) failed"; exit 1; fi
echo "all checks passed"
