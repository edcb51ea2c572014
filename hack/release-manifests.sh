#!/usr/bin/env bash
# Builds the clusterctl repository layout for this provider (a clusterctl "local repository"):
#   _output/release/infrastructure-kvm/<version>/{infrastructure-components.yaml,metadata.yaml,
#   cluster-template*.yaml,clusterclass-*.yaml,vpa.yaml,monitoring.yaml,hosting-rbac.yaml,
#   infrastructure-components-namespaced.yaml,watch-namespace-rbac.yaml}
# infrastructure-components.yaml = `kubectl kustomize manifests/default` (CRDs, RBAC, Deployment);
# infrastructure-components-namespaced.yaml = `kubectl kustomize manifests/namespaced`, the same
# for a controller that watches one namespace, with watch-namespace-rbac.yaml applied beside it.
# _output/release/clusterctl.yaml is the `providers:` entry that makes it the provider `kvm`
# (README "The user journey", docs/installing.md; controller/tests/components.rs runs clusterctl
# through it), and
# clusterctl-namespaced.yaml the entry for the namespaced components (clusterctl reads the
# components file the URL names). Their version `latest` is the newest version directory, as
# `clusterctl init --infrastructure kvm` takes it.
# hack/dev/capi.sh copies this version directory into the local MC's repository.
set -euo pipefail
# shellcheck source=lib/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib/common.sh"
cd "$ROOT"
version=v$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
dest=$OUT/release/infrastructure-kvm/$version
kubectl=$BIN/kubectl
[[ -x $kubectl ]] || die "$kubectl missing; run 'make test-deps'"
mkdir -p "$dest"
"$kubectl" kustomize manifests/default >"$dest/infrastructure-components.yaml"
"$kubectl" kustomize manifests/namespaced >"$dest/infrastructure-components-namespaced.yaml"
cp manifests/namespaced/watch-namespace-rbac.yaml "$dest/watch-namespace-rbac.yaml"
cp manifests/metadata.yaml "$dest/metadata.yaml"
# Every flavor (cluster-template*.yaml) and ClusterClass; copies of flavors removed since go.
for f in "$dest"/cluster-template*.yaml "$dest"/clusterclass-*.yaml; do
  if [[ -e $f && ! -e manifests/templates/${f##*/} ]]; then rm -f "$f"; fi
done
cp manifests/templates/cluster-template*.yaml manifests/templates/clusterclass-*.yaml "$dest/"
# Optional, for clusters with the VerticalPodAutoscaler CRDs (not part of the clusterctl install).
cp manifests/components/vpa/vpa.yaml "$dest/vpa.yaml"
# Optional, for clusters with the Prometheus Operator's CRDs: ServiceMonitor and PrometheusRule.
cp manifests/components/monitoring/monitoring.yaml "$dest/monitoring.yaml"
# For a hosting cluster (KVMCluster.spec.hostingCluster): what its credential may do there.
cp manifests/hosting/hosting-rbac.yaml "$dest/hosting-rbac.yaml"
for components in infrastructure-components infrastructure-components-namespaced; do
  cat >"$OUT/release/clusterctl${components#infrastructure-components}.yaml" <<EOF
# clusterctl configuration (~/.config/cluster-api/clusterctl.yaml or --config): the provider kvm
# from the local repository written by hack/release-manifests.sh. Moved elsewhere, change the path.
providers:
  - name: kvm
    type: InfrastructureProvider
    url: file://$OUT/release/infrastructure-kvm/latest/$components.yaml
EOF
done
echo "$dest"
