# Shared by the scripts: start the project's local ClickHouse on a free port.
# Sourced, not run. Sets LOCALCH_PORT and LOCALCH_URL; stops it on exit.

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start_local_clickhouse() {
  local root=$1 data=$2
  export LOCALCH_PORT=${LOCALCH_PORT:-$(free_port)}
  export LOCALCH_DATA=$data
  "$root/localch/localch" start
  trap 'LOCALCH_PORT=$LOCALCH_PORT "$root/localch/localch" stop' EXIT
  export LOCALCH_URL="clickhouse://default@127.0.0.1:$LOCALCH_PORT/default"
}
