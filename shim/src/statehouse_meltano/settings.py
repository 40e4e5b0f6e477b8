"""The backend's Meltano settings, once per URI scheme (Meltano looks settings
up under the scheme's own name: state_backend.statehouse.* for statehouse://,
state_backend.statehouses.* for statehouses://)."""

from __future__ import annotations

import typing as t

from meltano.core.setting_definition import SettingDefinition, SettingKind

SPECS: dict[str, dict[str, t.Any]] = {
    "token": {
        "label": "statehouse token",
        "description": "Bearer token sent to the statehouse gateway (unset: STATEHOUSE_TOKEN)",
        "kind": SettingKind.STRING,
        "sensitive": True,
    },
    "token_file": {
        "label": "statehouse token file",
        "description": "File holding the bearer token, read again for every request so that a rotated "
        "token (a Kubernetes projected service account token, a CI ID token) is used; instead of token "
        "(unset: STATEHOUSE_TOKEN_FILE)",
        "kind": SettingKind.STRING,
    },
    "request_timeout": {
        "label": "Request timeout",
        "description": "Seconds to wait for the gateway to answer a request (lock waits come on top)",
        "kind": SettingKind.INTEGER,
        "value": 10,
    },
    "lease_ttl": {
        "label": "Lease TTL",
        "description": "Seconds a lock lease lives without renewal; renewed every third of it",
        "kind": SettingKind.INTEGER,
        "value": 30,
    },
    "owner": {
        "label": "Lock owner",
        "description": "Name shown as the holder of this process's locks (default: meltano@host:pid)",
        "kind": SettingKind.STRING,
    },
    "allow_regression": {
        "label": "Allow bookmark regressions",
        "description": "Streams whose bookmarks may go backwards (comma-separated, or *) on a gateway "
        "with --bookmark-regression reject; sent as Statehouse-Allow-Regression",
        "kind": SettingKind.STRING,
    },
    "allow_loss": {
        "label": "Allow bookmark losses",
        "description": "Streams whose bookmarks a write may drop (comma-separated, or *) on a gateway "
        "with --bookmark-loss reject; sent as Statehouse-Allow-Loss",
        "kind": SettingKind.STRING,
    },
    "write_behind": {
        "label": "Write behind",
        "description": "Persist STATE messages behind the run (newest wins) instead of waiting for each; "
        "the run's last state is still written before `meltano run` exits 0",
        "kind": SettingKind.BOOLEAN,
        "value": True,
    },
    "ca_file": {
        "label": "CA file",
        "description": "PEM file of the CA that signed the gateway's certificate (statehouses:// only); "
        "then the only CA trusted. Unset: STATEHOUSE_CA_FILE, else the system's trust store",
        "kind": SettingKind.STRING,
    },
    "client_cert_file": {
        "label": "Client certificate file",
        "description": "PEM client certificate for a gateway that requires one (mTLS; with client_key_file; "
        "unset: STATEHOUSE_CLIENT_CERT_FILE)",
        "kind": SettingKind.STRING,
    },
    "client_key_file": {
        "label": "Client key file",
        "description": "PEM private key of client_cert_file (unset: STATEHOUSE_CLIENT_KEY_FILE)",
        "kind": SettingKind.STRING,
    },
}


def setting(scheme: str, key: str) -> SettingDefinition:
    return SettingDefinition(name=f"state_backend.{scheme}.{key}", env_specific=True, **SPECS[key])


STATEHOUSE_TOKEN = setting("statehouse", "token")
STATEHOUSE_TOKEN_FILE = setting("statehouse", "token_file")
STATEHOUSE_REQUEST_TIMEOUT = setting("statehouse", "request_timeout")
STATEHOUSE_LEASE_TTL = setting("statehouse", "lease_ttl")
STATEHOUSE_OWNER = setting("statehouse", "owner")
STATEHOUSE_ALLOW_REGRESSION = setting("statehouse", "allow_regression")
STATEHOUSE_ALLOW_LOSS = setting("statehouse", "allow_loss")
STATEHOUSE_WRITE_BEHIND = setting("statehouse", "write_behind")
STATEHOUSES_TOKEN = setting("statehouses", "token")
STATEHOUSES_TOKEN_FILE = setting("statehouses", "token_file")
STATEHOUSES_REQUEST_TIMEOUT = setting("statehouses", "request_timeout")
STATEHOUSES_LEASE_TTL = setting("statehouses", "lease_ttl")
STATEHOUSES_OWNER = setting("statehouses", "owner")
STATEHOUSES_ALLOW_REGRESSION = setting("statehouses", "allow_regression")
STATEHOUSES_ALLOW_LOSS = setting("statehouses", "allow_loss")
STATEHOUSES_WRITE_BEHIND = setting("statehouses", "write_behind")
STATEHOUSES_CA_FILE = setting("statehouses", "ca_file")
STATEHOUSES_CLIENT_CERT_FILE = setting("statehouses", "client_cert_file")
STATEHOUSES_CLIENT_KEY_FILE = setting("statehouses", "client_key_file")
