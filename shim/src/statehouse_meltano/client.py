"""A small client for the statehouse REST API: one HTTP session, reused."""

from __future__ import annotations

import ssl
import threading
import time
import typing as t
from dataclasses import dataclass
from urllib.parse import quote, urlparse, urlunparse

import requests
import truststore
from requests.adapters import HTTPAdapter

SCHEMES = {"statehouse": "http", "statehouses": "https"}
PAGE = 1000
MAX_WAIT_SECONDS = 300.0
# A 503 that did nothing and says when to come back (the gateway is at its
# limit, or the gateway holding the state_id's claim is gone until the claim
# lapses) is retried after its Retry-After, for this long in all.
RETRY_WITHIN_SECONDS = 30.0
RETRIABLE_PROBLEMS = ("overloaded", "authority-unreachable")


class GatewayError(Exception):
    """The gateway answered with an error, or could not be reached."""


class GatewayUnavailableError(GatewayError):
    """The gateway could not be reached in time."""


class LockHeldError(GatewayError):
    """The lock stayed held by someone else for the whole wait."""


class StateLockedError(GatewayError):
    """A write without the holder's lease, to a state_id another client holds the lease of."""


@dataclass(frozen=True)
class TlsSettings:
    """state_backend.statehouses.{ca_file,client_cert_file,client_key_file}."""

    ca_file: str | None = None
    client_cert_file: str | None = None
    client_key_file: str | None = None

    def verify(self) -> str | bool:
        """ca_file alone, when set; else True: the system store (SystemTrustAdapter)."""
        return self.ca_file or True

    def cert(self) -> tuple[str, str] | None:
        if self.client_cert_file and self.client_key_file:
            return (self.client_cert_file, self.client_key_file)
        if self.client_cert_file or self.client_key_file:
            msg = "set both state_backend.statehouses.client_cert_file and client_key_file, or neither"
            raise ValueError(msg)
        return None


@dataclass(frozen=True)
class PatternDeletion:
    """A pattern delete's answer: the ids whose lease another client held were
    left (`skipped_locked` of them, the first `locked` by name)."""

    deleted: int
    skipped_locked: int = 0
    locked: tuple[str, ...] = ()


class SystemTrustAdapter(HTTPAdapter):
    """HTTPS verified against the operating system's trust store, through
    truststore, as `statehouse lock` does; not against certifi's bundle, which
    requests would use and which holds no CA installed on the host.

    Mounted on the shim's own session only: Meltano and its plugins keep
    whatever trust they have.
    """

    def __init__(self) -> None:
        self._context = truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        super().__init__()

    def init_poolmanager(self, *args: t.Any, **kwargs: t.Any) -> None:
        super().init_poolmanager(*args, ssl_context=self._context, **kwargs)

    def proxy_manager_for(self, proxy: str, **proxy_kwargs: t.Any) -> t.Any:
        # Through an HTTPS_PROXY, the gateway's certificate is checked the same way.
        return super().proxy_manager_for(proxy, ssl_context=self._context, **proxy_kwargs)


CA_HINT = (
    "set state_backend.statehouses.ca_file (MELTANO_STATE_BACKEND_STATEHOUSES_CA_FILE, or STATEHOUSE_CA_FILE) "
    "to the PEM file of the CA that signed the gateway's certificate, or add that CA to the system's trust store"
)
CLIENT_CERT_HINT = (
    "set state_backend.statehouses.client_cert_file and client_key_file "
    "(MELTANO_STATE_BACKEND_STATEHOUSES_CLIENT_CERT_FILE, ..._CLIENT_KEY_FILE, or STATEHOUSE_CLIENT_CERT_FILE "
    "and STATEHOUSE_CLIENT_KEY_FILE) to a certificate the gateway's CA signed"
)


REGRESSION_HINT = (
    "if this is meant, set state_backend.statehouse.allow_regression "
    "(MELTANO_STATE_BACKEND_STATEHOUSE_ALLOW_REGRESSION) to the streams, or *"
)

LOSS_HINT = (
    "if this is meant, set state_backend.statehouse.allow_loss "
    "(MELTANO_STATE_BACKEND_STATEHOUSE_ALLOW_LOSS) to the streams, or *"
)


def gateway_url(uri: str) -> str:
    """The gateway's HTTP(S) base URL for a statehouse:// or statehouses:// URI."""
    parsed = urlparse(uri)
    scheme = SCHEMES.get(parsed.scheme)
    if scheme is None:
        msg = f"unsupported state backend URI {uri!r}: use statehouse://host:port or statehouses://host:port"
        raise ValueError(msg)
    if not parsed.hostname:
        msg = f"state backend URI {uri!r} names no gateway host"
        raise ValueError(msg)
    return urlunparse((scheme, parsed.netloc, parsed.path.rstrip("/"), "", "", ""))


