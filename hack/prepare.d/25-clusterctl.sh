#!/usr/bin/env bash
# clusterctl of the pinned Cluster API release, for the controller's clusterctl tests
# (_output/bin/clusterctl). The managers are built on demand by their users (hack/build-capi.sh).
exec bash "$(dirname "${BASH_SOURCE[0]}")/../build-capi.sh" clusterctl
