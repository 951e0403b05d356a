#!/usr/bin/env bash
# Build the images of docker/ with buildah (no daemon; runc runs the RUN steps: crun refuses this machine's
# hybrid cgroups) into buildah's local storage, tagged with the names the chart and the examples use, on
# a base made from Debian packages (hack/build-base-image.sh) since no registry is reachable here.
#
#   hack/build-images.sh            build what is missing or out of date; print the image names
#   hack/build-images.sh --print    print the image names (exit 1 if one is missing or out of date)
#   hack/build-images.sh --rebuild  build the base and every image again, every step (no build cache)
#
# An image is keyed on the text of every file its build reads (its Dockerfile, the sources it copies,
# the base): a second run with nothing changed builds nothing. Wheels come from $WHEELS (what `make setup`
# downloaded), and this machine's pip configuration and certificates are mounted into the RUN steps, so
# a build behind a proxy reaches PyPI as `make setup` does.
set -euo pipefail

REPO="$(cd "$(dirname "$0")/.." && pwd)"
VERSION=0.1.0
WHEELS=${WHEELS:-$HOME/.cache/tandem/wheels}
# name -> Dockerfile; the tags are the chart's (values.yaml image.repository, appVersion) and the
# examples' (spec.engine.image).
declare -A dockerfiles=([worker]=docker/worker.Dockerfile [operator]=docker/operator.Dockerfile)
declare -A tags=([worker]=ghcr.io/tandem-dev/tandem-worker:$VERSION [operator]=ghcr.io/tandem-dev/tandem-operator:$VERSION)
# What each build copies from the repository besides its Dockerfile.
declare -A inputs=([worker]="pyproject.toml README.md workers operator" [operator]="operator")
order=(${TANDEM_IMAGES:-operator worker})

mode=${1:-}
cd "$REPO"
base=$(hack/build-base-image.sh "$mode") || { echo "build-images.sh: the base image is missing" >&2; exit 1; }

key_of() {  # the content key of image $1: its Dockerfile, its inputs (tracked or not, unless ignored), the base
  local name=$1
  # shellcheck disable=SC2086
  { echo "$base"; git ls-files -z --cached --others --exclude-standard -- "${dockerfiles[$name]}" ${inputs[$name]} \
      | sort -z | xargs -0 sha256sum; } | sha256sum | cut -c1-16
}
current() {  # whether the image tagged for $1 was built from key $2
  [[ "$mode" != "--rebuild" ]] || return 1
  [[ "$(buildah inspect --type image --format '{{index .ImageAnnotations "dev.tandem.source"}}' "${tags[$1]}" \
        2>/dev/null)" == "$2" ]]
}

if [[ "$mode" == "--print" ]]; then
  for name in "${order[@]}"; do
    current "$name" "$(key_of "$name")" || exit 1
    echo "${tags[$name]}"
  done
  exit 0
fi

mounts=()
[[ -f /etc/pip.conf ]] && mounts+=(-v /etc/pip.conf:/etc/pip.conf:ro)
for var in PIP_CERT REQUESTS_CA_BUNDLE SSL_CERT_FILE; do  # a CA bundle of this machine's (a proxy's CA)
  [[ -n "${!var:-}" && -f "${!var}" ]] && mounts+=(-v "${!var}:${!var}:ro")
done
if [[ ! -d "$WHEELS" ]] || ! compgen -G "$WHEELS/torch-*.whl" >/dev/null; then
  echo "[images] no torch wheels in $WHEELS: downloading them (make setup keeps them there)" >&2
  mkdir -p "$WHEELS"
  "$REPO/.venv/bin/pip" download -q -d "$WHEELS" "torch==2.13.0"
fi

for name in "${order[@]}"; do
  key=$(key_of "$name")
  if current "$name" "$key"; then
    echo "${tags[$name]}"
    continue
  fi
  start=$SECONDS
  previous=$(buildah inspect --type image --format '{{.FromImageID}}' "${tags[$name]}" 2>/dev/null || true)
  echo "[images] ${tags[$name]} <- ${dockerfiles[$name]} on $base" >&2
  # shellcheck disable=SC2046
  buildah bud --runtime runc --layers --quiet $([[ "$mode" == "--rebuild" ]] && echo --no-cache) \
    --build-arg BASE_IMAGE="$base" --build-arg PIP_FIND_LINKS=/wheels -v "$WHEELS:/wheels:ro" "${mounts[@]}" \
    --annotation dev.tandem.source="$key" -f "${dockerfiles[$name]}" -t "${tags[$name]}" . >&2
  echo "[images] ${tags[$name]} built in $((SECONDS - start)) s" >&2
  # The version it replaces, now nameless: gigabytes a rebuild would otherwise leave each time (the layers
  # it shares with the new one, and the build's cache of earlier steps, stay).
  if [[ -n "$previous" && "$previous" != "$(buildah inspect --type image --format '{{.FromImageID}}' "${tags[$name]}")" ]]; then
    buildah rmi "$previous" >/dev/null 2>&1 || true
  fi
  # Nameless images: the worker's `cache` stage of this and earlier builds (GBs each; the next rebuild redoes
  # that stage, a minute), and bases an edited build-base-image.sh replaced.
  buildah rmi --prune >/dev/null 2>&1 || true
  buildah images --format '{{.Name}}:{{.Tag}}' | grep '^localhost/tandem-python:' | grep -vxF "$base" \
    | xargs -r buildah rmi >/dev/null 2>&1 || true
  echo "${tags[$name]}"
done
