#!/usr/bin/env bash
# Build the images the test node itself runs, from scratch (no registry is reachable here): the pod
# sandbox's pause process (hack/node/pause.c, static) and CoreDNS (the binary hack/build-tools.sh built).
#
#   hack/build-node-images.sh BIN_DIR   build what is missing; print "pause=IMAGE" and "coredns=IMAGE"
#
# Each is keyed on what it is made from, so a second run builds nothing.
set -euo pipefail

bin=${1:?usage: build-node-images.sh BIN_DIR (hack/build-tools.sh --print)}
here="$(cd "$(dirname "$0")" && pwd)"
exists() { buildah inspect --type image "$1" >/dev/null 2>&1; }

pause="localhost/tandem-pause:$(sha256sum "$here/node/pause.c" | cut -c1-12)"
if ! exists "$pause"; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  cc -O2 -static -s -o "$work/pause" "$here/node/pause.c"
  ctr=$(buildah from scratch)
  buildah copy --quiet "$ctr" "$work/pause" /pause >/dev/null
  buildah config --entrypoint '["/pause"]' --user 65535:65535 "$ctr"
  buildah commit --quiet --rm "$ctr" "$pause" >/dev/null
  echo "[images] $pause built" >&2
fi
echo "pause=$pause"

version=$("$bin/coredns" -version | sed -n 's/^CoreDNS-\([0-9.]*\).*/\1/p')
coredns="localhost/tandem-coredns:$version-$(sha256sum "$bin/coredns" | cut -c1-12)"
if ! exists "$coredns"; then
  ctr=$(buildah from scratch)
  buildah copy --quiet "$ctr" "$bin/coredns" /coredns >/dev/null
  buildah config --entrypoint '["/coredns"]' --port 53/udp --port 53/tcp --user 65534:65534 "$ctr"
  buildah commit --quiet --rm "$ctr" "$coredns" >/dev/null
  echo "[images] $coredns built" >&2
fi
echo "coredns=$coredns"
