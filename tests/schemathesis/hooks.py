"""Schemathesis hooks for statehouse's API fuzzing (scripts/schemathesis).

A valid lock request may hold a lock for up to an hour, and another may wait up
to 300 s for it. Waits above 1 s are cut to 1 s, so a run stays short, and
leases above 10 s to 10 s: long enough that the lease a stateful step just
took is still there for the next step to read. Values outside the schema
(negative, over the maximum, wrong type) are left alone: they must still be
refused.

Positive cases (which must be accepted) are kept to what the schema can say:

- A listing's `cursor`, and the change feed's `since` and `Last-Event-ID`,
  are valid only as cursors this service handed out (each carries a check
  over the pattern it follows); no schema can say which well-formed hex
  strings those are, so a generated one is refused with 400 however well
  formed. Positive cases go without one; negative cases keep theirs, which
  must still be refused.
- An `If-Match` holds only for the state as stored: `*` only if it exists, a
  tag only if it is the current ETag, which generated data cannot know, so it
  gets 412 (still a documented answer, which Schemathesis counts as refusing
  the data). Positive cases go without one; negative cases keep theirs. (The
  coverage phase of Schemathesis 4.32 also sends a placeholder such as `0` in
  a case it calls positive when it cannot write a value for the header's
  pattern: that one goes too.)
- A long-poll's `wait` may be any string the schema allows, and a valid one
  up to 120 s holds the request that long (past the run's request timeout):
  a positive case waits `500ms`, and so does any case whose `wait` is a plain
  duration (`7`, `90s`, `2m`); what is left is refused with 400 at once.
- A bulk import names each state_id once (no schema says "unique by a
  member"): a positive batch keeps the first entry of each id.
- A pool acquire's `slots` must not pass its `limit` (a rule between two
  fields, which no schema can say): a positive case asks at most its limit.
- An `at` (a read as of an instant, a restore) is valid only between the
  oldest instant history keeps and the gateway's clock, which no schema can
  say: a positive case asks a second ago.
"""

import datetime
import re

import schemathesis

# Field: (the schema's maximum, what a valid value above the cut becomes).
SHORT = {"wait_seconds": (300, 1), "ttl_seconds": (3600, 10)}


def shorten(body):
    """Shortens a lock request body in place."""
    if isinstance(body, dict):
        for key, (maximum, cut) in SHORT.items():
            value = body.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and cut < value <= maximum:
                body[key] = cut
    return body


def first_of_each_id(batch):
    seen = set()
    kept = []
    for entry in batch:
        state_id = entry.get("state_id") if isinstance(entry, dict) else None
        if state_id not in seen:
            seen.add(state_id)
            kept.append(entry)
    return kept


# `wait` values a long-poll accepts and would wait on: seconds or one unit.
PLAIN_WAIT = re.compile(r"\s*\d+\s*(ms|s|m)?\s*")


def short_wait(query, positive):
    """Cuts a long-poll's wait to half a second, in place."""
    if not query or "wait" not in query:
        return
    value = query["wait"]
    if positive or (isinstance(value, str) and PLAIN_WAIT.fullmatch(value)):
        query["wait"] = "500ms"


def a_second_ago():
    at = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(seconds=1)
    return at.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def recent_at(case):
    """Moves a positive case's `at` to a second ago, in place."""
    if case.query and "at" in case.query:
        case.query["at"] = a_second_ago()
    if case.operation.path == "/v1/restore" and isinstance(case.body, dict) and "at" in case.body:
        case.body["at"] = a_second_ago()


def slots_within_limit(case):
    """Cuts a positive pool acquire's slots to its limit, in place."""
    body = case.body
    if not case.operation.path.startswith("/v1/pools/") or not isinstance(body, dict):
        return
    slots, limit = body.get("slots"), body.get("limit")
    if all(isinstance(v, int) and not isinstance(v, bool) for v in (slots, limit)) and slots > limit:
        body["slots"] = limit


@schemathesis.hook
def map_body(context, body):
    return shorten(body)


@schemathesis.hook
def map_case(context, case):
    # The coverage phase does not go through map_body.
    shorten(case.body)
    meta = case.meta
    positive = meta is not None and meta.generation.mode.is_positive
    short_wait(case.query, positive)
    if not positive:
        return case
    recent_at(case)
    slots_within_limit(case)
    if case.query:
        case.query.pop("cursor", None)
        case.query.pop("since", None)
    if case.headers:
        for name in [name for name in case.headers if name.lower() in ("if-match", "last-event-id")]:
            del case.headers[name]
    if case.operation.method.upper() == "POST" and case.operation.path == "/v1/states" and isinstance(case.body, list):
        case.body = first_of_each_id(case.body)
    return case
