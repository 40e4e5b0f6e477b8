"""`meltano run` per STATE message, in one run and interleaved rounds: on one
gateway, on three gateways behind a per-request round-robin balancer, and on
Meltano's own default backend (systemdb: SQLite in the project) for reference.

One gateway runs with history on and once more with `--history=false`, and
once more with the run under `statehouse lock` (a run lease carried by the
PATCHes), and once more with the shim's write_behind off (one synchronous
PATCH per STATE message; every other row writes behind the run).
Meltano persists state at every STATE message. A run of LONG
messages and one of SHORT cost the same start-up, so the cost of one STATE
message is their difference over LONG - SHORT. The gateways, the balancer,
the tiny tap and target and the Meltano project are the shim tests' own
(shim/tests/conftest.py).

Run with `bench/run meltano` (it starts the local ClickHouse, builds the
release binary and the shim's venv).
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "shim" / "tests"))
os.environ["STATEHOUSE_TEST_CLICKHOUSE_URL"] = os.environ["STATEHOUSE_BENCH_CLICKHOUSE_URL"]

from conftest import lock_prefix, make_project, start_cluster, start_gateway, stop_gateway  # noqa: E402

ROUNDS = 3
SHORT, LONG = 5, 105


JOB = "dev:tap-tiny-to-target-tiny"
UNDER_LOCK = "under statehouse lock"
SYNCHRONOUS = "one gateway, write_behind off"


def timed_run(project, messages: int, prefix: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    result = project.meltano(
        "run", "tap-tiny", "target-tiny", prefix=prefix, extra_env={"TAP_TINY_COUNT": str(messages), **env}
    )
    elapsed = time.perf_counter() - started
    persisted = (result.stdout + result.stderr).count("Incremental state has been updated")
    if persisted != messages:
        raise SystemExit(f"a run persisted {persisted} of {messages} STATE messages:\n{result.stderr}")
    return elapsed


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="statehouse-meltano-bench-"))
    one = start_gateway(f"bench_{uuid.uuid4().hex}")
    quiet = start_gateway(f"bench_{uuid.uuid4().hex}", extra_args=("--history=false",))
    locked = start_gateway(f"bench_{uuid.uuid4().hex}")
    synchronous = start_gateway(f"bench_{uuid.uuid4().hex}")
    three = start_cluster(3)
    projects = {
        "one gateway": make_project(work / "one", one.uri),
        "one gateway, --history=false": make_project(work / "quiet", quiet.uri),
        UNDER_LOCK: make_project(work / "locked", locked.uri),
        SYNCHRONOUS: make_project(work / "synchronous", synchronous.uri),
        "three gateways, round-robin balancer": make_project(work / "three", three.uri),
        "meltano systemdb (SQLite, local file)": make_project(work / "systemdb", "systemdb"),
    }
    prefixes = {name: [] for name in projects}
    prefixes[UNDER_LOCK] = lock_prefix(locked.base, JOB)
    envs: dict[str, dict[str, str]] = {name: {} for name in projects}
    envs[SYNCHRONOUS] = {"MELTANO_STATE_BACKEND_STATEHOUSE_WRITE_BEHIND": "false"}
    per_message: dict[str, list[float]] = {name: [] for name in projects}
    try:
        for name, project in projects.items():
            # Warm-up: Meltano's first run in a project sets it up.
            timed_run(project, SHORT, prefixes[name], envs[name])
        for _ in range(ROUNDS):
            for name, project in projects.items():
                short = timed_run(project, SHORT, prefixes[name], envs[name])
                long = timed_run(project, LONG, prefixes[name], envs[name])
                per_message[name].append((long - short) / (LONG - SHORT) * 1000)
    finally:
        three.balancer.stop()
        for gateway in [one, quiet, locked, synchronous, *three.gateways]:
            stop_gateway(gateway)

    ms = {name: statistics.median(samples) for name, samples in per_message.items()}
    print(f"meltano run, per STATE message: ({LONG}-message run - {SHORT}-message run) / {LONG - SHORT},")
    print(f"median of {ROUNDS} interleaved rounds")
    print(f"{'backend':<40} {'ms/STATE':>9}   rounds")
    for name, value in ms.items():
        rounds = " ".join(f"{s:.1f}" for s in per_message[name])
        print(f"{name:<40} {value:>9.1f}   {rounds}")
    one_ms, quiet_ms, locked_ms, synchronous_ms, three_ms, systemdb_ms = ms.values()
    print(f"three gateways / one gateway: {three_ms / one_ms:.2f}x")
    print(f"history on / off: {one_ms / quiet_ms:.2f}x")
    print(f"under statehouse lock / one gateway: {locked_ms / one_ms:.2f}x")
    print(f"write_behind off / on: {synchronous_ms / one_ms:.2f}x")
    print(f"one gateway / systemdb: {one_ms / systemdb_ms:.2f}x")


if __name__ == "__main__":
    main()
