#!/bin/sh
# Install Prometheus (Debian's package) for the observability tests and
# `hybridserve serve --with-prometheus`. Idempotent; never starts the Debian service
# (hybridserve runs the binary itself on 127.0.0.1) and skips the recommended node
# exporter. Without root (or apt) it explains and exits 0: the live test then skips.
set -u
if command -v prometheus >/dev/null 2>&1; then
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install.sh: no apt-get here; install Prometheus (>= 2.40) yourself and put 'prometheus' on PATH" >&2
    exit 0
fi
SUDO=""
if [ "$(id -u)" != "0" ]; then
    if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
        SUDO="sudo -n"
    else
        echo "install.sh: not root and no passwordless sudo; run as root: apt-get install --no-install-recommends prometheus" >&2
        echo "install.sh: the live Prometheus test (tests/observability) will be skipped" >&2
        exit 0
    fi
fi
export DEBIAN_FRONTEND=noninteractive
# policy-rc.d answering 101 keeps the package's postinst from starting the service.
$SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends prometheus || {
    echo "install.sh: apt-get install prometheus failed; the live Prometheus test will be skipped" >&2
    exit 0
}
# On a host running systemd the package starts its service (all interfaces, :9090); we
# only wanted the binary.
if [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; then
    $SUDO systemctl disable --now prometheus >/dev/null 2>&1 &&
        echo "install.sh: disabled the Debian prometheus service (hybridserve runs its own on 127.0.0.1)" >&2
fi
exit 0
