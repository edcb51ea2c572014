#!/usr/bin/env bash
# kube-apiserver, kubectl and etcd for the integration tests and `make testenv`.
exec bash "$(dirname "${BASH_SOURCE[0]}")/../build-upstream.sh" kube-apiserver kubectl etcd
