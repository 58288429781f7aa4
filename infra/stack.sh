#!/usr/bin/env bash
# The full Crucible stack on one machine, no Docker needed:
#   Postgres (a private cluster) -> Prefect server on Postgres -> Crucible API on Postgres
#   -> `crucible deploy` serving the train-run and failure-sweep deployments.
#
#   infra/stack.sh start     start everything (idempotent), print the URLs
#   infra/stack.sh status    what runs, with pids
#   infra/stack.sh stop      stop everything this script started: serve (SIGTERM) and every flow
#                            run of the stack (process groups; Cancelled, registry `cancelled`)
#   infra/stack.sh env       print the exports a shell needs to talk to the stack
#
# Settings (environment): STACK_DIR (default .crucible/stack), PG_PORT (55432), PREFECT_PORT
# (4200), API_PORT (8000), VENV (.venv). State, logs and pids live in STACK_DIR; the API token is
# generated once into STACK_DIR/api-token. Everything listens on 127.0.0.1 only.
#
# Ports are remembered: `start` saves the ports it uses to STACK_DIR/ports.env before starting
# anything, and `status`, `env` and `stop` read them from there, so a shell without PG_PORT & co.
# still reaches this stack and not somebody else's on the default ports. While any part runs,
# `start` with other ports is refused (exit 2) and other commands warn about PG_PORT & co. that
# disagree; a stopped stack starts again on the saved ports unless PG_PORT & co. say otherwise.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
STACK_DIR="${STACK_DIR:-$ROOT/.crucible/stack}"
PORTS_FILE="$STACK_DIR/ports.env"
PORT_VARS="PG_PORT PREFECT_PORT API_PORT"
declare -A DEFAULT_PORT=([PG_PORT]=55432 [PREFECT_PORT]=4200 [API_PORT]=8000)
declare -A ASKED_PORT=([PG_PORT]="${PG_PORT:-}" [PREFECT_PORT]="${PREFECT_PORT:-}" [API_PORT]="${API_PORT:-}")
VENV="${VENV:-$ROOT/.venv}"
BIN="$VENV/bin"
PGDATA="$STACK_DIR/pg"
LOGS="$STACK_DIR/logs"

pg_bin() {  # a PostgreSQL server binary from PATH, /usr/lib/postgresql/*/bin or /usr/local/bin
  local name="$1" found
  found="$(command -v "$name" 2>/dev/null || true)"
  [ -n "$found" ] || found="$(ls -d /usr/lib/postgresql/*/bin/"$name" 2>/dev/null | sort -V | tail -1 || true)"
  [ -n "$found" ] || { [ -x "/usr/local/bin/$name" ] && found="/usr/local/bin/$name"; }
  [ -n "$found" ] || { echo "error: $name not found; run 'make system-deps' (PostgreSQL server)" >&2; exit 2; }
  echo "$found"
}

as_pg() {  # initdb and postgres refuse to run as root: use the postgres OS user then
  if [ "$(id -u)" = 0 ]; then runuser -u postgres -- "$@"; else "$@"; fi
}

alive() {  # alive PID: the process runs; a zombie (exited, not reaped yet: under an init that
  # reaps late, a killed serve stays one for a while) does not
  kill -0 "$1" 2>/dev/null || return 1
  local state
  state="$(sed -n 's/^.*) \([A-Za-z]\).*$/\1/p' "/proc/$1/stat" 2>/dev/null || true)"
  [ "$state" != Z ] && [ "$state" != X ]
}

running() { [ -f "$STACK_DIR/$1.pid" ] && alive "$(cat "$STACK_DIR/$1.pid")"; }

postgres_running() {
  [ -f "$PGDATA/PG_VERSION" ] && as_pg "$(pg_bin pg_ctl)" -D "$PGDATA" status >/dev/null 2>&1
}

stack_running() {  # any part of this STACK_DIR's stack up
  local name
  for name in prefect-server crucible-api serve; do running "$name" && return 0; done
  postgres_running
}

