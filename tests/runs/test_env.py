"""Environment helpers fail loudly on bad values; the secret key is generated once and kept."""
import pytest

from lightning_web import env


def test_booleans(monkeypatch):
    monkeypatch.setenv("FLAG", "yes")
    assert env.env_bool("FLAG", False) is True
    monkeypatch.setenv("FLAG", "0")
    assert env.env_bool("FLAG", True) is False
    monkeypatch.setenv("FLAG", "maybe")
    with pytest.raises(env.EnvError, match="FLAG='maybe' is not a boolean"):
        env.env_bool("FLAG", False)
    monkeypatch.delenv("FLAG")
    assert env.env_bool("FLAG", True) is True


def test_integers(monkeypatch):
    monkeypatch.setenv("N", "12")
    assert env.env_int("N", 1) == 12
    monkeypatch.setenv("N", "twelve")
    with pytest.raises(env.EnvError, match="not an integer"):
        env.env_int("N", 1)
    monkeypatch.setenv("N", "0")
    with pytest.raises(env.EnvError, match="must be at least 5"):
        env.env_int("N", 10, minimum=5)


def test_lists_and_urls(monkeypatch):
    monkeypatch.setenv("HOSTS", "a.example, b.example,")
    assert env.env_list("HOSTS", []) == ["a.example", "b.example"]
    monkeypatch.setenv("HOSTS", " , ")
    with pytest.raises(env.EnvError, match="holds no items"):
        env.env_list("HOSTS", [])
    monkeypatch.setenv("DATABASE_URL", "mysql://x")
    with pytest.raises(env.EnvError, match="must start with one of postgres://"):
        env.env_url("DATABASE_URL", ("postgres", "sqlite"))
    monkeypatch.setenv("DATABASE_URL", "postgres://u@h/db")
    assert env.env_url("DATABASE_URL", ("postgres",)) == "postgres://u@h/db"


def test_secret_key_is_generated_once(tmp_path, monkeypatch):
    monkeypatch.delenv("SECRET_KEY", raising=False)
    first = env.secret_key("SECRET_KEY", tmp_path)
    assert len(first) >= 50 and env.secret_key("SECRET_KEY", tmp_path) == first
    assert oct((tmp_path / "secret_key").stat().st_mode & 0o777) == "0o600"
    monkeypatch.setenv("SECRET_KEY", "short")
    with pytest.raises(env.EnvError, match="at least 32"):
        env.secret_key("SECRET_KEY", tmp_path)


def test_data_dir_must_be_creatable(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    monkeypatch.setenv("LIGHTNING_DATA_DIR", str(blocker / "sub"))
    with pytest.raises(env.EnvError, match="cannot be created"):
        env.data_dir("LIGHTNING_DATA_DIR", tmp_path)
