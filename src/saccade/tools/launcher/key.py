"""The API key `saccade launch` makes for its own servers when the user gave none: without one,
any local user or process could sample from them, push weights (or `{"restore_base": true}`,
and the server would sample the base model under the run's version label) or pause them.

The key goes to the servers and the trainer in VLLM_API_KEY (the launcher's own environment,
which its children inherit: it never appears in a command line or a log line), and to a file
only the user can read, so that the user can reach the servers by hand; the log says where the
file is, never the key. A layout on several machines needs the same key on every node: there
the user sets VLLM_API_KEY (the launcher refuses to start without it)."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

KEY_ENV = "VLLM_API_KEY"
KEY_FILE = "api-key"  # under <run_dir>/launch/


def write_secret(path: Path, secret: str) -> None:
    """`secret` in `path`, readable and writable by its owner only (0600), also when the file
    was there before with other permissions."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # O_CREAT's mode applies only to a new file
        os.write(fd, (secret + "\n").encode())
    finally:
        os.close(fd)


def ensure_launch_key(environ, launch_dir: Path, nodes: int = 1) -> str:
    """VLLM_API_KEY in `environ`, made (and stored in launch_dir/api-key, 0600) when unset on a
    one-node layout. The line for the log: where the key is, never the key. A layout of several
    nodes all on loopback (several launchers on one machine) gets no key made: each launcher
    would make its own, and the trainer could not use the other nodes' servers."""
    if environ.get(KEY_ENV):
        return f"the servers take the API key in {KEY_ENV} from this environment"
    if nodes > 1:
        return (f"warning: no API key ({KEY_ENV} unset), so every local user and process may use the servers; "
                f"set {KEY_ENV} to one secret on every node")
    key = secrets.token_urlsafe(32)
    path = launch_dir / KEY_FILE
    write_secret(path, key)
    environ[KEY_ENV] = key
    return (f"made an API key for this launch's servers; the trainer gets it in {KEY_ENV}, and it is stored "
            f"in {path} (mode 0600) for requests of your own")
