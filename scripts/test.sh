#!/usr/bin/env bash
# Runs rtflow's whole test suite: unit, integration and doc tests of every crate,
# and builds the examples. The Kafka tests run against a real Apache Kafka broker,
# and one test against a replicated cluster of three: this script installs and
# starts them with scripts/kafka.sh (Java 17 and Maven needed), or reuses those
# already started from this checkout, and stops what it started when the tests
# end. CI runs it through .ci/run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# What this script started, stopped when it exits.
stops=""
stop_at_exit() { stops+="$*; "; trap "$stops" EXIT; }

if status="$(scripts/kafka.sh status 2>&1)"; then
    port="${status##*127.0.0.1:}"
    echo "test.sh: reusing the running Kafka broker at 127.0.0.1:$port"
else
    port="${RTFLOW_KAFKA_PORT:-9092}"
    RTFLOW_KAFKA_PORT="$port" scripts/kafka.sh start
    stop_at_exit scripts/kafka.sh stop
fi
export RTFLOW_KAFKA_BOOTSTRAP="127.0.0.1:$port"

# A replicated cluster of three brokers (RTFLOW_KAFKA_CLUSTER_PORT and the five
# ports after it) for the test that crashes a broker under a clustered query.
cluster=(env RTFLOW_KAFKA_NODES=3 RTFLOW_KAFKA_PORT="${RTFLOW_KAFKA_CLUSTER_PORT:-19092}")
if "${cluster[@]}" scripts/kafka.sh status >/dev/null 2>&1; then
    echo "test.sh: reusing the running replicated Kafka cluster"
else
    "${cluster[@]}" scripts/kafka.sh start
    stop_at_exit "${cluster[@]}" scripts/kafka.sh stop
fi
RTFLOW_KAFKA_CLUSTER_BOOTSTRAP="$("${cluster[@]}" scripts/kafka.sh bootstrap)"
export RTFLOW_KAFKA_CLUSTER_BOOTSTRAP

# The Debian package prometheus (~20 MB download) brings promtool, which lints /metrics
# (tests/observability.rs) and runs the alert rules' unit tests, and the
# Prometheus server, which tests/monitoring.rs runs against live queries.
# Without apt, root or network the install fails with a warning and those
# tests are skipped outside CI (in CI they fail).
if ! command -v promtool >/dev/null || ! command -v prometheus >/dev/null; then
    echo "test.sh: installing promtool and prometheus (Debian package prometheus)"
    sudo=()
    if [ "$(id -u)" != 0 ] && command -v sudo >/dev/null; then sudo=(sudo -n); fi
    # Refresh the package lists only if they do not know the package yet.
    if ! { apt-cache policy prometheus 2>/dev/null | grep -q 'Candidate: [0-9]' ||
        timeout 120 "${sudo[@]}" apt-get update -qq; } ||
        ! timeout 300 "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
            apt-get install -y -qq --no-install-recommends prometheus >/dev/null; then
        echo "test.sh: warning: could not install prometheus: the promtool and" \
            "Prometheus tests skip (and fail in CI)" >&2
    fi
fi
if command -v promtool >/dev/null; then
    RTFLOW_PROMTOOL="$(command -v promtool)"
    export RTFLOW_PROMTOOL
fi
if command -v prometheus >/dev/null; then
    RTFLOW_PROMETHEUS="$(command -v prometheus)"
    export RTFLOW_PROMETHEUS
fi

cargo test --workspace --all-features "$@"
