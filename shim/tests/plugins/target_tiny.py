#!/usr/bin/env python3
"""A tiny Singer target for the tests: appends records to TARGET_TINY_OUTPUT
and, once they are written, passes each STATE on to Meltano on stdout."""

import json
import os
import sys


def main():
    output = os.environ.get("TARGET_TINY_OUTPUT", os.devnull)
    with open(output, "a") as out:
        for line in sys.stdin:
            message = json.loads(line)
            if message["type"] == "RECORD":
                out.write(json.dumps(message["record"]) + "\n")
                out.flush()
            elif message["type"] == "STATE":
                sys.stdout.write(json.dumps(message["value"]) + "\n")
                sys.stdout.flush()


if __name__ == "__main__":
    main()
