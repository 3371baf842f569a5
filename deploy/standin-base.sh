#!/usr/bin/env bash
# A stand-in for the Dockerfile's BASE_IMAGE on a machine that reaches no image registry:
# Debian bookworm (minbase) with python3 and python3-venv, made with debootstrap from the
# Debian mirror apt uses here and imported into Docker. The machine's CA bundle goes into
# this stand-in only (with PIP_CERT pointing at it), so pip in the build trusts what the
# machine trusts; the project's Dockerfile never sees it.
#
#   deploy/standin-base.sh [TAG]     (root; prints the tag; reuses an existing image)
#
# Environment: DEBIAN_MIRROR (default: the mirror apt's bookworm main comes from),
# CA_BUNDLE (default /etc/ssl/certs/ca-certificates.crt), STANDIN_REBUILD=1 to rebuild.
set -euo pipefail

TAG=${1:-hybridflow-standin:bookworm-python3}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}

# An existing stand-in is reused: a new import has a new id, which would invalidate every
# cached layer built on it.
if [[ "${STANDIN_REBUILD:-0}" != 1 ]] && docker image inspect "$TAG" >/dev/null 2>&1; then
    echo "$TAG"
    exit 0
fi

if [[ -z "${DEBIAN_MIRROR:-}" ]]; then
    DEBIAN_MIRROR=$(apt-cache policy | awk '$3 == "bookworm/main" && $2 ~ /^https?:/ {print $2; exit}')
fi
if [[ -z "$DEBIAN_MIRROR" ]]; then
    echo "standin-base: no Debian bookworm mirror found in apt's sources; set DEBIAN_MIRROR" >&2
    exit 1
fi
command -v debootstrap >/dev/null || { echo "standin-base: debootstrap is not installed" >&2; exit 1; }

ROOTFS=$(mktemp -d /tmp/hybridflow-standin-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT

echo "standin-base: debootstrap bookworm from $DEBIAN_MIRROR" >&2
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$ROOTFS" "$DEBIAN_MIRROR" >&2

cp "$CA_BUNDLE" "$ROOTFS/etc/ssl/certs/ca-certificates.crt"
# What the official images leave out too: downloaded packages and apt's lists.
rm -rf "$ROOTFS"/var/cache/apt/archives/*.deb "$ROOTFS"/var/lib/apt/lists/*

tar -C "$ROOTFS" -c . | docker import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["/bin/bash"]' \
    - "$TAG" >&2
echo "$TAG"
