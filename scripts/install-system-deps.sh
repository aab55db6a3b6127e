#!/usr/bin/env bash
# System (apt) packages mpccs needs beyond its Python dependencies.
# Idempotent: a no-op when everything is already installed; apt-get runs only for
# what is missing. Called by CI; safe to run by hand.
#
#   iproute2     `ip` and `tc` for the emulated cluster (mpccs-testbed, tests/test_testbed.py):
#                network namespaces, veths, bridges, tbf/htb shaping.
#   openmpi-bin  optional: Open MPI's mpirun, so the launcher test runs under it (it skips
#                without); a failed install of an optional package never fails this script.
set -euo pipefail

# package -> a command that proves it is installed
declare -A NEEDED=(
  [iproute2]=tc
)

declare -A OPTIONAL=(
  [openmpi-bin]=orterun
)

missing=()
for pkg in "${!NEEDED[@]}"; do
  command -v "${NEEDED[$pkg]}" >/dev/null 2>&1 || missing+=("$pkg")
done
optional=()
for pkg in "${!OPTIONAL[@]}"; do
  command -v "${OPTIONAL[$pkg]}" >/dev/null 2>&1 || optional+=("$pkg")
done

if [ ${#missing[@]} -eq 0 ] && [ ${#optional[@]} -eq 0 ]; then
  exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1; then SUDO="sudo"; else
    echo "install-system-deps: need root (or sudo) to install: ${missing[*]}" >&2
    exit 1
  fi
fi
export DEBIAN_FRONTEND=noninteractive
if [ ${#missing[@]} -gt 0 ]; then
  echo "install-system-deps: installing ${missing[*]}"
  $SUDO apt-get update -qq
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
if [ ${#optional[@]} -gt 0 ]; then
  echo "install-system-deps: installing optional ${optional[*]}"
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${optional[@]}"; } \
    || echo "install-system-deps: optional ${optional[*]} not installed; the tests that need it skip" >&2
fi
