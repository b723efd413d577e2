"""Create a CurveZMQ key pair: NAME.key (public, copied to the peers or the allow-list that trust
it) and NAME.key_secret (kept by its owner only).

This module also applies CurveZMQ to the sockets. The dispatcher authenticates peers against a
directory of allowed public keys (pyzmq's ThreadAuthenticator, ZAP): a reader or trainer whose
key is not listed never completes the handshake, so it cannot send or receive a single message.
The peer itself hears nothing, so the dispatcher logs each refused (address, key) once,
rate-limited. Secret keys are written owner-only (0600), public keys readable by all (0644); a
secret key file readable by every user is warned of once, by each command that loads it.
"""

from __future__ import annotations

import argparse
import logging
import os
import threading
import time
from dataclasses import dataclass

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator


log = logging.getLogger("mmdispatch.security")


def create_keypair(directory: str, name: str, *, force: bool = False) -> tuple[str, str]:
    """Write NAME.key (public) and NAME.key_secret into `directory`; returns both paths.

    An existing pair is kept (ValueError) unless `force`: peers may already trust its public key.
    """
    if not name or os.sep in name or name.startswith("."):
        raise ValueError(f"key name {name!r} must be a plain file name")
    existing = [p for p in (os.path.join(directory, f"{name}.key"), os.path.join(directory, f"{name}.key_secret"))
                if os.path.exists(p)]
    if existing and not force:
        raise ValueError(f"{existing[0]} already exists: pass --force to replace the key pair (peers "
                         f"that trust the old public key will be refused), or choose another NAME")
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise ValueError(f"--dir {directory!r} is a file: give the directory to write the key "
                         "files into")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--dir {directory!r} cannot be created ({e.strerror}): give a "
                         "directory this user can write") from None
    # pyzmq writes the files with the process umask: the secret would be readable by others
    # until the chmod below; an owner-only umask closes that window.
    umask = os.umask(0o077)
    try:
        public, secret = zmq.auth.create_certificates(directory, name)
    except OSError as e:
        raise ValueError(f"--dir {directory!r} cannot be written ({e.strerror or e}): give a "
                         "directory this user can write") from None
    finally:
        os.umask(umask)
    os.chmod(secret, 0o600)
    # The public key is copied to peers and read by other users (a container's uid); only the
    # secret stays owner-only.
    os.chmod(public, 0o644)
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

    def apply(self, sock: zmq.Socket, server_public: bytes | None = None) -> None:
        """Make `sock` a CURVE client of the dispatcher, or of the server whose public key (z85)
        is `server_public` (a reader's payload socket, direct payload mode)."""
        public, secret = _load(self.secret_file)
        if secret is None:
            raise ValueError(f"{self.secret_file!r} holds no secret key (pass NAME.key_secret, "
                             "not the public NAME.key)")
        if server_public is None:
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


def _load_key_file(path: str, flag: str, what: str) -> tuple[bytes, bytes | None]:
    """(public, secret or None) keys of the file `flag` names; ValueError, one line naming the
    flag, the file and the fix (`what`: the file the flag wants), when it is no key file."""
    try:
        return zmq.auth.load_certificate(path)
    except OSError as e:
        raise ValueError(f"{flag} {path!r} cannot be read ({e.strerror or e}): give {what} the "
                         "user running this command can read (its owner: chown it, or create "
                         "it as that user with mmdispatch keygen)") from None
    except ValueError:  # pyzmq's "No public key found in ...": not a key file at all
        raise ValueError(f"{flag} {path!r} is no CurveZMQ key file: give {what} mmdispatch "
                         "keygen NAME wrote") from None


def load_secret(path: str, flag: str = "--curve-secret") -> tuple[bytes, bytes]:
    """(public, secret) keys of a NAME.key_secret file; ValueError, one line naming `flag`, the
    file and the fix, when it cannot be read or holds no secret key."""
    public, secret = _load_key_file(path, flag, "a NAME.key_secret file")
    if secret is None:
        raise ValueError(f"{flag} {path!r} holds no secret key: pass NAME.key_secret, not the "
                         "public NAME.key")
    return public, secret


def load_public(path: str, flag: str = "--curve-server-key") -> tuple[bytes, bool]:
    """(the public key, whether the file holds a secret key too) of a key file (the
    dispatcher's NAME.key); ValueError, one line naming `flag`, the file and the fix, when it
    cannot be read or is no key file."""
    public, secret = _load_key_file(path, flag, "the dispatcher's public NAME.key file")
    return public, secret is not None


#: secret key files already said to be readable by every user, in the environment: a command's
#: worker processes (`read --workers N`, spawned) inherit it and do not say it again
_OPEN_SECRETS_SAID = "MMDISPATCH_OPEN_SECRETS_SAID"


