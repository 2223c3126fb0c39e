#!/usr/bin/env bash
# Runs rtflow's whole test suite: unit, integration and doc tests of every crate,
# and builds the examples. Needs nothing but Rust; CI runs it through .ci/run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

cargo test --workspace --all-features "$@"
