#!/usr/bin/env bash
# Build the Kubernetes binaries the tests and `make cluster` use, from source, at pinned versions: the
# control plane, kubectl, helm, and a real node's kubelet and kube-proxy.
#
#   hack/build-tools.sh          build what is missing, print the folder holding the binaries
#   hack/build-tools.sh --print  print that folder only (exit 1 if a binary is missing)
#
# kwok (fake nodes whose pods it marks Ready without running them) is built too: the operator's
# reconcile tests and the scale benchmark schedule pods onto its tainted node. So is kube-router, whose
# NetworkPolicy controller the real node runs as its firewall (from hack/netpol-tools/go.mod: its own
# module, since kube-router is written against an older client-go than hack/k8s-tools pins).
#
# Everything comes from the Go module proxy through hack/k8s-tools/go.mod (versions and checksums
# pinned there); nothing prebuilt is downloaded. Binaries land in a cache outside the repository keyed
# by version ($TANDEM_TOOLS_DIR, default ~/.cache/tandem/tools), so a second run is a no-op. A cold
# build takes tens of minutes on 2 cores; see docs/kubernetes-testbed.md.
set -euo pipefail

K8S_VERSION=v1.37.2
ETCD_VERSION=v3.7.3
HELM_VERSION=v4.3.2
KWOK_VERSION=v0.8.0
COREDNS_VERSION=v1.15.0
KUBE_ROUTER_VERSION=v2.1.0

here="$(cd "$(dirname "$0")" && pwd)"
module="$here/k8s-tools"
netpol_module="$here/netpol-tools"
root="${TANDEM_TOOLS_DIR:-$HOME/.cache/tandem/tools}"
bin="$root/k8s-$K8S_VERSION-etcd-$ETCD_VERSION-helm-$HELM_VERSION/bin"

# name -> Go package
declare -A packages=(
  [etcd]=go.etcd.io/etcd/server/v3
  [kube-apiserver]=k8s.io/kubernetes/cmd/kube-apiserver
  [kube-controller-manager]=k8s.io/kubernetes/cmd/kube-controller-manager
  [kube-scheduler]=k8s.io/kubernetes/cmd/kube-scheduler
  [kubectl]=k8s.io/kubernetes/cmd/kubectl
  [helm]=helm.sh/helm/v4/cmd/helm
  [kubelet]=k8s.io/kubernetes/cmd/kubelet
  [kube-proxy]=k8s.io/kubernetes/cmd/kube-proxy
)
order=(kubectl helm etcd kube-scheduler kube-controller-manager kube-apiserver kubelet kube-proxy)
[[ "${1:-}" == "kwok" ]] && shift  # accepted for old callers: kwok is always built now

missing=()
for name in "${order[@]}" kwok coredns kube-router; do
  [[ -x "$bin/$name" ]] || missing+=("$name")