check_port() {  # check_port VAR VALUE: a TCP port number, else exit 2 naming VAR
  case "$2" in
    ''|*[!0-9]*) echo "error: $1='$2' is not a port number; use 1-65535 (e.g. $1=${DEFAULT_PORT[$1]})" >&2; exit 2 ;;
  esac
  if [ "$2" -lt 1 ] || [ "$2" -gt 65535 ]; then
    echo "error: $1=$2 is not a port number; use 1-65535 (e.g. $1=${DEFAULT_PORT[$1]})" >&2; exit 2
  fi
}

declare -A SAVED_PORT=()
load_ports() {  # SAVED_PORT[VAR] from STACK_DIR/ports.env (VAR=NUMBER lines), if it exists
  local key value
  [ -f "$PORTS_FILE" ] || return 0
  while IFS='=' read -r key value; do
    case " $PORT_VARS " in *" $key "*) check_port "$key" "$value"; SAVED_PORT[$key]="$value" ;; esac
  done <"$PORTS_FILE"
}

save_ports() {  # write PG_PORT & co. to STACK_DIR/ports.env atomically (temp file + rename)
  local var tmp
  mkdir -p "$STACK_DIR"
  tmp="$(mktemp "$STACK_DIR/.ports.env.XXXXXX")"
  for var in $PORT_VARS; do echo "$var=${!var}"; done >"$tmp"
  mv -f "$tmp" "$PORTS_FILE"
}

choose_ports() {  # choose_ports start|use: set PG_PORT & co. for this command
  local var asked saved conflicts="" live=no
  load_ports
  stack_running && live=yes
  for var in $PORT_VARS; do
    asked="${ASKED_PORT[$var]}"; saved="${SAVED_PORT[$var]:-}"
    [ -z "$asked" ] || check_port "$var" "$asked"
    if [ "$live" = yes ] && [ -n "$saved" ]; then
      # the running stack's port wins: it is where its servers listen
      [ -z "$asked" ] || [ "$asked" = "$saved" ] || conflicts+=" $var=$asked (running: $var=$saved)"
      printf -v "$var" '%s' "$saved"
    else
      printf -v "$var" '%s' "${asked:-${saved:-${DEFAULT_PORT[$var]}}}"
    fi
  done
  [ -z "$conflicts" ] && return 0
  if [ "$1" = start ]; then
    echo "error: the stack in $STACK_DIR is running on other ports:$conflicts; stop it first" \
         "(infra/stack.sh stop), or unset these variables to keep its ports" >&2
    exit 2
  fi
  echo "warning: ignoring$conflicts: the stack in $STACK_DIR was started on the saved ports" \
       "($PORTS_FILE); unset the variables, or stop it and start again on new ports" >&2
}

wait_http() {  # wait_http URL NAME: until URL answers 200, or fail after 120 s
  local url="$1" name="$2" i
  for i in $(seq 1 240); do
    if curl -fsS -o /dev/null "$url" 2>/dev/null; then return 0; fi
    sleep 0.5
  done
  echo "error: $name did not come up at $url; see $LOGS/$name.log" >&2
  exit 1
}

token() {
  [ -f "$STACK_DIR/api-token" ] || (umask 077; "$BIN/python" -c \
    "import secrets; print('crc_' + secrets.token_urlsafe(32))" > "$STACK_DIR/api-token")
  cat "$STACK_DIR/api-token"
}

pg_url() { echo "postgresql+$1://postgres@127.0.0.1:$PG_PORT/$2"; }

env_exports() {
  cat <<EOT
export PREFECT_API_URL=http://127.0.0.1:$PREFECT_PORT/api
export CRUCIBLE_API_URL=http://127.0.0.1:$API_PORT
export CRUCIBLE_API_TOKEN=$(token)
export CRUCIBLE_DATABASE_URL=$(pg_url psycopg crucible)
export CRUCIBLE_WORK_DIR=$STACK_DIR/work
export CRUCIBLE_PREFECT_UI_URL=http://127.0.0.1:$PREFECT_PORT
EOT
}

