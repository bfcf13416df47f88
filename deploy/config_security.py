"""The cluster config's shared base and its security section.

Split from ``deploy.config`` to keep files small; ``deploy.config`` re-exports
``ConfigError`` and ``Strict``.
"""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, SecretStr, model_validator

# A config error never echoes a value under such a key (a URL may hold a password).
SECRET_WORDS = ("secret", "key", "token", "password", "url")
# Set by ``pdserve launch`` for its children when the config names no secret: the file holding the
# secret it generated for this cluster (deploy.launcher.generate_secret).
GENERATED_SECRET_ENV = "PDSERVE_GENERATED_SECRET_FILE"


def looks_secret(loc: tuple) -> bool:
    """Whether a config location (``("router", "api_keys", 0)``) may hold a secret, typos included."""
    names = [str(part).lower() for part in loc if isinstance(part, str)]
    return names[:1] == ["security"] or any(word in name for name in names for word in SECRET_WORDS)


class ConfigError(ValueError):
    """A config file that cannot be used; the message names file, key and value."""


class Strict(BaseModel):
    """The base of every section of the cluster config: unknown keys are errors, values frozen. The
    docstring under each field is its meaning in docs/config.md (scripts/config_reference.py), and a test
    fails when a field has none."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class SecurityConfig(Strict):
    """``internal_secret`` (or a file holding it): prefill and decode servers
    refuse every call but /health and /metrics without it (Bearer), the router
    and the prefill->decode handshake send it, and the router's admin
    endpoints require it. Required when an internal server binds to an
    interface other than loopback."""

    internal_secret: SecretStr | None = Field(default=None, min_length=16)
    """The secret internal calls carry (16+ characters); null: none, or the one in `internal_secret_file`."""
    internal_secret_file: str | None = None
    """A file holding the internal secret, instead of `internal_secret` (on Kubernetes, a mounted Secret)."""
    max_unfilled_blocks_per_caller: int | None = Field(default=None, ge=1)
    """KV blocks one caller (address) may hold reserved and not yet filled on a decode server, beyond which a
    reservation gets 503 `no_room` (server_common/quota.py); null: only the cache bounds it."""
    server_header_timeout_s: float = Field(default=10.0, gt=0)
    """Seconds a client of a prefill or decode server has to send a request's headers before it is closed."""
    server_body_timeout_s: float = Field(default=30.0, gt=0)
    """Seconds a client of a prefill or decode server has to send a request's body after its headers."""
    server_max_connections_per_client: int = Field(default=2048, ge=1)
    """Open connections a prefill or decode server takes from one address; one more gets 503
    `too_many_connections` (above the router's pool, `router.worker_connections`)."""
    server_max_connections: int = Field(default=4096, ge=2)
    """Open connections a prefill or decode server keeps in all (also kept 256 under its file-descriptor
    limit)."""
    server_reserved_connections: int = Field(default=64, ge=0)
    """Of `server_max_connections`, the last ones only for loopback and the hosts of the cluster's router and
    servers, so that strangers never lock those out."""

    @model_validator(mode="after")
    def _one_source(self) -> SecurityConfig:
        if self.internal_secret is not None and self.internal_secret_file is not None:
            raise ValueError("set security.internal_secret or security.internal_secret_file, not both")
        if self.server_reserved_connections >= self.server_max_connections:
            raise ValueError("security.server_reserved_connections must be below security.server_max_connections")
        return self

    @property
    def configured(self) -> bool:
        return self.internal_secret is not None or self.internal_secret_file is not None

    def secret(self) -> str | None:
        """The configured secret; else the one ``pdserve launch`` generated for this cluster; else None."""
        if self.internal_secret is not None:
            return self.internal_secret.get_secret_value()
        if self.internal_secret_file is None:
            generated = os.environ.get(GENERATED_SECRET_ENV)
            return _read_secret("the generated secret file", generated) if generated else None
        return _read_secret("security.internal_secret_file", self.internal_secret_file)


def _read_secret(what: str, file: str) -> str:
    path = Path(file).expanduser()
    try:
        value = path.read_text().strip()
    except OSError as exc:
        raise ConfigError(f"{what} {str(path)!r}: cannot read it: {exc.strerror}") from None
    if len(value) < 16:
        raise ConfigError(f"{what} {str(path)!r}: the secret must be at least 16 characters")
    return value
