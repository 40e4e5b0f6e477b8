"""Schemathesis hooks for statehouse's API fuzzing (scripts/schemathesis).

A valid lock request may hold a lock for up to an hour, and another may wait up
to 300 s for it. Valid values above 1 s are cut to 1 s, so a run stays short;
values outside the schema (negative, over the maximum, wrong type) are left
alone: they must still be refused.
"""

import schemathesis

SHORT = {"wait_seconds": 300, "ttl_seconds": 3600}


def shorten(body):
    """Shortens a lock request body in place."""
    if isinstance(body, dict):
        for key, maximum in SHORT.items():
            value = body.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and 1 < value <= maximum:
                body[key] = 1
    return body


@schemathesis.hook
def map_body(context, body):
    return shorten(body)


@schemathesis.hook
def map_case(context, case):
    # The coverage phase does not go through map_body.
    shorten(case.body)
    return case
