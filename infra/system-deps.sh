#!/usr/bin/env bash
# System packages Crucible's tests need on Debian, installed only when missing (run as root):
#  - chromium: the headless browser the dashboard tests drive (never a tool-downloaded browser)
#  - postgresql: server binaries (initdb, pg_ctl) for the throwaway test cluster (not needed
#    when CRUCIBLE_TEST_DATABASE_URL names a server)
#
#   bash infra/system-deps.sh                       install what is missing; fails unless root
#   bash infra/system-deps.sh --or-explain PY [MARKS]  what `make test` runs first: as root
#       on Debian the same; otherwise install nothing, say how many of the tests `-m MARKS`
#       selects will skip without the packages and the one command that installs them, and
#       succeed (PY: the python whose pytest counts them)
set -euo pipefail
cd "$(dirname "$0")/.."
need=()
[ -x /usr/bin/chromium ] || need+=(chromium)
if [ -z "${CRUCIBLE_TEST_DATABASE_URL:-}" ] && ! command -v initdb >/dev/null 2>&1 \
    && ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1; then
  need+=(postgresql)
fi
can_install=0
[ "$(id -u)" = 0 ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null && can_install=1

if [ "${1:-}" = --or-explain ] && [ ${#need[@]} -gt 0 ] && [ $can_install = 0 ]; then
  python=$2 select=browser
  [ -n "${3:-}" ] && select="browser and ($3)"
  # the browser tests skip without Chromium: count them (collecting only the files that can hold one)
  files=$(grep -rlE 'mark\.browser|\bbrowser\b' tests --include='test_*.py' || true)
  skipped=0
  if [[ " ${need[*]} " == *" chromium "* ]] && [ -n "$files" ]; then
    # shellcheck disable=SC2086  # one test file per word
    skipped=$("$python" -m pytest --collect-only -q -p no:cacheprovider -m "$select" \
      $files 2>/dev/null | grep -c '::' || true)
  fi
  said=()
  for package in "${need[@]}"; do
    case $package in
      chromium) said+=("chromium is missing: $skipped browser tests will be skipped") ;;
      postgresql) said+=("postgresql is missing: the tests that need PostgreSQL will fail") ;;
    esac
  done
  if [ "$(id -u)" = 0 ]; then how="install ${need[*]} with this system's package manager"
  else how="sudo make system-deps"; fi
  printf 'system-deps: %s\n' "${said[@]}"
  echo "system-deps: to run every test: $how"
  exit 0
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
