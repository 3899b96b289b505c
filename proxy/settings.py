"""Settings, read once at start-up from flags and TRAJPROXY_* environment variables; `key=value` flags read
as pairs."""

from __future__ import annotations

import ipaddress
import json
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAJPROXY_", extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    database_url: str = "sqlite:///./trajproxy.db"
    trainer_token: SecretStr | None = None  # None: the token file's (see proxy/trainer_token.py)
    trainer_token_file: str | None = None  # where a generated token is kept (default ~/.config/trajproxy/trainer-token)
    no_trainer_token: bool = False  # an open trainer API, on loopback only: for a throwaway session
    policy_api_key: SecretStr | None = None  # sent to a served policy's inference server (vllm:, sglang:), if it asks
    turn_timeout_s: float = Field(default=300.0, gt=0)
    lease_s: float = Field(default=60.0, gt=0)
    keepalive_s: float = Field(default=10.0, gt=0)
    retry_grace_s: float = Field(default=5.0, ge=0)  # how long a hung-up agent's turn waits for its SDK's retry
    restart_grace_s: float = Field(default=60.0, ge=0)  # how long a turn taken back at start-up waits for its retry
    max_body_bytes: int = Field(default=32 * 1024 * 1024, gt=0)
    body_read_timeout_s: float = Field(default=30.0, gt=0)  # a body that sends nothing this long is answered 408
    body_timeout_s: float = Field(default=120.0, gt=0)  # a body not whole this long after it began is answered 408
    header_timeout_s: float = Field(default=30.0, gt=0)  # a request's head not whole this long: its connection closes
    max_sandbox_connections: int = Field(default=4096, gt=0)  # on the sandbox socket at once (at most half the fds)
    forwarded_allow_ips: str = ""  # proxies whose X-Forwarded-For/-Proto are believed: addresses, networks or *
    public_url: str | None = None
    socket_path: str | None = None  # also serve agents on this Unix socket (sandbox gates relay to it)
    server: Literal["granian", "uvicorn"] = "uvicorn"  # the HTTP server in front (RESULTS.md: "A compiled HTTP front")
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    shared: bool = False  # one of several replicas sharing a Postgres database (behind a load balancer)
    replica_dead_s: float = Field(default=10.0, gt=0)  # a replica silent this long is dead: its turns are taken over

    @field_validator("trainer_token", mode="before")
    @classmethod
    def _blank_is_none(cls, value: object) -> object:
        # An empty token (TRAJPROXY_TRAINER_TOKEN= from an unset shell variable) is no token: left as a
        # SecretStr it would pass the public-bind check, yet be falsy where the app reads it, leaving /api open.
        given = value.get_secret_value() if isinstance(value, SecretStr) else value
        return None if isinstance(given, str) and not given.strip() else value

    @field_validator("forwarded_allow_ips")
    @classmethod
    def _addresses(cls, value: str) -> str:
        for item in value.split(","):
            if item.strip() not in ("", "*"):
                try:
                    ipaddress.ip_network(item.strip(), strict=False)
                except ValueError:
                    raise ValueError(f"{item.strip()!r} is not an IP address or network (nor *)") from None
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lowercase(cls, value: object) -> object:
        return value.lower() if isinstance(value, str) else value

    @property
    def loopback_only(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False

    def refusal(self) -> str | None:
        """Why these settings must not be served, or None if they are safe."""
        if self.no_trainer_token and self.trainer_token is not None:
            return "--no-trainer-token and a trainer token (TRAJPROXY_TRAINER_TOKEN) were both given: choose one"
        if self.shared and not self.database_url.startswith(("postgresql", "postgres:")):
            return (
                "--shared needs Postgres (--database-url postgresql://...): replicas share one Postgres database; "
                "a SQLite database is served by one process"
            )
        if self.no_trainer_token and not self.loopback_only:
            return (
                f"refusing to listen on {self.host} without a trainer token: anyone who can reach it could "
                "read and answer every episode. Drop --no-trainer-token (a token is then generated), set one with "
                "--trainer-token or TRAJPROXY_TRAINER_TOKEN, or bind 127.0.0.1."
            )
        return None


def key_values(items: list[str], flag: str) -> dict[str, Any]:
    """`key=value` pairs from a repeated flag; a value that reads as JSON (a number, true, null, a list, a string in
    quotes) is taken so, any other as text, but one that starts as JSON must be JSON. ValueError names the flag and
    the pair that is not one."""
    pairs: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} {item!r}: expected key=value")
        try:
            pairs[key] = json.loads(raw)
        except ValueError as e:
            if raw.lstrip()[:1] in ("{", "[", '"'):  # meant as JSON, and not: taken as text, it would fail far away
                raise ValueError(f"{flag} {key}: not valid JSON ({e})") from None
            pairs[key] = raw
    return pairs
