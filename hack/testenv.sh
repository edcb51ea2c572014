#!/usr/bin/env bash
# `make testenv` / `make testenv-down`: etcd + kube-apiserver with the CRDs, in the background.
# The last line of `up` is the kubeconfig path.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
exec cargo run -q -p capk-tests --bin capk-testenv -- "$@"