done
if [[ "${1:-}" == "--print" ]]; then
  [[ ${#missing[@]} -eq 0 ]] || exit 1
  echo "$bin"
  exit 0
fi
go_install() {  # NAME MODULE_PATH@VERSION: a module whose go.mod has no replace lines installs as is
  [[ -x "$bin/$1" ]] && return
  echo "[tools] $1 <- $2" >&2
  local start=$SECONDS
  GOTOOLCHAIN=local CGO_ENABLED=0 GOBIN="$bin" go install -trimpath -ldflags "-s -w" "$2"
  echo "[tools] $1 done in $((SECONDS - start)) s" >&2
}
build_kwok() {
  # kwok's go.mod has no replace lines, so `go install module@version` works (its sum is checked against
  # the checksum database). Its stage files (pod-ready, node-initialize) ship in the module.
  go_install kwok "sigs.k8s.io/kwok/cmd/kwok@$KWOK_VERSION"
}
build_coredns() {
  # The real node's cluster DNS (hack/build-node-images.sh puts it in an image); installed like kwok.
  go_install coredns "github.com/coredns/coredns@$COREDNS_VERSION"
}
build_kube_router() {
  # The real node's NetworkPolicy firewall (tests/k8s/real_node.py runs it with --run-firewall only). Built
  # from hack/netpol-tools, whose go.mod pins v2.1.0 and raises its vulnerable dependencies (go.sum
  # checked, -mod=readonly as above); stamped with its version as upstream's Makefile does.
  [[ -x "$bin/kube-router" ]] && return
  grep -q "github.com/cloudnativelabs/kube-router/v2 $KUBE_ROUTER_VERSION" "$netpol_module/go.mod" \
    || { echo "hack/netpol-tools/go.mod does not pin kube-router $KUBE_ROUTER_VERSION" >&2; exit 1; }
  echo "[tools] kube-router <- github.com/cloudnativelabs/kube-router/v2@$KUBE_ROUTER_VERSION" >&2
  local start=$SECONDS pkg=github.com/cloudnativelabs/kube-router/v2/pkg/version
  (cd "$netpol_module" && GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath \
    -ldflags "-s -w -X $pkg.Version=$KUBE_ROUTER_VERSION -X $pkg.BuildDate=1970-01-01T00:00:00Z" \
    -o "$bin/.kube-router.tmp" github.com/cloudnativelabs/kube-router/v2/cmd/kube-router)
  mv "$bin/.kube-router.tmp" "$bin/kube-router"
  echo "[tools] kube-router done in $((SECONDS - start)) s" >&2
}
if [[ ${#missing[@]} -eq 0 ]]; then
  echo "$bin"
  exit 0
fi

# The pins in go.mod are the ones this script names; refuse to build something else silently.
grep -q "k8s.io/kubernetes $K8S_VERSION" "$module/go.mod" || { echo "go.mod does not pin k8s.io/kubernetes $K8S_VERSION" >&2; exit 1; }
grep -q "go.etcd.io/etcd/server/v3 $ETCD_VERSION" "$module/go.mod" || { echo "go.mod does not pin etcd $ETCD_VERSION" >&2; exit 1; }
grep -q "helm.sh/helm/v4 $HELM_VERSION" "$module/go.mod" || { echo "go.mod does not pin helm $HELM_VERSION" >&2; exit 1; }

mkdir -p "$bin"
exec 9>"$bin/.lock"
flock 9
export GOTOOLCHAIN=local CGO_ENABLED=0 GOFLAGS=-mod=readonly

k8s_minor="${K8S_VERSION#v1.}"; k8s_minor="${k8s_minor%%.*}"
k8s_ldflags="-s -w"
for pkg in k8s.io/client-go/pkg/version k8s.io/component-base/version; do
  k8s_ldflags+=" -X $pkg.gitVersion=$K8S_VERSION -X $pkg.gitMajor=1 -X $pkg.gitMinor=$k8s_minor"
  k8s_ldflags+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done
declare -A ldflags=(
  [etcd]="-s -w -X go.etcd.io/etcd/api/v3/version.GitSHA=module-$ETCD_VERSION"
  [helm]="-s -w -X helm.sh/helm/v4/internal/version.version=$HELM_VERSION -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
)

total=${#missing[@]}
i=0
start_all=$SECONDS
echo "[tools] building $total binaries into $bin (Go $(go env GOVERSION), cold builds take a while)" >&2
for name in "${order[@]}"; do
  [[ -x "$bin/$name" ]] && continue
  i=$((i + 1))
  flags="${ldflags[$name]:-$k8s_ldflags}"
  start=$SECONDS
  echo "[tools] ($i/$total) $name <- ${packages[$name]}" >&2
  (cd "$module" && go build -trimpath -tags selinux,notest -ldflags "$flags" -o "$bin/.$name.tmp" "${packages[$name]}")
  mv "$bin/.$name.tmp" "$bin/$name"
  echo "[tools] ($i/$total) $name done in $((SECONDS - start)) s" >&2
done
echo "[tools] all built in $((SECONDS - start_all)) s" >&2
build_kwok
build_coredns
build_kube_router
echo "$bin"
