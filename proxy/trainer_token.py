"""The trainer token: the one given, or one generated on first start and kept in a file only its owner can read.

The trainer API answers agents' calls and records rewards, so it is never open by default: a host-run agent with a
shell must not be able to answer its own calls or reward itself. With no token given, the server takes the one in
the token file (`~/.config/trajproxy/trainer-token`, or `TRAJPROXY_TRAINER_TOKEN_FILE`), writing a new one there
on first start; `TrainerClient` and `trajproxy run` read it from `TRAJPROXY_TRAINER_TOKEN` or the same file.
`--no-trainer-token` opts out, for a throwaway session on loopback.
"""

from __future__ import annotations

import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from pydantic import SecretStr

from proxy.settings import Settings

TOKEN_ENV = "TRAJPROXY_TRAINER_TOKEN"
FILE_ENV = "TRAJPROXY_TRAINER_TOKEN_FILE"


class TokenFileError(RuntimeError):
    """The token file cannot be used: unreadable, empty, or readable by others than its owner."""


@dataclass(frozen=True, slots=True)
class KeptToken:
    token: str
    path: Path
    made: bool  # written by this start (the first)


def token_file(given: str | None = None) -> Path:
    """Where the generated token is kept: `given`, else TRAJPROXY_TRAINER_TOKEN_FILE, else the user's config."""
    if chosen := given or os.environ.get(FILE_ENV):
        return Path(chosen).expanduser()
    config_home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config_home) / "trajproxy" / "trainer-token"


def kept_token(path: Path) -> KeptToken:
    """The token in `path`, which is made (owner-only, in an owner-only folder) if it does not exist yet."""
    try:
        return KeptToken(_read(path), path, made=False)
    except FileNotFoundError:
        pass
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another server started at the same moment and wrote it first
        return KeptToken(_read(path), path, made=False)
    except OSError as e:
        raise TokenFileError(f"cannot write the trainer token file {path}: {e.strerror}") from e
    with os.fdopen(descriptor, "w") as file:
        file.write(token + "\n")
    return KeptToken(token, path, made=True)


def find_token() -> str | None:
    """The token a client should send: TRAJPROXY_TRAINER_TOKEN, else the token file's, else None."""
    if given := os.environ.get(TOKEN_ENV, "").strip():
        return given
    try:
        return _read(token_file())
    except (FileNotFoundError, TokenFileError):
        return None


def settle(settings: Settings) -> tuple[Settings, KeptToken | None]:
    """The settings with the token the server will require (the token file's when none is given, unless opted
    out), and the kept token when it came from the file."""
    if settings.trainer_token is not None or settings.no_trainer_token:
        return settings, None
    kept = kept_token(token_file(settings.trainer_token_file))
    return settings.model_copy(update={"trainer_token": SecretStr(kept.token)}), kept


def _read(path: Path) -> str:
    try:
        info = path.stat()
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or info.st_uid != os.getuid():
            raise TokenFileError(
                f"the trainer token file {path} must belong to you and be readable by you alone: chmod 600 {path}"
            )
        token = path.read_text().strip()
    except FileNotFoundError:
        raise
    except OSError as e:
        raise TokenFileError(f"cannot read the trainer token file {path}: {e.strerror}") from e
    if not token:
        raise TokenFileError(f"the trainer token file {path} is empty: remove it, and a new token is made")
    return token
