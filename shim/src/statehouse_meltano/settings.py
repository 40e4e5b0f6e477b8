"""The backend's Meltano settings, once per URI scheme (Meltano looks settings
up under the scheme's own name: state_backend.statehouse.* for statehouse://,
state_backend.statehouses.* for statehouses://)."""

from __future__ import annotations

from meltano.core.setting_definition import SettingDefinition, SettingKind


def _token(scheme: str) -> SettingDefinition:
    return SettingDefinition(
        name=f"state_backend.{scheme}.token",
        label="statehouse token",
        description="Bearer token sent to the statehouse gateway",
        kind=SettingKind.STRING,
        sensitive=True,
        env_specific=True,
    )


def _request_timeout(scheme: str) -> SettingDefinition:
    return SettingDefinition(
        name=f"state_backend.{scheme}.request_timeout",
        label="Request timeout",
        description="Seconds to wait for the gateway to answer a request (lock waits come on top)",
        kind=SettingKind.INTEGER,
        value=10,
        env_specific=True,
    )


def _lease_ttl(scheme: str) -> SettingDefinition:
    return SettingDefinition(
        name=f"state_backend.{scheme}.lease_ttl",
        label="Lease TTL",
        description="Seconds a lock lease lives without renewal; renewed every third of it",
        kind=SettingKind.INTEGER,
        value=30,
        env_specific=True,
    )


def _owner(scheme: str) -> SettingDefinition:
    return SettingDefinition(
        name=f"state_backend.{scheme}.owner",
        label="Lock owner",
        description="Name shown as the holder of this process's locks (default: meltano@host:pid)",
        kind=SettingKind.STRING,
        env_specific=True,
    )


STATEHOUSE_TOKEN = _token("statehouse")
STATEHOUSE_REQUEST_TIMEOUT = _request_timeout("statehouse")
STATEHOUSE_LEASE_TTL = _lease_ttl("statehouse")
STATEHOUSE_OWNER = _owner("statehouse")
STATEHOUSES_TOKEN = _token("statehouses")
STATEHOUSES_REQUEST_TIMEOUT = _request_timeout("statehouses")
STATEHOUSES_LEASE_TTL = _lease_ttl("statehouses")
STATEHOUSES_OWNER = _owner("statehouses")
