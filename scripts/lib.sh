# Shared by the scripts: start the project's local ClickHouse on a free port,
# and the shim's venv. Sourced, not run.

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# A new directory for throwaway engines' data (the local ClickHouse's,
# ZooKeeper's), in memory when the machine has a tmpfs at /dev/shm with 4 GiB
# free. ClickHouse creates and removes a part's files on every INSERT, and on
# ext4 a file created within seconds of many removals waits while the kernel
# steps over the removed inodes: measured here, an INSERT took 2 to 4 times as
# long on disk as in memory while other engines were writing (the test suites
# run three).
scratch_dir() {
  local free_kib
  free_kib=$(df -k --output=avail /dev/shm 2>/dev/null | tail -1 || true)
  if [ "${free_kib:-0}" -gt $((4 * 1024 * 1024)) ] 2>/dev/null && [ -w /dev/shm ]; then
    mktemp -d -p /dev/shm statehouse.XXXXXX
  else
    mktemp -d
  fi
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

# Installs the Debian packages named that are missing, with one apt-get update.
apt_install_missing() {
  local missing=() package
  for package in "$@"; do
    dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    # Another apt-get at work (another checkout's tests) is waited for.
    apt-get -o DPkg::Lock::Timeout=300 update -qq
    DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=300 install -y -qq "${missing[@]}" >/dev/null
  fi
}

# Runs a command and says how long it took (CI's phase timings); returns its status.
timed() {
  local name=$1 start=$SECONDS status=0
  shift
  "$@" || status=$?
  echo "scripts/test: $name took $((SECONDS - start))s" >&2
  return "$status"
}

# Installs Debian's ZooKeeper when missing, starts it on a free loopback port
# with its data in $2, and points the local ClickHouse started next at it (its
# KeeperMap tables). Sets and exports ZOOKEEPER_PORT, ZOOKEEPER_DATA and
# LOCALCH_ZOOKEEPER; the caller stops it (`localch/zookeeper stop`).
start_zookeeper() {
  local root=$1 data=$2
  apt_install_missing zookeeper
  export ZOOKEEPER_PORT=${ZOOKEEPER_PORT:-$(free_port)}
  export ZOOKEEPER_DATA=$data
  "$root/localch/zookeeper" start
  export LOCALCH_ZOOKEEPER=127.0.0.1:$ZOOKEEPER_PORT
}

# A venv at $1 with the pinned requirements file $2 (and the package at $3,
# editable, if given); made anew when the pins change. Sets VENV.
pinned_venv() {
  VENV=$1
  local requirements=$2 editable=${3:-}
  if ! cmp -s "$VENV/.installed" "$requirements"; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    "$VENV/bin/pip" install --quiet -r "$requirements"
    if [ -n "$editable" ]; then
      "$VENV/bin/pip" install --quiet --no-deps -e "$editable"
      cp "$editable/pyproject.toml" "$VENV/.editable"
    fi
    cp "$requirements" "$VENV/.installed"
  fi
  # The editable package's entry points (Meltano finds settings by them) are
  # read at install time: a changed pyproject.toml is installed again.
  if [ -n "$editable" ] && ! cmp -s "$VENV/.editable" "$editable/pyproject.toml"; then
    "$VENV/bin/pip" install --quiet --no-deps -e "$editable"
    cp "$editable/pyproject.toml" "$VENV/.editable"
  fi
}

# Schemathesis's venv, pinned in tests/schemathesis/requirements.txt. Sets VENV.
schemathesis_venv() {
  pinned_venv "$1/.venvs/schemathesis" "$1/tests/schemathesis/requirements.txt"
}

# The shim's venv: its pinned test dependencies (meltano among them) and the
# shim itself, editable. Sets SHIM_VENV.
shim_venv() {
  pinned_venv "$1/.venvs/shim" "$1/shim/requirements-test.txt" "$1/shim"
  SHIM_VENV=$VENV
}
