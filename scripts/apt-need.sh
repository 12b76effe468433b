#!/bin/sh
# Installs the Debian packages named, when any are given: with apt-get as root, otherwise it
# says exactly what to install and fails. The Makefile passes the packages it found missing.
[ $# -eq 0 ] && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing: $*"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
else
    echo "missing: $* -- install with: sudo apt-get install -y $*" >&2
    exit 1
fi
