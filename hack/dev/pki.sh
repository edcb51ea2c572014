#!/usr/bin/env bash
# Certificates, keys and kubeconfigs of the local management cluster, under _output/dev/pki.
# Idempotent: an existing file is kept (delete _output/dev to start over). ECDSA P-256 with
# openssl; the service-account signing key is RSA 2048.
set -euo pipefail
# shellcheck source=lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

mkdir -p "$PKI"
chmod 700 "$PKI"
cd "$PKI"

key() { [[ -f $1.key ]] || openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1.key" 2>/dev/null; }

if [[ ! -f ca.crt ]]; then
  key ca
  openssl req -x509 -new -key ca.key -subj "/CN=capk-dev-ca" -days 3650 -out ca.crt \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"
fi

# The front proxy's own CA, as kubeadm makes it: aggregated API servers (metrics-server) trust the
# apiserver's forwarded user headers only from a client certificate of this CA.
if [[ ! -f front-proxy-ca.crt ]]; then
  key front-proxy-ca
  openssl req -x509 -new -key front-proxy-ca.key -subj "/CN=front-proxy-ca" -days 3650 -out front-proxy-ca.crt \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature"
fi

# cert NAME SUBJECT EXTKEYUSAGE [SANS [CA]]: signed by CA (default: ca)
cert() {
  local name=$1 subj=$2 eku=$3 sans=${4:-} ca=${5:-ca}
  [[ -f $name.crt ]] && return 0
  key "$name"
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -z $sans ]] || echo "subjectAltName=$sans"
  } >"$name.ext"
  openssl req -new -key "$name.key" -subj "$subj" |
    openssl x509 -req -CA "$ca.crt" -CAkey "$ca.key" -CAcreateserial -days 3650 -extfile "$name.ext" -out "$name.crt" 2>/dev/null
  rm -f "$name.ext"
}

cert apiserver "/CN=kube-apiserver" serverAuth \
  "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:$NODE_IP,IP:$KUBERNETES_SVC_IP"
cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" clientAuth
cert admin "/O=system:masters/CN=capk-dev-admin" clientAuth
cert controller-manager "/CN=system:kube-controller-manager" clientAuth
cert scheduler "/CN=system:kube-scheduler" clientAuth
cert kube-proxy "/CN=system:kube-proxy" clientAuth
cert kubelet "/O=system:nodes/CN=system:node:$NODE_NAME" clientAuth
cert front-proxy-client "/CN=front-proxy-client" clientAuth "" front-proxy-ca
[[ -f sa.key ]] || openssl genrsa -out sa.key 2048 2>/dev/null
[[ -f sa.pub ]] || openssl rsa -in sa.key -pubout -out sa.pub 2>/dev/null

# kubeconfig FILE USER: client certificate by path, CA by path.
kubeconfig() {
  local file=$1 user=$2
  [[ -f $file ]] && return 0
  cat >"$file" <<KC
apiVersion: v1
kind: Config
clusters:
- name: capk-dev
  cluster:
    server: https://$NODE_IP:$APISERVER_PORT
    certificate-authority: $PKI/ca.crt
users:
- name: $user
  user:
    client-certificate: $PKI/$user.crt
    client-key: $PKI/$user.key
contexts:
- name: capk-dev
  context:
    cluster: capk-dev
    user: $user
current-context: capk-dev
KC
}
kubeconfig "$DEV/admin.kubeconfig" admin
for u in controller-manager scheduler kube-proxy kubelet; do kubeconfig "$DEV/$u.kubeconfig" "$u"; done
chmod 600 ./*.key "$DEV"/*.kubeconfig
