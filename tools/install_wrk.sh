#!/usr/bin/env bash
# Installs wrk (the HTTP load generator tools/bench_service.py drives) from the system's packages:
# Debian/Ubuntu's `wrk` (4.1.0 on Debian 12), through apt-get. Needs root (or sudo). Does nothing when
# wrk is already on PATH. Without apt-get it says so and fails; install wrk by other means then.
set -euo pipefail
if command -v wrk >/dev/null 2>&1; then
    echo "wrk already installed: $(command -v wrk)"
    exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_wrk: no apt-get on this system; install the 'wrk' package with the system's package manager" >&2
    exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    command -v sudo >/dev/null 2>&1 || { echo "install_wrk: need root or sudo for apt-get" >&2; exit 1; }
    SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
if ! $SUDO apt-get install -y --no-install-recommends wrk; then
    $SUDO apt-get update
    $SUDO apt-get install -y --no-install-recommends wrk
fi
wrk --version 2>&1 | head -1 || true
