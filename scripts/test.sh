#!/usr/bin/env bash
# Runs rtflow's whole test suite: unit, integration and doc tests of every crate,
# and builds the examples. The Kafka tests run against a real Apache Kafka broker:
# this script installs and starts one with scripts/kafka.sh (Java 17 and Maven
# needed), or reuses one already started from this checkout, and stops what it
# started when the tests end. CI runs it through .ci/run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if status="$(scripts/kafka.sh status 2>&1)"; then
    port="${status##*127.0.0.1:}"
    echo "test.sh: reusing the running Kafka broker at 127.0.0.1:$port"
else
    port="${RTFLOW_KAFKA_PORT:-9092}"
    RTFLOW_KAFKA_PORT="$port" scripts/kafka.sh start
    trap 'scripts/kafka.sh stop' EXIT
fi
export RTFLOW_KAFKA_BOOTSTRAP="127.0.0.1:$port"

cargo test --workspace --all-features "$@"