def _retry_after(response: requests.Response) -> float | None:
    """Seconds to wait before sending a refused request again, if it may be."""
    if response.status_code != 503:
        return None
    try:
        kind = str(response.json().get("type", ""))
        pause = float(response.headers.get("Retry-After", ""))
    except ValueError:
        return None
    if not kind.endswith(RETRIABLE_PROBLEMS):
        return None
    return max(0.1, pause)


class TokenFile:
    """A bearer token in a file that its platform rotates in place: read again
    for every request; a read that fails or finds it empty (caught
    mid-replacement) keeps the last token read."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._last = ""
        self._guard = threading.Lock()
        self.current()

    def current(self) -> str:
        try:
            with open(self.path, encoding="utf-8") as file:
                token = file.read().strip()
        except OSError:
            token = ""
        with self._guard:
            if token:
                self._last = token
            return self._last


def _segment(state_id: str) -> str:
    return quote(state_id, safe="")


class GatewayClient:
    """Calls the gateway; every failure names it."""

    def __init__(
        self,
        base_url: str,
        *,
        token: str | None = None,
        token_file: str | None = None,
        timeout: float = 10.0,
        tls: TlsSettings | None = None,
        allow_regression: str | None = None,
        allow_loss: str | None = None,
    ) -> None:
        self.base_url = base_url
        self.timeout = timeout
        tls = tls or TlsSettings()
        self.verify = tls.verify()
        self.cert = tls.cert()
        self.session = requests.Session()
        if not tls.ca_file:
            self.session.mount("https://", SystemTrustAdapter())
        self.session.headers["User-Agent"] = "statehouse-meltano/0.1.0"
        self._token_file = TokenFile(token_file) if token_file else None
        if token and self._token_file is None:
            self.session.headers["Authorization"] = f"Bearer {token}"
        if allow_regression:
            # Streams whose bookmarks this project's writes may move backwards.
            self.session.headers["Statehouse-Allow-Regression"] = allow_regression
        if allow_loss:
            # Streams whose bookmarks this project's writes may drop.
            self.session.headers["Statehouse-Allow-Loss"] = allow_loss

    def close(self) -> None:
        self.session.close()

    def _call(
        self,
        method: str,
        path: str,
        *,
        expect: tuple[int, ...],
        body: t.Any = None,
        lease_id: str | None = None,
        params: dict[str, t.Any] | None = None,
        extra_wait: float = 0.0,
    ) -> requests.Response:
        url = f"{self.base_url}{path}"
        headers = {"Lease-Id": lease_id} if lease_id else {}
        if self._token_file is not None and (token := self._token_file.current()):
            headers["Authorization"] = f"Bearer {token}"
        # Sent with send(), not request(): request() would swap verify=True for
        # REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE, and the shim trusts what the
        # runner does (ca_file, else the system store). Proxies from the
        # environment still apply.
        prepared = self.session.prepare_request(
            requests.Request(method, url, json=body, params=params, headers=headers)
        )
        give_up = time.monotonic() + RETRY_WITHIN_SECONDS
        while True:
            try:
                response = self.session.send(
                    prepared,
                    timeout=(self.timeout, self.timeout + extra_wait),
                    verify=self.verify,
                    cert=self.cert,
                )
            except requests.exceptions.SSLError as err:
                msg = f"statehouse gateway at {self.base_url}: TLS failed, its certificate could not be verified or it refused ours ({err}); {CA_HINT}"
                raise GatewayUnavailableError(msg) from None
            except requests.RequestException as err:
                msg = f"statehouse gateway at {self.base_url} is unavailable: {err}"
                raise GatewayUnavailableError(msg) from None
            if response.status_code in expect:
                return response
            pause = _retry_after(response)
            if pause is None or time.monotonic() + pause > give_up:
                raise self._error(method, url, response)
            time.sleep(pause)

    def _error(self, method: str, url: str, response: requests.Response) -> GatewayError:
        try:
            problem = response.json()
            detail = f"{problem.get('title')}: {problem.get('detail')}"
        except ValueError:
            problem, detail = {}, response.text[:200]
        holder = problem.get("holder") if isinstance(problem, dict) else None
        if holder:
            detail += f"; held by {holder.get('owner')} until {holder.get('expires_at')}"
        free_at = problem.get("free_at") if isinstance(problem, dict) else None
        if free_at:
            detail += f"; free again at {free_at}"
        message = f"statehouse gateway at {self.base_url}: {method} {url} answered {response.status_code} ({detail})"
        kind = str(problem.get("type", ""))
        if response.status_code == 403 and "client certificate" in detail:
            message += f"; {CLIENT_CERT_HINT}"
        if kind.endswith(":bookmark-regression"):
            message += f"; {REGRESSION_HINT}"
        if kind.endswith(":bookmark-loss"):
            message += f"; {LOSS_HINT}"
        # A lock-delay is busy as a held lock is: the id is not free yet.
        if response.status_code == 409 and kind.endswith((":lock-held", ":lock-delay")):
            return LockHeldError(message)
        if response.status_code == 409 and kind.endswith(":state-locked"):
            return StateLockedError(message)
        if response.status_code in (502, 503, 504):
            return GatewayUnavailableError(message)
        return GatewayError(message)

    def get_state(self, state_id: str) -> dict[str, t.Any] | None:
        response = self._call("GET", f"/v1/states/{_segment(state_id)}", expect=(200, 404))
        return response.json() if response.status_code == 200 else None

    def put_state(self, state_id: str, document: dict[str, t.Any], lease_id: str | None) -> None:
        self._call("PUT", f"/v1/states/{_segment(state_id)}", expect=(200, 201), body=document, lease_id=lease_id)

    def patch_state(self, state_id: str, document: dict[str, t.Any], lease_id: str | None) -> None:
        """Meltano's update in one request: an incomplete state's partial merges
        into the stored one, a complete state replaces it. Without a lease, a
        state_id another client holds the lease of is StateLockedError."""
        self._call("PATCH", f"/v1/states/{_segment(state_id)}", expect=(200, 201), body=document, lease_id=lease_id)

    def delete_state(self, state_id: str, lease_id: str | None) -> None:
        self._call("DELETE", f"/v1/states/{_segment(state_id)}", expect=(204,), lease_id=lease_id)

    def _listing(self, pattern: str | None, **extra: str) -> t.Iterator[dict[str, t.Any]]:
        params: dict[str, t.Any] = {"pattern": pattern or "*", "limit": PAGE, **extra}
        while True:
            page = self._call("GET", "/v1/states", expect=(200,), params=params).json()
            yield from page["states"]
            if not page.get("next_cursor"):
                return
            params["cursor"] = page["next_cursor"]

    def state_ids(self, pattern: str | None) -> t.Iterator[str]:
        for entry in self._listing(pattern):
            yield entry["state_id"]

    def states(self, pattern: str | None) -> t.Iterator[dict[str, t.Any]]:
        """Every matching state with its document, a page of them per request."""
        return self._listing(pattern, include="documents")

    def import_states(self, entries: list[dict[str, t.Any]]) -> int:
        """Writes a batch of {state_id, completed, partial[, lease_id]} at once, or none of it."""
        response = self._call("POST", "/v1/states", expect=(200,), body=entries)
        return int(response.json()["written"])

    def delete_matching(self, pattern: str) -> PatternDeletion:
        answer = self._call("DELETE", "/v1/states", expect=(200,), params={"pattern": pattern}).json()
        # A gateway from before leases guarded the pattern delete sends neither field.
        return PatternDeletion(
            deleted=int(answer["deleted"]),
            skipped_locked=int(answer.get("skipped_locked") or 0),
            locked=tuple(str(state_id) for state_id in answer.get("locked") or ()),
        )

    def acquire(self, state_id: str, *, owner: str, ttl_seconds: int, wait_seconds: float) -> dict[str, t.Any]:
        wait = max(0.0, min(float(wait_seconds), MAX_WAIT_SECONDS))
        body = {"owner": owner, "ttl_seconds": ttl_seconds, "wait_seconds": wait}
        # The gateway may take the whole wait (plus one claim settle) to answer.
        return self._call(
            "POST", f"/v1/locks/{_segment(state_id)}", expect=(201,), body=body, extra_wait=wait + 5
        ).json()

    def renew(self, state_id: str, lease_id: str, ttl_seconds: int) -> dict[str, t.Any]:
        path = f"/v1/locks/{_segment(state_id)}/{lease_id}"
        return self._call("PUT", path, expect=(200,), body={"ttl_seconds": ttl_seconds}).json()

    def release(self, state_id: str, lease_id: str) -> None:
        self._call("DELETE", f"/v1/locks/{_segment(state_id)}/{lease_id}", expect=(204,))