start_postgres() {
  if [ ! -f "$PGDATA/PG_VERSION" ]; then
    mkdir -p "$PGDATA"
    [ "$(id -u)" = 0 ] && chown -R postgres "$PGDATA"
    as_pg "$(pg_bin initdb)" -D "$PGDATA" -U postgres -A trust -E UTF8 >"$LOGS/initdb.log" 2>&1
  fi
  if ! as_pg "$(pg_bin pg_ctl)" -D "$PGDATA" status >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] && chown postgres "$LOGS" && touch "$LOGS/postgres.log" && chown postgres "$LOGS/postgres.log"
    as_pg "$(pg_bin pg_ctl)" -D "$PGDATA" -l "$LOGS/postgres.log" -w \
      -o "-c listen_addresses=127.0.0.1 -p $PG_PORT -k /tmp" start >/dev/null
  fi
  local db
  for db in prefect crucible; do
    "$BIN/python" - "$PG_PORT" "$db" <<'PY'
import sys
import psycopg
port, name = sys.argv[1], sys.argv[2]
with psycopg.connect(f"host=127.0.0.1 port={port} user=postgres dbname=postgres",
                     autocommit=True) as conn:
    if not conn.execute("select 1 from pg_database where datname = %s", (name,)).fetchone():
        conn.execute(f'create database "{name}"')
PY
  done
}

start_marker() {  # start_marker NAME: a line in LOGS/NAME.log before each (re)start
  echo "==== $(date -u +%Y-%m-%dT%H:%M:%SZ) infra/stack.sh starts $1 ====" >>"$LOGS/$1.log"
}

start_bg() {  # start_bg NAME CMD...: run in the background, remember the pid, append to LOGS/NAME.log
  local name="$1"; shift
  if running "$name"; then return 0; fi
  start_marker "$name"                            # appended: an earlier crash stays readable
  # its own session and process group: `stop` signals it and what it started, not this shell
  setsid nohup "$@" >>"$LOGS/$name.log" 2>&1 &
  echo $! >"$STACK_DIR/$name.pid"
}

start() {
  choose_ports start
  save_ports                                     # first: status/env/stop find this stack
  [ -x "$BIN/python" ] || { echo "error: VENV='$VENV' has no bin/python; run 'make install' or set VENV" >&2; exit 2; }
  mkdir -p "$STACK_DIR" "$LOGS" "$STACK_DIR/work"
  start_postgres
  PREFECT_HOME="$STACK_DIR/prefect-home" \
  PREFECT_SERVER_DATABASE_CONNECTION_URL="$(pg_url asyncpg prefect)" \
  PREFECT_SERVER_ANALYTICS_ENABLED=false \
  PREFECT_UI_API_URL="http://127.0.0.1:$PREFECT_PORT/api" \
    start_bg prefect-server "$BIN/prefect" server start --host 127.0.0.1 --port "$PREFECT_PORT"
  CRUCIBLE_DATABASE_URL="$(pg_url psycopg crucible)" CRUCIBLE_API_TOKEN="$(token)" \
  CRUCIBLE_PREFECT_UI_URL="http://127.0.0.1:$PREFECT_PORT" \
    start_bg crucible-api "$BIN/crucible" api --host 127.0.0.1 --port "$API_PORT" --migrate
  wait_http "http://127.0.0.1:$PREFECT_PORT/api/health" prefect-server
  wait_http "http://127.0.0.1:$API_PORT/readyz" crucible-api
  if ! running serve; then
    # flow runs whose process died with no hook (serve or the sweep killed, the host
    # rebooted) are marked Crashed, in Prefect and the registry; live ones are left alone
    (eval "$(env_exports)"; cd "$ROOT"; PREFECT_HOME="$STACK_DIR/prefect-home" \
      "$BIN/crucible" reconcile --unrecorded >>"$LOGS/reconcile.log" 2>&1) \
      || echo "warning: crucible reconcile failed; see $LOGS/reconcile.log" >&2
  fi
  # serve and its flow runs outlast a Prefect or database outage: every client call retries
  # for about 17 minutes (2 + 4 + ... + 512 s; 500 too, what Prefect answers while its
  # database is refused), and serve's poll loop never gives up (flows.deploy)
  (eval "$(env_exports)"; cd "$ROOT"; PREFECT_HOME="$STACK_DIR/prefect-home" \
    PREFECT_CLIENT_MAX_RETRIES=9 PREFECT_CLIENT_RETRY_EXTRA_CODES=500 \
    start_bg serve "$BIN/crucible" deploy)
  echo "Prefect UI:     http://127.0.0.1:$PREFECT_PORT  (Deployments -> failure-sweep -> Run)"
  echo "Crucible API:   http://127.0.0.1:$API_PORT/docs"
  echo "logs:           $LOGS"
  echo "shell set-up:   eval \"\$(infra/stack.sh env)\""
}

