#!/usr/bin/env bash
# kube-apiserver, kubectl and etcd for the integration tests and `make testenv`; kube-controller-manager
# for the control-plane Service migration test (controller/tests/kvmcluster.rs runs its endpoint
# controllers against the test apiserver).
exec bash "$(dirname "${BASH_SOURCE[0]}")/../build-upstream.sh" kube-apiserver kubectl etcd kube-controller-manager
