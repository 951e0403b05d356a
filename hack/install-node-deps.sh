#!/usr/bin/env bash
# Install, from Debian's packages, what building images and running a real test node need here: buildah
# (images, no daemon), runc (the OCI runtime: crun refuses this machine's hybrid cgroups), containerd (the
# kubelet's CRI runtime), the CNI plugins (bridge, host-local, portmap, loopback), mmdebstrap (the base
# image), iptables (kube-proxy, kube-router) and ipset (kube-router's NetworkPolicy firewall keeps its
# pod sets there). A no-op once installed; needs root and Debian's apt.
set -euo pipefail

packages=(buildah runc containerd containernetworking-plugins mmdebstrap iptables ipset)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ $(id -u) -ne 0 ]] || ! command -v apt-get >/dev/null; then
  echo "install-node-deps.sh: missing ${missing[*]}; install them as root with apt-get (Debian)" >&2
  exit 1
fi
echo "[node] installing ${missing[*]}" >&2
apt-get update -q >&2
DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" >&2
