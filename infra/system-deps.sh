#!/usr/bin/env bash
# System packages Crucible's tests need on Debian, installed only when missing (run as root):
#  - chromium: the headless browser the dashboard tests drive (never a tool-downloaded browser)
#  - postgresql: server binaries (initdb, pg_ctl) for the throwaway test cluster
set -euo pipefail
need=()
[ -x /usr/bin/chromium ] || need+=(chromium)
if ! command -v initdb >/dev/null 2>&1 && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  need+=(postgresql)
fi
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "system-deps: missing ${need[*]}; run as root or install them with apt-get" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
echo "system-deps: ok (chromium: $(/usr/bin/chromium --version 2>/dev/null || echo missing))"
