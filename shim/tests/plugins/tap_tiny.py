#!/usr/bin/env python3
"""A tiny Singer tap for the tests: stream `numbers`, ids after its bookmark.

TAP_TINY_COUNT records (default 5), one STATE after each, TAP_TINY_DELAY
seconds apart; the state it was given is appended to TAP_TINY_LOG as JSON.
TAP_TINY_RUN tags every state, so tests can tell whose state is stored.
TAP_TINY_EXIT is the exit code it ends with (default 0). TAP_TINY_START
makes it start at that id instead, as a tap that emits an older bookmark.
Bookmarks carry Singer's replication_key and replication_key_value too.
"""

import argparse
import json
import os
import sys
import time


def emit(message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    parser.add_argument("--state")
    parser.add_argument("--catalog")
    parser.add_argument("--properties")
    parser.add_argument("--discover", action="store_true")
    args = parser.parse_args()

    state = {}
    if args.state:
        with open(args.state) as f:
            state = json.load(f)
    log = os.environ.get("TAP_TINY_LOG")
    if log:
        with open(log, "a") as f:
            f.write(json.dumps({"received_state": state}) + "\n")

    last = state.get("bookmarks", {}).get("numbers", {}).get("last_id", 0)
    count = int(os.environ.get("TAP_TINY_COUNT", "5"))
    delay = float(os.environ.get("TAP_TINY_DELAY", "0"))
    run = os.environ.get("TAP_TINY_RUN", "")
    emit({"type": "SCHEMA", "stream": "numbers", "key_properties": ["id"],
          "schema": {"type": "object", "properties": {"id": {"type": "integer"}}}})
    first = int(os.environ.get("TAP_TINY_START", last + 1))
    for n in range(first, first + count):
        emit({"type": "RECORD", "stream": "numbers", "record": {"id": n}})
        bookmark = {"last_id": n, "replication_key": "id", "replication_key_value": n}
        emit({"type": "STATE", "value": {"bookmarks": {"numbers": bookmark}, "run": run}})
        time.sleep(delay)
    sys.exit(int(os.environ.get("TAP_TINY_EXIT", "0")))


if __name__ == "__main__":
    main()
