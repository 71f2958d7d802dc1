#!/usr/bin/env bash
# N radixcache replicas on one Redis behind SGLang's model gateway (SMG), all on loopback.
#
#   examples/cluster.sh [N]          # default 2 replicas; Ctrl-C stops everything
#
# Starts a redis-server (127.0.0.1:$REDIS_PORT, nothing persisted), N `radixcache serve` replicas
# on ports $BASE_PORT.. with `--store` on that Redis and `--kv-events` on ports $EVENTS_PORT..,
# then `smg launch --policy $POLICY` on 127.0.0.1:$ROUTER_PORT in front of them. Point any OpenAI
# client at http://127.0.0.1:$ROUTER_PORT/v1. SMG keeps a session on the replica that holds its
# prefix (cache_aware); a session routed elsewhere loads its blocks from Redis.
#
# Environment: SERVE_ARGS (extra `radixcache serve` options, e.g. "--model DIR"), SMG_ARGS (extra
# `smg launch` options; with "--api-key K" in SERVE_ARGS, put "--api-key K" here too), POLICY
# (cache_aware), BASE_PORT (8001), ROUTER_PORT (30000), METRICS_PORT (29000: SMG's Prometheus),
# REDIS_PORT (6390), EVENTS_PORT (5557), RADIXCACHE (radixcache), SMG (smg), REDIS_SERVER
# (redis-server). From a checkout: `make setup && PATH=.venv/bin:$PATH examples/cluster.sh 2`.
set -euo pipefail

N=${1:-2}
POLICY=${POLICY:-cache_aware}
BASE_PORT=${BASE_PORT:-8001}
ROUTER_PORT=${ROUTER_PORT:-30000}
METRICS_PORT=${METRICS_PORT:-29000}
REDIS_PORT=${REDIS_PORT:-6390}
EVENTS_PORT=${EVENTS_PORT:-5557}
RADIXCACHE=${RADIXCACHE:-radixcache}
SMG=${SMG:-smg}
REDIS_SERVER=${REDIS_SERVER:-redis-server}
read -r -a EXTRA <<< "${SERVE_ARGS:-}"
read -r -a SMG_EXTRA <<< "${SMG_ARGS:-}"

PIDS=()
stop() {
  trap - INT TERM EXIT
  echo "cluster: stopping" >&2
  for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  wait || true
}
trap stop INT TERM EXIT

"$REDIS_SERVER" --bind 127.0.0.1 --port "$REDIS_PORT" --save '' --appendonly no --loglevel warning &
PIDS+=($!)

URLS=()
for ((i = 0; i < N; i++)); do
  port=$((BASE_PORT + i))
  "$RADIXCACHE" serve --host 127.0.0.1 --port "$port" --store "redis://127.0.0.1:$REDIS_PORT/0" \
    --kv-events "tcp://127.0.0.1:$((EVENTS_PORT + i))" "${EXTRA[@]}" &
  PIDS+=($!)
  URLS+=("http://127.0.0.1:$port")
done

for url in "${URLS[@]}"; do  # the model loads in each replica (a minute or so on a CPU)
  until curl -sf "$url/health" > /dev/null; do
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null || { echo "cluster: a process exited" >&2; exit 1; }; done
    sleep 1
  done
  echo "cluster: $url is up" >&2
done

"$SMG" launch --host 127.0.0.1 --port "$ROUTER_PORT" --prometheus-host 127.0.0.1 \
  --prometheus-port "$METRICS_PORT" --policy "$POLICY" --worker-urls "${URLS[@]}" \
  --worker-startup-check-interval 1 --load-monitor-interval 1 --shutdown-grace-period-secs 0 \
  "${SMG_EXTRA[@]}" &
PIDS+=($!)
until curl -sf "http://127.0.0.1:$ROUTER_PORT/readiness" > /dev/null; do sleep 0.5; done
echo "cluster: $N replicas behind SMG ($POLICY) on http://127.0.0.1:$ROUTER_PORT/v1 (Ctrl-C stops)" >&2
wait -n "${PIDS[@]}"
echo "cluster: a process exited" >&2