def warn_if_readable(path: str | None, flag: str = "--curve-secret") -> None:
    """A secret key file every user of the machine may read: said once per command (from rank
    0 under torchrun), naming the file and the fix; the command goes on."""
    said = os.environ.get(_OPEN_SECRETS_SAID, "").split("\n")
    if not path or path in said or os.environ.get("RANK", "0") != "0":
        return
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return  # a missing or unreadable file is named where it is loaded
    if mode & 0o004:
        os.environ[_OPEN_SECRETS_SAID] = "\n".join([*filter(None, said), path])
        log.warning("mmdispatch event=curve_secret_readable file=%s mode=%s fix=%r", path,
                    oct(mode & 0o777), f"every user of this machine can read the secret key "
                    f"{flag} names: chmod 600 {path}")


#: The fix a failed handshake on the dispatcher's endpoints is logged with.
DISPATCHER_HANDSHAKE_FIX = ("readers and trainers need --curve-secret and --curve-server-key "
                            "(the dispatcher's public key)")
#: ... and on a reader's payload socket (direct payloads), where the peers are trainers, which
#: take this reader's key from the dispatcher: theirs is what is missing or not allowed here.
PAYLOAD_HANDSHAKE_FIX = ("trainers fetching from this reader need CurveZMQ: --curve-secret "
                         "and --curve-server-key (the dispatcher's public key; the dispatcher "
                         "tells them this reader's), and their public NAME.key in this reader's "
                         "--payload-allowed-dir")


def apply_server_curve(sock: zmq.Socket, secret_file: str, *,
                       fix: str = DISPATCHER_HANDSHAKE_FIX) -> bytes:
    """Make a bound socket a CURVE server with the key pair in `secret_file` (the dispatcher's,
    or a reader's for its payload socket), reporting failed handshakes with `fix` (what the
    socket's peers need); returns the public key."""
    public, secret = load_secret(secret_file)
    sock.curve_publickey = public
    sock.curve_secretkey = secret
    sock.curve_server = True
    watch_handshakes(sock, fix=fix)
    return public


#: ZMTP protocol error -> what it means for a dispatcher requiring CurveZMQ
_HANDSHAKE_ERRORS = {
    zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH: "a peer without CurveZMQ (plaintext)",
    zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC: "a peer with the wrong --curve-server-key",
}


def handshake_reason(event: int, value: int) -> str:
    """A failed handshake's monitor event in words."""
    if event == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        # its value is an errno: the peer hung up mid-handshake (EPIPE, ECONNRESET), as a
        # plaintext peer does once it meets CurveZMQ
        return (f"the peer closed the connection during the handshake ({os.strerror(value)}): "
                "a peer without CurveZMQ, or one that gave up")
    return _HANDSHAKE_ERRORS.get(value, f"handshake error {value:#x}")


