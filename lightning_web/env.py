"""Small readers of the environment that fail loudly on bad values; settings are their only caller."""
from __future__ import annotations

import os
import secrets
from pathlib import Path


class EnvError(RuntimeError):
    """An environment variable holds a value we cannot use."""


def env_str(name: str, default: str | None = None) -> str | None:
    value = os.environ.get(name)
    if value is None or value.strip() == "":
        return default
    return value.strip()


def env_bool(name: str, default: bool) -> bool:
    value = env_str(name)
    if value is None:
        return default
    lowered = value.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise EnvError(f"{name}={value!r} is not a boolean; use one of 1/0, true/false, yes/no, on/off")


def env_int(name: str, default: int, minimum: int | None = None) -> int:
    value = env_str(name)
    if value is None:
        return default
    try:
        number = int(value)
    except ValueError:
        raise EnvError(f"{name}={value!r} is not an integer") from None
    if minimum is not None and number < minimum:
        raise EnvError(f"{name}={number} must be at least {minimum}")
    return number


def env_list(name: str, default: list[str]) -> list[str]:
    value = env_str(name)
    if value is None:
        return list(default)
    items = [item.strip() for item in value.split(",") if item.strip()]
    if not items:
        raise EnvError(f"{name}={value!r} holds no items; give a comma-separated list")
    return items


def env_url(name: str, schemes: tuple[str, ...]) -> str | None:
    value = env_str(name)
    if value is None:
        return None
    scheme = value.split("://", 1)[0] if "://" in value else ""
    if scheme not in schemes:
        raise EnvError(f"{name}={value!r} must start with one of {', '.join(s + '://' for s in schemes)}")
    return value


def data_dir(name: str, default: Path) -> Path:
    path = Path(env_str(name) or default).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise EnvError(f"{name}={str(path)!r} cannot be created: {exc}") from exc
    return path


def secret_key(name: str, keep_in: Path) -> str:
    """The SECRET_KEY from the environment, else one generated once and kept in the data dir."""
    value = env_str(name)
    if value is not None:
        if len(value) < 32:
            raise EnvError(f"{name} is {len(value)} characters long; use at least 32 random characters")
        return value
    key_file = keep_in / "secret_key"
    if not key_file.exists():
        # Write aside then link into place: concurrent first starts agree on one key.
        scratch = keep_in / f".secret_key.{os.getpid()}"
        scratch.write_text(secrets.token_urlsafe(50))
        scratch.chmod(0o600)
        try:
            os.link(scratch, key_file)
        except FileExistsError:
            pass
        finally:
            scratch.unlink()
    return key_file.read_text().strip()
