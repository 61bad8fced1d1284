#!/usr/bin/env bash
# rdmarpc_bench's two-host roles, on one host: --role=server in the
# background, --role=client against it over loopback. Checks that every
# transport asked for produced a row with calls and no errors, that the
# client reports no server CPU (it cannot see the other host), and that the
# server stops cleanly on SIGTERM.
#   bench_roles_test.sh BENCH TRANSPORTS      (e.g. tcp or tcp,grpc)
set -uo pipefail
bench=$1
transports=$2
out=$(mktemp -d)
trap 'kill $spid 2>/dev/null; rm -rf "$out"' EXIT

# A random port below Linux's ephemeral range (32768+), so no outgoing
# connection of a test running beside this one holds it; a server that still
# exits at once (port taken) is retried on another port, three times at most.
for attempt in 1 2 3; do
  port=$((20000 + RANDOM % 12000))
  "$bench" --role=server --ip=127.0.0.1 --port=$port --transport="$transports" >"$out/server.log" 2>&1 &
  spid=$!
  for _ in $(seq 100); do
    grep -q "server ready" "$out/server.log" && break
    kill -0 $spid 2>/dev/null || break
    sleep 0.1
  done
  grep -q "server ready" "$out/server.log" && break
  kill -0 $spid 2>/dev/null && break  # running but not ready: judged below
  echo "server exited on port $port (attempt $attempt):"; cat "$out/server.log"
done
kill -0 $spid 2>/dev/null || grep -q "server ready" "$out/server.log" || { echo "FAIL: server exited"; exit 1; }
grep -q "server ready" "$out/server.log" || { echo "FAIL: server not ready in 10 s"; cat "$out/server.log"; exit 1; }

"$bench" --role=client --server=127.0.0.1 --port=$port --transport="$transports" --size=64,4096 --concurrency=1,4 \
         --warmup=100 --duration=400 --json --no-progress >"$out/rows.json" 2>"$out/client.log"
rc=$?
cat "$out/rows.json"
[ $rc -eq 0 ] || { echo "FAIL: client exit $rc"; cat "$out/client.log"; exit 1; }

fail=0
IFS=, read -ra ts <<<"$transports"
for t in "${ts[@]}"; do
  n=$(grep -c "\"transport\":\"$t\"" "$out/rows.json")
  [ "$n" -eq 4 ] || { echo "FAIL: $t: $n rows, expected 4 (2 sizes x 2 concurrencies)"; fail=1; }
done
python3 - "$out/rows.json" <<'PY' || fail=1
import json, sys
bad = 0
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r["count"] <= 0 or r.get("errors", 0) != 0:
        print("FAIL: row without calls or with errors:", line.strip()); bad = 1
    if r.get("server_cpu_pct") not in (None, -1, -1.0):
        print("FAIL: the client cannot measure the server's CPU, yet reports", r.get("server_cpu_pct")); bad = 1
sys.exit(bad)
PY

kill -TERM $spid
for _ in $(seq 50); do kill -0 $spid 2>/dev/null || break; sleep 0.1; done
if kill -0 $spid 2>/dev/null; then echo "FAIL: server still running 5 s after SIGTERM"; fail=1; fi
wait $spid; src=$?
[ $src -eq 0 ] || { echo "FAIL: server exit $src after SIGTERM"; cat "$out/server.log"; fail=1; }
grep -q "stopping" "$out/server.log" || { echo "FAIL: server did not log its stop"; fail=1; }
[ $fail -eq 0 ] && echo "PASS: roles over $transports"
exit $fail
