"""Create CurveZMQ key pairs, and apply CurveZMQ to dispatcher, reader and trainer sockets.

The dispatcher authenticates peers against a directory of allowed public keys (pyzmq's
ThreadAuthenticator, ZAP): a reader or trainer whose key is not listed never completes the
handshake, so it cannot send or receive a single message. Keys are written owner-only (0600).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator


def create_keypair(directory: str, name: str) -> tuple[str, str]:
    """Write NAME.key (public) and NAME.key_secret into `directory`; returns both paths."""
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"key name {name!r} must be a plain file name")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    # pyzmq writes the files with the process umask: the secret would be readable by others
    # until the chmod below; an owner-only umask closes that window.
    umask = os.umask(0o077)
    try:
        public, secret = zmq.auth.create_certificates(directory, name)
    finally:
        os.umask(umask)
    for path in (public, secret):
        os.chmod(path, 0o600)
    return public, secret


@dataclass(kw_only=True, slots=True)
class PeerCurve:
    """A reader's or trainer's CurveZMQ settings: its own key pair and the server's public key."""

    secret_file: str  # the peer's NAME.key_secret
    server_public_file: str  # the dispatcher's NAME.key

    @classmethod
    def from_files(cls, secret_file: str | None, server_public_file: str | None) -> PeerCurve | None:
        """Settings from a peer's two optional key files: None for neither, ValueError for one."""
        if not secret_file and not server_public_file:
            return None
        if not secret_file or not server_public_file:
            raise ValueError("CurveZMQ needs both this peer's secret key file and the dispatcher's "
                             f"public key file; got secret_file={secret_file!r}, "
                             f"server_public_file={server_public_file!r}")
        return cls(secret_file=secret_file, server_public_file=server_public_file)

    def apply(self, sock: zmq.Socket) -> None:
        public, secret = _load(self.secret_file)
        if secret is None:
            raise ValueError(f"{self.secret_file!r} holds no secret key (pass NAME.key_secret, "
                             "not the public NAME.key)")
        server_public, _ = _load(self.server_public_file)
        sock.curve_publickey = public
        sock.curve_secretkey = secret
        sock.curve_serverkey = server_public


def _load(path: str) -> tuple[bytes, bytes | None]:
    """(public, secret) keys of a key file; ValueError naming the file if it cannot be read."""
    try:
        return zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read CurveZMQ key file {path!r}: {e}") from None


def apply_server_curve(sock: zmq.Socket, secret_file: str) -> None:
    """Make a bound socket a CURVE server with the dispatcher's key pair."""
    public, secret = zmq.auth.load_certificate(secret_file)
    if secret is None:
        raise ValueError(f"{secret_file!r} holds no secret key")
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True


def start_authenticator(context: zmq.Context, allowed_keys_dir: str) -> ThreadAuthenticator:
    """ZAP handler that admits only clients whose public key is in `allowed_keys_dir`."""
    if not os.path.isdir(allowed_keys_dir):
        raise ValueError(f"allowed keys directory {allowed_keys_dir!r} does not exist")
    auth = ThreadAuthenticator(context)
    auth.start()
    auth.configure_curve(domain="*", location=allowed_keys_dir)
    return auth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="key pair name: writes NAME.key (public) and NAME.key_secret")
    parser.add_argument("--dir", default=".", help="directory to write the key files into")


def run(args: argparse.Namespace) -> int:
    public, secret = create_keypair(args.dir, args.name)
    print(f"public key: {public}")
    print(f"secret key: {secret} (keep it private; copy only the public key to the allow-list)")
    return 0
