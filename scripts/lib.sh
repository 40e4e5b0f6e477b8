# Shared by the scripts: start the project's local ClickHouse on a free port,
# and the shim's venv. Sourced, not run.

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# Sets LOCALCH_PORT and LOCALCH_URL; stops it on exit.
start_local_clickhouse() {
  local root=$1 data=$2
  export LOCALCH_PORT=${LOCALCH_PORT:-$(free_port)}
  export LOCALCH_DATA=$data
  "$root/localch/localch" start
  trap 'LOCALCH_PORT=$LOCALCH_PORT "$root/localch/localch" stop' EXIT
  export LOCALCH_URL="clickhouse://default@127.0.0.1:$LOCALCH_PORT/default"
}

# The shim's venv with its pinned test dependencies (meltano among them) and
# the shim itself, editable; made anew when the pins change. Sets SHIM_VENV.
shim_venv() {
  local root=$1
  SHIM_VENV=$root/.venvs/shim
  if ! cmp -s "$SHIM_VENV/.installed" "$root/shim/requirements-test.txt"; then
    rm -rf "$SHIM_VENV"
    python3 -m venv "$SHIM_VENV"
    "$SHIM_VENV/bin/pip" install --quiet -r "$root/shim/requirements-test.txt"
    "$SHIM_VENV/bin/pip" install --quiet --no-deps -e "$root/shim"
    cp "$root/shim/requirements-test.txt" "$SHIM_VENV/.installed"
  fi
}
