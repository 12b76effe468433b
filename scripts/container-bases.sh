#!/usr/bin/env bash
# Makes, from Debian's own packages, the two base images the Dockerfile names, for a
# machine that reaches Debian's archive but no container registry:
#   debian:bookworm-slim  mmdebstrap's minbase bookworm
#   rust:1-bookworm       the same plus a C toolchain and this machine's Rust toolchain
#                         (rustc, cargo, std) under /usr/local, laid out like the official
#                         image (CARGO_HOME=/usr/local/cargo on PATH), trusting what this
#                         machine trusts (a TLS-inspecting proxy's CA, say), so that cargo
#                         can fetch crates from inside a build
# The runtime image trusts only Debian's CAs.
# Each is made only when podman does not already have it (FORCE=1 makes both again).
# Usage: scripts/container-bases.sh   (needs root: mmdebstrap and podman, `make container-test`
# installs them)
# scripts/deb-test.sh sources this file for `debian_image`, its image with systemd.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export CONTAINERS_CONF="${CONTAINERS_CONF:-$here/containers.conf}"

have() { [ "${FORCE:-0}" != 1 ] && podman image exists "$1"; }

# `podman import` keeps no config of its own; these are what the official images set.
debian_env=(--change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'
            --change 'CMD ["bash"]')

# debian_image NAME [--change VALUE]... -- MMDEBSTRAP_OPTION...: bookworm made by mmdebstrap
# with those options, imported as NAME with the official images' ENV and CMD (a --change
# given here comes after them, so it wins). The root file system is written whole before it
# is imported, so a failed mmdebstrap never leaves an empty image under the name.
debian_image() (
    local name="$1" changes=()
    shift
    while [ "$1" != -- ]; do changes+=("$1" "$2"); shift 2; done
    shift
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    mmdebstrap --quiet "$@" bookworm "$tmp/root.tar"
    podman import "${debian_env[@]}" "${changes[@]}" "$tmp/root.tar" "$name"
)

main() {
    if ! have debian:bookworm-slim; then
        echo "making debian:bookworm-slim with mmdebstrap"
        # Like the official slim image: no manuals, docs or translations (copyrights kept), and
        # apt keeps no package caches in a layer.
        apt_clean="$(mktemp)"
        trap 'rm -f "$apt_clean"' EXIT
        cat > "$apt_clean" <<'END'
DPkg::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
APT::Update::Post-Invoke { "rm -f /var/cache/apt/archives/*.deb /var/cache/apt/archives/partial/*.deb /var/cache/apt/*.bin || true"; };
Dir::Cache::pkgcache "";
Dir::Cache::srcpkgcache "";
END
        debian_image debian:bookworm-slim -- --variant=minbase \
            --dpkgopt='path-exclude=/usr/share/man/*' \
            --dpkgopt='path-exclude=/usr/share/info/*' \
            --dpkgopt='path-exclude=/usr/share/doc/*' \
            --dpkgopt='path-include=/usr/share/doc/*/copyright' \
            --dpkgopt='path-exclude=/usr/share/locale/*' \
            --dpkgopt='path-exclude=/usr/share/lintian/*' \
            --aptopt="$apt_clean"
    fi

    if ! have rust:1-bookworm; then
        rustc="$(rustup which rustc 2>/dev/null || command -v rustc)"
        toolchain="$(dirname "$(dirname "$rustc")")"
        [ -x "$toolchain/bin/cargo" ] || { echo "no cargo beside $rustc" >&2; exit 1; }
        echo "making rust:1-bookworm with $("$rustc" --version) from $toolchain"
        # The toolchain's bin, lib and libexec only: its docs and sources are not needed to build.
        debian_image rust:1-bookworm \
                --change 'ENV CARGO_HOME=/usr/local/cargo' \
                --change 'ENV PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
                -- --variant=minbase \
            --include=ca-certificates,gcc,g++,libc6-dev,make,pkg-config,perl \
            --customize-hook="cp -a '$toolchain/bin' '$toolchain/lib' '$toolchain/libexec' \"\$1/usr/local/\"" \
            --customize-hook='mkdir -p "$1/usr/local/cargo/bin"' \
            --customize-hook="cp /etc/ssl/certs/ca-certificates.crt \"\$1/usr/local/share/ca-certificates/build-host.crt\"" \
            --customize-hook='chroot "$1" update-ca-certificates >/dev/null'
    fi
    podman image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E 'debian:bookworm-slim|rust:1-bookworm'
}

[ "${BASH_SOURCE[0]}" != "$0" ] || main
