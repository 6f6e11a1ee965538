"""The API key `saccade launch` makes for its servers (saccade.tools.launcher.key)."""

from __future__ import annotations

from saccade.tools.launcher.key import KEY_ENV, ensure_launch_key, write_secret


def test_a_launch_without_a_key_makes_one_stored_for_the_owner_only_and_never_logged(tmp_path):
    environ: dict[str, str] = {}
    line = ensure_launch_key(environ, tmp_path / "launch")
    key = environ[KEY_ENV]
    stored = tmp_path / "launch" / "api-key"
    assert stored.read_text().strip() == key and len(key) >= 32
    assert stored.stat().st_mode & 0o777 == 0o600
    assert key not in line and str(stored) in line
    other: dict[str, str] = {}
    ensure_launch_key(other, tmp_path / "again")
    assert other[KEY_ENV] != key  # a fresh one each launch


def test_the_users_key_is_kept_and_written_nowhere(tmp_path):
    environ = {KEY_ENV: "mine"}
    line = ensure_launch_key(environ, tmp_path / "launch")
    assert environ[KEY_ENV] == "mine" and KEY_ENV in line and "mine" not in line
    assert not (tmp_path / "launch").exists()


def test_a_secret_file_that_existed_with_wider_permissions_is_narrowed(tmp_path):
    path = tmp_path / "api-key"
    path.write_text("old")
    path.chmod(0o644)
    write_secret(path, "new")
    assert path.read_text() == "new\n" and path.stat().st_mode & 0o777 == 0o600


def test_several_launchers_on_one_machine_make_no_key_of_their_own(tmp_path):
    environ: dict[str, str] = {}
    line = ensure_launch_key(environ, tmp_path / "launch", nodes=2)
    assert KEY_ENV not in environ and "warning" in line and not (tmp_path / "launch").exists()