def watch_handshakes(sock: zmq.Socket, *, every_s: float = 60.0,
                     fix: str = DISPATCHER_HANDSHAKE_FIX) -> threading.Thread:
    """Log handshakes that fail before ZAP sees a key (plaintext peers, wrong server keys).

    ZeroMQ reports them only on the socket's monitor, without the peer's address: one line per
    (endpoint, reason) every `every_s` at most, with how many failed since the last line. The
    thread ends when the socket closes.
    """
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                                      | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_MONITOR_STOPPED)

    def report() -> None:
        from zmq.utils.monitor import recv_monitor_message

        last: dict[tuple[str, str], float] = {}
        count: dict[tuple[str, str], int] = {}
        try:
            while True:
                if not monitor.poll(500):
                    continue
                evt = recv_monitor_message(monitor)
                if evt["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return
                endpoint = evt["endpoint"].decode("utf-8", "replace") if isinstance(evt["endpoint"], bytes) else evt["endpoint"]
                reason = handshake_reason(evt["event"], evt["value"])
                key = (endpoint, reason)
                count[key] = count.get(key, 0) + 1
                now = time.monotonic()
                if key not in last or now - last[key] >= every_s:
                    log.warning("mmdispatch event=curve_handshake_failed endpoint=%s reason=%r "
                                "failures=%d fix=%r", endpoint, reason, count[key], fix)
                    last[key], count[key] = now, 0
        except zmq.ZMQError:  # the context is terminating
            return
        finally:
            monitor.close(linger=0)

    thread = threading.Thread(target=report, name="curve-handshakes", daemon=True)
    thread.start()
    return thread


class RefusalLog:
    """Logs each refused (address, key) once, and at most `burst` lines per `window_s` overall.

    A refused peer retries every few hundred milliseconds; the log must name it without
    flooding. Lines suppressed by the rate limit are counted in the next line that is written.
    """

    def __init__(self, *, burst: int = 10, window_s: float = 60.0, max_remembered: int = 4096,
                 clock=time.monotonic, allow_list: str = "the dispatcher's --curve-allowed-dir"
                 ) -> None:
        self.burst, self.window_s, self.max_remembered, self.clock = burst, window_s, max_remembered, clock
        self.allow_list = allow_list  # where the refusing socket's allowed keys come from
        self.seen: set[tuple[str, str]] = set()
        self.window_start = clock()
        self.written = 0
        self.suppressed = 0

    def refused(self, address: str, key: str, reason: str) -> bool:
        """Note one refusal; returns whether a line was logged."""
        if (address, key) in self.seen:
            return False
        if len(self.seen) >= self.max_remembered:
            self.seen.clear()
        self.seen.add((address, key))
        now = self.clock()
        if now - self.window_start >= self.window_s:
            self.window_start, self.written = now, 0
        if self.written >= self.burst:
            self.suppressed += 1
            return False
        self.written += 1
        more = f" suppressed_since_last={self.suppressed}" if self.suppressed else ""
        self.suppressed = 0
        log.warning("mmdispatch event=curve_peer_refused address=%s key=%s reason=%r%s fix=%r",
                    address, key, reason, more, f"copy the peer's NAME.key into {self.allow_list}, "
                                                "or give the peer a key pair that is there")
        return True


class _LoggingAuthenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, reporting the peers it refuses."""

    def __init__(self, context: zmq.Context, allow_list: str) -> None:
        super().__init__(context)
        self.refusals = RefusalLog(allow_list=allow_list)
        self._address = ""

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        self._address = msg[3].decode("utf-8", "replace") if len(msg) > 3 else "?"
        await super().handle_zap_message(msg)

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        allowed, reason = await super()._authenticate_curve(domain, client_key)
        if not allowed:
            key = zmq.utils.z85.encode(client_key).decode("ascii") if len(client_key) == 32 else client_key.hex()
            self.refusals.refused(self._address, key, reason.decode("utf-8", "replace"))
        return allowed, reason


def check_allowed_keys(flag: str, directory: str) -> None:
    """ValueError, one line naming `flag` and the file, when a NAME.key file in the allow-list
    `directory` is not a public key: pyzmq's authenticator would log an error and configure
    no key of the directory at all, so every allowed peer would be refused."""
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if not name.endswith(".key") or not os.path.isfile(path):
            continue
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError, UnicodeError) as e:
            ok, why = False, getattr(e, "strerror", None) or e
        else:
            if secret is not None:  # a secret key copied where public ones are handed around
                raise ValueError(
                    f"{flag} {directory!r}: {path!r} holds a secret key, which must stay with its "
                    "owner: put the public NAME.key (written beside it by mmdispatch keygen) "
                    "there instead, and make a new key pair if the directory was shared")
            try:
                ok = len(zmq.utils.z85.decode(public)) == 32
            except (ValueError, KeyError, IndexError):  # z85.decode's errors for non-Z85 text
                ok = False
            why = "a public key is 40 Z85 characters"
        if not ok:
            raise ValueError(f"{flag} {directory!r}: {path!r} is no CurveZMQ public key ({why}), and "
                             f"one bad NAME.key makes the whole directory refused: remove it, or "
                             f"replace it with a NAME.key written by mmdispatch keygen NAME")


def start_authenticator(context: zmq.Context, allowed_keys_dir: str, *,
                        allow_list: str = "the dispatcher's --curve-allowed-dir",
                        peers: str = "readers' and trainers'") -> ThreadAuthenticator:
    """ZAP handler that admits only clients whose public key is in `allowed_keys_dir` (named
    `allow_list` in the fixes it logs; `peers`: whose NAME.key files belong there)."""
    if not os.path.isdir(allowed_keys_dir):
        raise ValueError(f"allowed keys directory {allowed_keys_dir!r} does not exist")
    check_allowed_keys(allow_list, allowed_keys_dir)
    if not any(name.endswith(".key") for name in os.listdir(allowed_keys_dir)):
        log.warning("mmdispatch event=curve_no_allowed_keys dir=%s fix=%r", allowed_keys_dir,
                    f"copy the {peers} NAME.key files there: every peer will be refused")
    auth = _LoggingAuthenticator(context, allow_list)
    auth.start()
    auth.configure_curve(domain="*", location=allowed_keys_dir)
    return auth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", help="key pair name: writes NAME.key (public) and NAME.key_secret")
    parser.add_argument("--dir", default=".", help="directory to write the key files into")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing key pair of that name (peers trusting the old key are refused)")


def run(args: argparse.Namespace) -> int:
    public, secret = create_keypair(args.dir, args.name, force=args.force)
    print(f"public key: {public}")
    print(f"secret key: {secret} (keep it private; copy only the public key to the allow-list)")
    return 0
