"""CurveZMQ key files (``keys init`` / ``keys add``, ``--workers``): made here, read by both ends.

A key is one worker's: the hub's allow-list names each public key by its file name, and that
is the only name the worker may say hello as.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import zmq.auth

from foltr_async.errors import TransportError

__all__ = [
    "ServerKeys",
    "WorkerKeys",
    "add_worker_key",
    "load_server_keys",
    "load_worker_keys",
    "make_keys",
]


@dataclass(frozen=True)
class ServerKeys:
    public: bytes
    secret: bytes
    #: z85 public key -> name of every worker allowed to connect
    allowed: dict[bytes, str]


@dataclass(frozen=True)
class WorkerKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def make_keys(directory: Path, workers: int = 1) -> list[Path]:
    """A server key pair and ``workers`` authorised worker key pairs in ``directory``.

    Layout: ``server.key`` (public, give it to every worker host), ``server.key_secret`` (stays
    on the server host), ``worker-N.key`` / ``worker-N.key_secret`` (copy the secret file and
    ``server.key`` to the worker's host), ``authorized/`` (public keys the server accepts).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if (directory / "server.key_secret").exists():
        raise TransportError(f"keys: {directory} already holds a server key (use 'keys add')")
    (directory / "authorized").mkdir(exist_ok=True)
    made = list(zmq.auth.create_certificates(str(directory), "server"))
    os.chmod(directory / "server.key_secret", 0o600)
    for i in range(workers):
        made += add_worker_key(directory, f"worker-{i}")
    return [Path(p) for p in made]


def add_worker_key(directory: Path, name: str) -> list[Path]:
    """One more worker key pair in ``directory``, its public key added to ``authorized/``."""
    directory = Path(directory)
    if not name or "/" in name or name.startswith(".") or name == "server":
        raise TransportError(f"keys: {name!r} is not a usable worker name")
    if (directory / f"{name}.key").exists():
        raise TransportError(f"keys: {directory / (name + '.key')} exists already")
    (directory / "authorized").mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    allowed = directory / "authorized" / f"{name}.key"
    allowed.write_bytes(Path(public).read_bytes())
    os.chmod(secret, 0o600)
    return [Path(public), Path(secret), allowed]


def _load(path: Path, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, sec = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise TransportError(f"{path}: cannot read the key ({e})") from None
    if public is None or len(public) != 40 or (secret and (sec is None or len(sec) != 40)):
        raise TransportError(f"{path}: not a {'secret' if secret else 'public'} CURVE key file")
    return public, sec


def load_server_keys(directory: Path) -> ServerKeys:
    """``server.key_secret`` and the allow-list ``authorized/*.key`` from a key folder."""
    directory = Path(directory)
    public, secret = _load(directory / "server.key_secret", True)
    allowed = {}
    auth = directory / "authorized"
    for path in sorted(auth.glob("*.key")) if auth.is_dir() else []:
        allowed[_load(path, False)[0]] = path.stem
    if not allowed:
        raise TransportError(f"{auth}: no authorised worker keys (python -m foltr_async keys add)")
    return ServerKeys(public, secret, allowed)


def load_worker_keys(directory: Path, name: str) -> WorkerKeys:
    """A worker's ``NAME.key_secret`` and the server's ``server.key`` from a key folder."""
    directory = Path(directory)
    public, secret = _load(directory / f"{name}.key_secret", True)
    server, _ = _load(directory / "server.key", False)
    return WorkerKeys(public, secret, server)
