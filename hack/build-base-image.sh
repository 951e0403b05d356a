#!/usr/bin/env bash
# Make the base image the Dockerfiles build FROM where no container registry is reachable: Debian's own
# packages (mmdebstrap of the release this machine runs) with Debian's Python, laid out as the official
# python:3.11-slim image is for what the Dockerfiles use (`python` and `pip` on PATH, installing into one
# environment), then imported into buildah's local storage.
#
#   hack/build-base-image.sh            build unless the image exists; print its name
#   hack/build-base-image.sh --print    print its name (exit 1 if it is missing)
#   hack/build-base-image.sh --rebuild  build it again even if it exists (bench/k8s_containers.py times it)
#
# Same Python minor as the default base (Debian bookworm: 3.11), so the wheels `make setup` resolves are
# the ones the images install. The image is keyed on this script's text: a changed script builds anew.
set -euo pipefail

SUITE=bookworm
MIRROR=${TANDEM_DEBIAN_MIRROR:-http://deb.debian.org/debian}
here="$(cd "$(dirname "$0")" && pwd)"
key=$(sha256sum "$here/build-base-image.sh" | cut -c1-12)
image="localhost/tandem-python:3.11-$SUITE-$key"

exists() { buildah inspect --type image "$image" >/dev/null 2>&1; }
if [[ "${1:-}" == "--print" ]]; then
  exists || exit 1
  echo "$image"
  exit 0
fi
if exists && [[ "${1:-}" != "--rebuild" ]]; then
  echo "$image"
  exit 0
fi
previous=$(buildah inspect --type image --format '{{.FromImageID}}' "$image" 2>/dev/null || true)

[[ $(id -u) -eq 0 ]] || { echo "build-base-image.sh: run as root (mmdebstrap, buildah)" >&2; exit 1; }
for tool in mmdebstrap buildah runc; do
  command -v "$tool" >/dev/null || { echo "build-base-image.sh: needs $tool (apt-get install $tool)" >&2; exit 1; }
done

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
start=$SECONDS
echo "[images] base $image <- mmdebstrap $SUITE" >&2
# minbase keeps apt and dpkg (the worker's build stage installs a compiler with apt-get, as on
# python:3.11-slim); python3-venv brings ensurepip, which gives the environment its pip (Debian's bundled
# one: nothing is fetched from PyPI here).
mmdebstrap --variant=minbase --quiet \
  --include=python3,python3-venv,ca-certificates,libgomp1 \
  --customize-hook='chroot "$1" python3 -m venv /opt/python' \
  --customize-hook='rm -rf "$1"/var/lib/apt/lists/* "$1"/var/cache/apt/*' \
  "$SUITE" "$work/rootfs.tar" "deb $MIRROR $SUITE main" "deb $MIRROR $SUITE-updates main"

ctr=$(buildah from scratch)
trap 'buildah rm "$ctr" >/dev/null 2>&1 || true; rm -rf "$work"' EXIT
buildah add --quiet "$ctr" "$work/rootfs.tar" / >/dev/null
# python:3.11-slim's PATH puts its Python first; LANG as it sets it.
buildah config --env PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  --env LANG=C.UTF-8 --cmd python3 --label dev.tandem.base-script="$key" "$ctr"
buildah commit --quiet --rm "$ctr" "$image" >/dev/null
trap 'rm -rf "$work"' EXIT
echo "[images] base $image built in $((SECONDS - start)) s" >&2
[[ -n "$previous" ]] && buildah rmi "$previous" >/dev/null 2>&1 || true  # the version a rebuild replaced
echo "$image"
