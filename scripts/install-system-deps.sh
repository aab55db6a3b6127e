#!/usr/bin/env bash
# System (apt) packages mpccs needs beyond its Python dependencies.
# Idempotent: a no-op when everything is already installed; apt-get runs only for
# what is missing. Called by CI; safe to run by hand.
#
#   iproute2  `ip` and `tc` for the emulated cluster (mpccs-testbed, tests/test_testbed.py):
#             network namespaces, veths, bridges, tbf/htb shaping.
set -euo pipefail

# package -> a command that proves it is installed
declare -A NEEDED=(
  [iproute2]=tc
)

missing=()
for pkg in "${!NEEDED[@]}"; do
  command -v "${NEEDED[$pkg]}" >/dev/null 2>&1 || missing+=("$pkg")
done

if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "install-system-deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi
echo "install-system-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
