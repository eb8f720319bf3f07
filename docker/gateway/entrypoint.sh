#!/bin/sh
# smg for the compose `gateway` profile: flags from the environment, secrets from files (docs/gateway.md).
#   /gateway/workers.json            the discovery manifest, kept by gateway-discovery (python -m clients.discovery)
#   /gateway/tokenizer/MODEL/        the workers' tokenizer bundle (smg matches MODEL to the workers' model)
#   SMG_TLS_CERT, SMG_TLS_KEY        the OpenAI API's server certificate (required unless SMG_ALLOW_PLAINTEXT=1)
#   SMG_API_KEY_FILE                 the API key clients send as "Authorization: Bearer KEY" (required, same rule)
#   SMG_POLICY                       routing policy (cache_aware: by prefix, fed by the workers' KV events)
#   SMG_ARGS                         more smg launch flags, split on spaces
# Extra arguments are passed to `smg launch` as they are.
set -eu
die() { echo "smg-entrypoint: $*" >&2; exit 64; }
tok=$(ls -d /gateway/tokenizer/*/ 2>/dev/null | head -n 1)
[ -n "$tok" ] || die "no tokenizer under /gateway/tokenizer (gateway-discovery writes it once a worker is SERVING)"
set -- --host 0.0.0.0 --port 8443 --prometheus-host 0.0.0.0 --prometheus-port 29000 \
    --discovery-provider file --discovery-file /gateway/workers.json --discovery-check-interval-secs 5 \
    --tokenizer-path "${tok%/}" --policy "${SMG_POLICY:-cache_aware}" \
    --health-check-interval-secs "${SMG_HEALTH_INTERVAL:-2}" --health-failure-threshold 2 "$@"
# shellcheck disable=SC2086 # split on purpose: SMG_ARGS holds several flags
set -- "$@" ${SMG_ARGS:-}
if [ "${SMG_ALLOW_PLAINTEXT:-}" != 1 ]; then
    for f in "${SMG_TLS_CERT:-}" "${SMG_TLS_KEY:-}" "${SMG_API_KEY_FILE:-}"; do
        [ -n "$f" ] && [ -r "$f" ] || die "missing $f: the gateway needs SMG_TLS_CERT, SMG_TLS_KEY and SMG_API_KEY_FILE (or SMG_ALLOW_PLAINTEXT=1)"
    done
fi
[ -n "${SMG_TLS_CERT:-}" ] && [ -r "$SMG_TLS_CERT" ] && set -- "$@" --tls-cert-path "$SMG_TLS_CERT" --tls-key-path "$SMG_TLS_KEY"
# smg takes the key on its command line only; it is read here, from a file, so it is not in the compose file.
[ -n "${SMG_API_KEY_FILE:-}" ] && [ -r "$SMG_API_KEY_FILE" ] && set -- "$@" --api-key "$(cat "$SMG_API_KEY_FILE")"
exec smg launch "$@"
