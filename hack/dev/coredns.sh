#!/usr/bin/env bash
# CoreDNS for the local management cluster, as a real cluster has it: the `coredns` Deployment and
# the `kube-dns` Service on the kubelet's clusterDNS address, so Pods (and the VMs, which get their
# Pod's DNS servers from the launcher's DHCP) resolve `<svc>.<namespace>.svc.cluster.local`, e.g.
# a workload cluster's `<cluster>-apiserver.<namespace>.svc`.
#
# CoreDNS is built from the Go module proxy (hack/build-addons.sh), committed as an image with
# buildah the way hack/dev/pause-image.sh does (no registry) and imported into containerd. The Corefile
# answers the cluster domain only: there is no `forward`, nothing is resolved outside this machine.
#
#   hack/dev/coredns.sh   (needs a running local MC; called by hack/dev-up.sh; idempotent)
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
# shellcheck source=../versions.env
source "$ROOT/hack/versions.env"

bash "$ROOT/hack/build-addons.sh" coredns >&2
IMAGE=localhost/capk/coredns:$COREDNS_VERSION
# The image is relabelled by the binary's digest: a rebuilt binary is imported again.
digest=$(sha256sum "$BIN/coredns" | cut -c1-16)
if ! ctr_has_image "$IMAGE" "name==$IMAGE,labels.\"capk.binary\"==$digest" 2>/dev/null; then
  work=$DEV/images/coredns
  rm -rf "$work"
  mkdir -p "$work/rootfs/etc/coredns"
  install -m 0755 "$BIN/coredns" "$work/rootfs/coredns"
  oci_image_import "$IMAGE" "$work" "hack/dev/coredns.sh: coredns $COREDNS_VERSION from the Go module proxy" \
    --entrypoint '["/coredns"]' --cmd '' --workingdir / --port 53/tcp --port 53/udp
  ctr_k8s images label "$IMAGE" "capk.binary=$digest" >/dev/null
  log "CoreDNS image $IMAGE imported"
fi

kc apply -f - >/dev/null <<EOF
apiVersion: v1
kind: ServiceAccount
metadata: {name: coredns, namespace: kube-system}
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata: {name: "system:coredns"}
rules:
- apiGroups: [""]
  resources: [endpoints, services, pods, namespaces]
  verbs: [list, watch]
- apiGroups: [discovery.k8s.io]
  resources: [endpointslices]
  verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata: {name: "system:coredns"}
roleRef: {apiGroup: rbac.authorization.k8s.io, kind: ClusterRole, name: "system:coredns"}
subjects: [{kind: ServiceAccount, name: coredns, namespace: kube-system}]
---
apiVersion: v1
kind: ConfigMap
metadata: {name: coredns, namespace: kube-system}
data:
  Corefile: |
    .:53 {
        errors
        health :8080
        ready :8181
        kubernetes cluster.local in-addr.arpa ip6.arpa {
            pods insecure
            fallthrough in-addr.arpa ip6.arpa
            ttl 30
        }
        cache 30
        loop
        reload
        loadbalance
    }
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: coredns
  namespace: kube-system
  labels: {k8s-app: kube-dns}
spec:
  replicas: 1
  selector: {matchLabels: {k8s-app: kube-dns}}
  template:
    metadata:
      labels: {k8s-app: kube-dns}
      annotations: {capk.dev/binary: "$digest"}
    spec:
      serviceAccountName: coredns
      priorityClassName: system-cluster-critical
      dnsPolicy: Default
      containers:
      - name: coredns
        image: $IMAGE
        imagePullPolicy: IfNotPresent
        args: [-conf, /etc/coredns/Corefile]
        resources:
          requests: {cpu: 10m, memory: 32Mi}
          limits: {memory: 170Mi}
        ports:
        - {name: dns, containerPort: 53, protocol: UDP}
        - {name: dns-tcp, containerPort: 53, protocol: TCP}
        securityContext:
          allowPrivilegeEscalation: false
          readOnlyRootFilesystem: true
          capabilities: {add: [NET_BIND_SERVICE], drop: [ALL]}
        livenessProbe:
          httpGet: {path: /health, port: 8080}
          periodSeconds: 10
          failureThreshold: 5
        readinessProbe:
          httpGet: {path: /ready, port: 8181}
          periodSeconds: 2
        volumeMounts:
        - {name: config, mountPath: /etc/coredns, readOnly: true}
      volumes:
      - name: config
        configMap: {name: coredns, items: [{key: Corefile, path: Corefile}]}
---
apiVersion: v1
kind: Service
metadata:
  name: kube-dns
  namespace: kube-system
  labels: {k8s-app: kube-dns, kubernetes.io/name: CoreDNS}
spec:
  selector: {k8s-app: kube-dns}
  clusterIP: $DNS_SVC_IP
  ports:
  - {name: dns, port: 53, protocol: UDP}
  - {name: dns-tcp, port: 53, protocol: TCP}
EOF
kc -n kube-system rollout status deployment/coredns --timeout=120s >/dev/null ||
  die "CoreDNS did not become ready: kubectl -n kube-system describe pod -l k8s-app=kube-dns"
# Through the Service, as a Pod or a VM asks it.
wait_for "CoreDNS answers kubernetes.default.svc.cluster.local on $DNS_SVC_IP" 60 \
  bash -c "dig +short +time=2 +tries=1 @$DNS_SVC_IP kubernetes.default.svc.cluster.local | grep -qxF $KUBERNETES_SVC_IP"