stop_one() {  # stop_one NAME SIGNAL SECONDS: signal it, SIGKILL it after SECONDS
  local name="$1" sig="$2" seconds="$3" pid i
  if running "$name"; then
    pid="$(cat "$STACK_DIR/$name.pid")"
    kill "-$sig" "$pid" 2>/dev/null || true
    for i in $(seq 1 $((seconds * 4))); do alive "$pid" || break; sleep 0.25; done
    if alive "$pid"; then
      kill -KILL "$pid" 2>/dev/null; echo "killed $name (no exit $seconds s after SIG$sig)"
    else
      echo "stopped $name"
    fi
  fi
  rm -f "$STACK_DIR/$name.pid"
}

stop() {
  # serve: SIGTERM (started from a non-interactive shell, it ignores SIGINT); it cancels its
  # flow runs (their hooks record them cancelled), giving each 30 s to exit
  stop_one serve TERM 75
  if running prefect-server && running crucible-api; then
    # what serve did not end (orphans of an earlier serve, a run that did not exit): their
    # process groups, then Cancelled in Prefect and `cancelled` in the registry
    (eval "$(env_exports)"; cd "$ROOT"; PREFECT_HOME="$STACK_DIR/prefect-home" \
      "$BIN/crucible" reconcile --stop --unrecorded 2>>"$LOGS/reconcile.log") \
      || echo "warning: crucible reconcile --stop failed; see $LOGS/reconcile.log" >&2
  fi
  stop_one crucible-api INT 10                    # uvicorn shuts down cleanly on SIGINT
  stop_one prefect-server INT 10
  if postgres_running; then
    as_pg "$(pg_bin pg_ctl)" -D "$PGDATA" -m fast -w stop >/dev/null && echo "stopped postgres"
  fi
}

status() {
  local name
  for name in prefect-server crucible-api serve; do
    if running "$name"; then echo "$name: running (pid $(cat "$STACK_DIR/$name.pid"))"
    else echo "$name: stopped"; fi
  done
  if postgres_running; then echo "postgres: running (port $PG_PORT)"; else echo "postgres: stopped"; fi
  echo "ports: PG_PORT=$PG_PORT PREFECT_PORT=$PREFECT_PORT API_PORT=$API_PORT" \
       "($([ -f "$PORTS_FILE" ] && echo "saved in $PORTS_FILE" || echo "defaults: never started"))"
}

case "${1:-}" in
  start) start ;;
  stop) choose_ports use; stop ;;
  status) choose_ports use; status ;;
  env) choose_ports use; mkdir -p "$STACK_DIR"; env_exports ;;
  *) echo "usage: infra/stack.sh start|status|stop|env" >&2; exit 2 ;;
esac
