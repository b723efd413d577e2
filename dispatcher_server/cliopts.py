"""Options every command shares (`--config`, `--log-level`, `--log-format`, `--debug`) and the logging
they select.

Kept at the bottom of the import graph (nothing of ours, no torch) so the `mmdispatch` commands
and `python -m trainer_client.train` take the same flags and write the same log lines. JSON
lines carry the `key=value` fields of the project's `mmdispatch event=...` messages as fields.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

LOG_FORMATS = ("text", "json")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
#: --help section of the logging options
LOGGING_GROUP = "logging and errors"
#: Most MiB `--malloc-keep-mb` (serve, read, train) takes: glibc's mallopt takes its thresholds
#: as a C int of bytes, and the trim threshold is twice this one, so 1024 wraps around.
MAX_MALLOC_KEEP_MB = 1023
_FIELD = re.compile(r"(\w+)=('[^']*'|\"[^\"]*\"|\S+)")
#: Query parameters whose values are credentials: presigned S3 (SigV4 and V2), GCS, Azure SAS,
#: CloudFront, and the generic token names. Their names stay in the line, their values go.
SECRET_QUERY_PARAMS = ("X-Amz-Credential", "X-Amz-Signature", "X-Amz-Security-Token",
                       "X-Goog-Credential", "X-Goog-Signature", "AWSAccessKeyId", "Signature",
                       "sig", "token", "access_token", "refresh_token", "id_token", "api_key",
                       "apikey", "password", "secret", "client_secret", "Policy", "Key-Pair-Id")
REDACTED = "***"
# scheme://user:PASSWORD@host: the password runs to the authority's last "@" (an unescaped "@"
# in it is what a hand-written URL often has), never past a "/", "?", "#" or a space.
_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://[^/?#@\s:'\"]*:)[^/?#\s'\"]*@")
_SECRET_PARAM = re.compile(r"([?&;](?:" + "|".join(map(re.escape, SECRET_QUERY_PARAMS))
                           + r")=)[^&#\s'\"<>]+", re.IGNORECASE)


def redact(text: str) -> str:
    """`text` with URL passwords (`scheme://user:***@host`) and the values of credential query
    parameters (`?X-Amz-Signature=***`) hidden: shard URLs reach log lines and error messages,
    and a log is read by more people than the bucket's key. Costs one substring test when no
    URL is in the text."""
    if "://" not in text:
        return text
    return _SECRET_PARAM.sub(r"\1" + REDACTED, _USERINFO.sub(r"\1" + REDACTED + "@", text))


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="TOML settings file: tables [serve], [read], [train], [counting] with keys "
                             "named like the options (underscores); flags win; see docs/configuration.md")


def add_logging_arguments(parser: argparse.ArgumentParser) -> None:
    """`--log-level`, `--log-format` and `--debug`, each unless the parser has it already."""
    flags = {s for a in parser._actions for s in a.option_strings}
    if {"--log-level", "--log-format", "--debug"} <= flags:
        return
    # A parser that grouped its own --log-level there gets the other two beside it.
    group = next((g for g in parser._action_groups if g.title == LOGGING_GROUP), None)
    if group is None:
        group = parser.add_argument_group(LOGGING_GROUP)
    if "--log-level" not in flags:
        group.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO",
                           help="logging level")
    if "--log-format" not in flags:
        group.add_argument("--log-format", choices=LOG_FORMATS, default="text",
                           help="text lines, or one JSON object per line (for log collectors)")
    if "--debug" not in flags:
        group.add_argument("--debug", action="store_true",
                           help="show Python tracebacks instead of one-line error messages")


def _utc(seconds: float) -> str:
    """A JSON log line's time: UTC, to the millisecond."""
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds))
            + f".{int(seconds * 1000) % 1000:03d}Z")


#: Characters of one logged value past which it is cut (a sample key can be any length).
MAX_FIELD_CHARS = 1000


def event_line(kind: str, /, **fields) -> str:
    """`mmdispatch event=KIND k=v ...`: the line `--log-format json` turns into fields. Values
    with spaces or anything unprintable (a newline, a terminal escape: keys and names come from
    the data) are quoted with escapes, so one value never forges a line; values past
    MAX_FIELD_CHARS are cut, saying how much."""
    parts = [f"event={kind}"]
    for k, v in fields.items():
        text = str(v)
        if len(text) > MAX_FIELD_CHARS:
            text = f"{text[:MAX_FIELD_CHARS]}...(+{len(text) - MAX_FIELD_CHARS} chars)"
        plain = text and text.isprintable() and " " not in text
        parts.append(f"{k}={text}" if plain else f"{k}={text!r}")
    return "mmdispatch " + " ".join(parts)


class TextFormatter(logging.Formatter):
    """`time LEVEL message` lines, with credentials in URLs redacted (`redact`)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


class JsonFormatter(logging.Formatter):
    """One JSON object per line; message, fields and exception text with credentials in URLs
    redacted (`redact`)."""

    def format(self, record: logging.LogRecord) -> str:
        message = redact(record.getMessage())
        out = {"time": _utc(record.created), "level": record.levelname, "logger": record.name,
               "message": message}
        if message.startswith("mmdispatch "):
            for key, value in _FIELD.findall(message):
                out.setdefault(key, value.strip("'\"") if key in _NAME_FIELDS else _typed(value))
        if record.exc_info:
            out["exception"] = redact(self.formatException(record.exc_info))
        if record.stack_info:
            out["stack"] = redact(self.formatStack(record.stack_info))
        return json.dumps(out)


_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(\.\d+)?")
#: Fields that name things, strings even when a name is all digits (a sample key "123"): a
#: collector types a field by its first value and refuses the others.
_NAME_FIELDS = frozenset({"key", "keys", "name", "reader", "readers", "source", "shard", "member",
                          "url", "endpoint", "dispatcher", "tokenizer", "journal"})


def _typed(value: str) -> str | int | float:
    """A field's value as JSON types it: a plain number (`step=17`, `plan_ms=0.42`) is a
    number, so a collector can compare it; anything else, or anything quoted, a string."""
    if value[:1] in ("'", '"'):
        return value.strip("'\"")
    match = _NUMBER.fullmatch(value)
    if match is None:
        return value
    return float(value) if match.group(1) else int(value)


#: Loggers of libraries the services use, quiet below WARNING unless --log-level DEBUG.
LIBRARY_LOGGERS = ("botocore", "aiobotocore", "s3fs", "gcsfs", "fsspec", "urllib3", "google")


def setup_logging(log_format: str = "text", level: str = "INFO") -> None:
    """Send log records to stderr in `log_format`; replaces the handler an earlier call set up."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r} must be one of {LOG_FORMATS}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    handler.mmdispatch = True
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "mmdispatch", False):
            root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # A library's warnings.warn (Pillow's decompression-bomb warning, torch's UserWarnings)
    # went to stderr as raw lines, not one JSON object: a WARNING record of `py.warnings` now.
    logging.captureWarnings(True)
    # Object-storage libraries log routine events at INFO ("Found credentials in environment
    # variables."): ours say what matters, theirs show from WARNING on, and all of it at DEBUG.
    for name in LIBRARY_LOGGERS:
        logging.getLogger(name).setLevel(logging.NOTSET if root.level <= logging.DEBUG
                                         else max(root.level, logging.WARNING))


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose mistakes end in one line naming them, not its usage block, and
    whose integer options fit in 64 bits: every count travels as one (msgpack, the journal,
    numpy), where a larger one failed far from its flag with an OverflowError."""

    def error(self, message: str):
        line = f"{self.prog}: error: {message} (--help lists the options)"
        self.exit(2, (json_line(redact(line), "ERROR") if self._json_wanted() else line) + "\n")

    def refuse(self, argv: list[str], message: str):
        """`error` for a mistake found before `parse_args` saw `argv` (a settings file's): in
        JSON where `argv` asks for JSON logs, as argparse's own mistakes are."""
        self._argv = list(argv)
        self.error(message)

    def _json_wanted(self) -> bool:
        """Whether the command line (or the settings file's default) asks for JSON logs: a
        mistake argparse finds comes before logging is set up."""
        argv = getattr(self, "_argv", None) or []
        given = [a.split("=", 1)[1] for a in argv if a.startswith("--log-format=")]
        given += [b for a, b in zip(argv, argv[1:]) if a == "--log-format"]
        if given:
            return given[-1] == "json"
        try:
            return self.get_default("log_format") == "json"
        except AttributeError:
            return False

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)
        ns, extra = super().parse_known_args(args, namespace)
        for action in self._actions:
            value = getattr(ns, action.dest, None)
            if action.type is int and isinstance(value, int) and not -2**63 <= value < 2**63:
                bound = "at most 2**63 - 1" if value > 0 else "at least -2**63"
                self.error(f"argument {'/'.join(action.option_strings) or action.dest}: must be "
                           f"{bound} (64 bits), got {value}")
        return ns, extra


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: X)` only where it tells something: not for unset options or switches."""

    def _get_help_string(self, action: argparse.Action) -> str:
        help_ = action.help or ""
        if "(default" in help_ or "%(default)" in help_:
            return help_
        if isinstance(action, argparse.BooleanOptionalAction) and isinstance(action.default, bool):
            # an on/off option's default is worth saying: either flag may be the one that acts
            return help_ + f" (default: {str(action.default).lower()})"
        if action.default in (None, argparse.SUPPRESS) or action.nargs == 0:
            return help_
        return help_ + " (default: %(default)s)"


#: Exceptions whose message is written for the user (the rest are bugs and keep their traceback).
_USER_ERROR_NAMES = {"TooManyErrors", "FatalReaderError", "DispatcherError", "FetchError",
                     "PeerRankStopped"}


#: Optional dependencies by module, with the extra that installs each (pyproject.toml): a
#: command that needs one on an install without it says which extra to add.
OPTIONAL_MODULES = {"torch": "trainer", "matplotlib": "report", "av": "video", "s3fs": "cloud",
                    "gcsfs": "cloud", "aiohttp": "cloud"}


def _missing_extra(error: BaseException) -> str | None:
    """The extra that installs the optional module `error` (a ModuleNotFoundError) lacks."""
    if not isinstance(error, ModuleNotFoundError) or not error.name:
        return None
    return OPTIONAL_MODULES.get(error.name.partition(".")[0])


def is_user_error(error: BaseException) -> bool:
    import zmq

    return (isinstance(error, (ValueError, OSError, zmq.ZMQError))
            or _missing_extra(error) is not None
            or any(cls.__name__ in _USER_ERROR_NAMES for cls in type(error).__mro__))


def user_message(error: BaseException) -> str:
    import errno

    import zmq

    extra = _missing_extra(error)
    if extra is not None:
        module = error.name.partition(".")[0]
        wheel = " (pick its wheel index as in the README)" if module == "torch" else ""
        return (f"this needs {module}, which is not installed: pip install "
                f"'mmdispatch[{extra}]'{wheel}")
    text = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, zmq.ZMQError) and error.errno == errno.EADDRINUSE:
        return f"{text}: another process holds that port; choose another one (port 0 lets the OS pick)"
    if isinstance(error, zmq.ZMQError) and error.errno == errno.EINVAL and "addr=" in text:
        return f"{text}: an endpoint looks like tcp://HOST:PORT (e.g. tcp://10.0.0.5:5555)"
    if isinstance(error, zmq.ZMQError) and error.errno == errno.EADDRNOTAVAIL:
        return (f"{text}: that host is no address of this machine; bind to one of its own "
                "(tcp://0.0.0.0:PORT for every interface)")
    if isinstance(error, UnicodeDecodeError):
        return f"{text} (the file is binary, not text)"
    return text


def as_flags(message: str, flags: dict[str, str]) -> str:
    """A config class's message with the field names `flags` maps (`min_pixels=0`,
    `(max_retained_steps + 1)`) written as the flags that set them (`--min-pixels 0`): the
    classes name their fields, right from Python, not on a command line."""
    if not flags:
        return message
    names = sorted(flags, key=len, reverse=True)
    return re.sub(r"\b(" + "|".join(map(re.escape, names)) + r")\b(=?)",
                  lambda m: f"{flags[m[1]]}{' ' if m[2] else ''}", message)


@contextmanager
def named_by_flags(flags: dict[str, str]) -> Iterator[None]:
    """A config class's ValueError raised inside, raised again with its fields written as the
    flags `flags` maps them to (`as_flags`)."""
    try:
        yield
    except ValueError as e:
        raise ValueError(as_flags(str(e), flags)) from None


def finite_float(text: str) -> float:
    """argparse type of every float option: a number, not nan or inf (rates, seconds and factors
    become integers and deadlines, where either fails far from the flag that set it)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


#: Transports a ZeroMQ endpoint may name (tcp is the one across machines).
ZMQ_TRANSPORTS = ("tcp", "ipc", "inproc")


def check_malloc_keep_mb(name: str, value: int) -> int:
    """`value` if `keep_freed_memory` can take it, else ValueError naming `name` (a flag or a
    config field) and the range: past it glibc would wrap the threshold around."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_MALLOC_KEEP_MB:
        raise ValueError(f"{name} must be from 0 to {MAX_MALLOC_KEEP_MB} (glibc takes the threshold "
                         f"as a C int of bytes; 0 = off), got {value!r}")
    return value


def check_curve_pair(secret: str | None, server_key: str | None) -> None:
    """ValueError naming the one of a client's two CurveZMQ flags that is missing, or the one
    whose file is missing or holds no key it needs (the secret: no secret key)."""
    if bool(secret) != bool(server_key):
        given, missing, what = (("--curve-secret", "--curve-server-key", "the dispatcher's public "
                                 "NAME.key file") if secret else
                                ("--curve-server-key", "--curve-secret", "this peer's "
                                 "NAME.key_secret file"))
        raise ValueError(f"{given} is given without {missing} ({what}): CurveZMQ needs both, "
                         "or neither for a plain connection")
    for flag, path, what in (("--curve-secret", secret, "this peer's NAME.key_secret file"),
                             ("--curve-server-key", server_key,
                              "the dispatcher's public NAME.key file")):
        if path and os.path.isdir(path):
            raise ValueError(f"{flag} {path!r} is a directory, not a file: give {what}")
        if path and not os.path.exists(path):  # said once, before `read` starts its workers
            raise ValueError(f"{flag} key file {path!r} does not exist (create keys with: "
                             "mmdispatch keygen NAME)")
    if not secret:
        return
    from dispatcher_server.security import load_public, load_secret, warn_if_readable

    # Said here, once, naming the flag: a worker process would say it without the flag, and
    # a public key given as the secret would first draw advice to chmod it.
    load_secret(secret)
    if load_public(server_key)[1]:
        _warn_secret_server_key(server_key)
    warn_if_readable(secret)


#: --curve-server-key files already said to hold a secret (said once per process)
_SECRET_SERVER_KEYS: set[str] = set()


def _warn_secret_server_key(path: str) -> None:
    """A --curve-server-key naming the dispatcher's NAME.key_secret works (it holds the public
    key too), but the secret then sits on every reader and trainer: said once, from rank 0."""
    if path in _SECRET_SERVER_KEYS or os.environ.get("RANK", "0") != "0":
        return
    _SECRET_SERVER_KEYS.add(path)
    logging.getLogger("mmdispatch").warning(
        "mmdispatch event=curve_server_key_is_secret file=%s fix=%r", path,
        "--curve-server-key needs only the dispatcher's public NAME.key: give that file, "
        "and the secret need not be copied to readers and trainers")


#: Hosts that bind every interface: an endpoint to connect to names one machine.
WILDCARD_HOSTS = ("*", "0.0.0.0", "[::]", "::")


def check_endpoint(flag: str, address: str, *, connect: bool = False) -> str:
    """`address` if it names a ZeroMQ endpoint (tcp://HOST:PORT, ipc://PATH...), else a ValueError
    naming the flag and the form. `connect`: an address to connect to, which names a host and
    a port (a wildcard, or `*` as the port, only binds)."""
    if "://" not in address:
        raise ValueError(f"{flag} {address!r}: an endpoint looks like tcp://HOST:PORT "
                         "(e.g. tcp://10.0.0.5:5555)")
    scheme = address.split("://", 1)[0]
    if scheme not in ZMQ_TRANSPORTS:
        raise ValueError(f"{flag} {address!r}: ZeroMQ speaks {', '.join(ZMQ_TRANSPORTS)}, not "
                         f"{scheme}; an endpoint looks like tcp://HOST:PORT")
    if connect and scheme == "tcp":  # (binds and advertised endpoints have checks of their own)
        host, port = tcp_host_port(address)
        if port is None or not host:
            raise ValueError(f"{flag} {address!r}: no port; an endpoint looks like tcp://HOST:PORT "
                             "(e.g. tcp://10.0.0.5:5555)")
        if host in WILDCARD_HOSTS:
            raise ValueError(f"{flag} {address!r}: {host} binds every interface of a machine; "
                             f"connect to the host the dispatcher runs on (e.g. "
                             f"tcp://10.0.0.5:{port if port.isdigit() else 5555})")
        if not port.isdigit():
            raise ValueError(f"{flag} {address!r}: port {port!r} is no number; an endpoint to "
                             "connect to looks like tcp://HOST:PORT (e.g. tcp://10.0.0.5:5555)")
    port = address.rsplit(":", 1)[-1]
    # ZeroMQ takes a port past 65535 modulo 65536: tcp://host:99999 would bind or reach 34463.
    if address.startswith("tcp://") and port.lstrip("-").isdigit() and not 0 <= int(port) <= 65535:
        raise ValueError(f"{flag} {address!r}: port {port} is out of range (0 to 65535; 0 lets "
                         "the OS pick when binding)")
    return address


def tcp_host_port(endpoint: str) -> tuple[str, str | None]:
    """(host, port text or None) of a tcp:// endpoint, brackets of an IPv6 host kept."""
    netloc = endpoint[len("tcp://"):].rstrip("/")
    if netloc.endswith("]") or ":" not in netloc:
        return netloc, None
    host, _, port = netloc.rpartition(":")
    return host, port


def check_tcp_bind(flag: str, bind: str, form: str, *, any_port: bool = True) -> None:
    """ValueError, one line naming `flag`, the value and `form` (the endpoint to give), for a
    tcp:// bind without a host, a port or a numeric port: ZeroMQ's bind says only "Invalid
    argument" or "No such device". `any_port`: `*` (the OS picks) is a port too."""
    if not bind.startswith("tcp://"):
        return
    host, port = tcp_host_port(bind)
    if port is None:
        what = "no port"
    elif not (port.isdigit() or any_port and port == "*"):
        what = f"port {port!r} is no number"
    elif not host:
        what = "no host or interface"
    else:
        return
    raise ValueError(f"{flag} {bind!r}: {what}; {form}")


def check_ipc_bind(flag: str, address: str) -> None:
    """ValueError, one line naming `flag`, the value and the fix, for an ipc:// endpoint whose
    socket file cannot be made: ZeroMQ's bind names neither the flag nor the directory."""
    if not address.startswith("ipc://") or address.startswith("ipc://@"):  # @: abstract, no file
        return
    parent = os.path.dirname(address[len("ipc://"):]) or "."
    if not os.path.exists(parent):
        why = f"the directory {parent!r} does not exist; create it or give another path"
    elif not os.path.isdir(parent):
        why = f"{parent!r} is not a directory; give a path in a directory"
    elif not os.access(parent, os.W_OK | os.X_OK):
        why = f"the directory {parent!r} is not writable by this user; give a path in one that is"
    else:
        return
    raise ValueError(f"{flag} {address!r}: {why}")


def check_output_dir(flag: str, path: str, *, given: str | None = None) -> None:
    """ValueError naming `flag` and `path` (or `given`, the file path the user wrote, of which
    `path` is the directory) when the directory a command would write into cannot be made or
    written, said at start rather than after the work. Directories this makes to find out are
    taken away again."""
    if given is not None:
        try:
            check_output_dir(flag, path)
        except ValueError as e:
            raise ValueError(f"{flag} {given!r}: its directory " + str(e)[len(flag) + 1:]) from None
        return
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a file, not a directory: give a directory "
                         "(created if missing)")
    made = []
    try:
        at = os.path.abspath(path)
        while not os.path.exists(at) and os.path.dirname(at) != at:
            made.append(at)
            at = os.path.dirname(at)
        if not os.path.isdir(at):
            raise ValueError(f"{flag} {path!r}: {at!r} is a file, not a directory")
        for d in reversed(made):
            os.mkdir(d)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(13, "Permission denied")
    except OSError as e:
        raise ValueError(f"{flag} {path!r} cannot be created or written ({e.strerror or e}): give a "
                         "directory this user can create or write") from None
    finally:
        for d in made:
            try:
                os.rmdir(d)
            except OSError:
                pass


def check_output_file(flag: str, path: str, *, makes_dirs: bool = False) -> None:
    """ValueError naming `flag` and `path` when the file a command writes at its end cannot be
    written there (a missing or read-only directory, a directory in its place): said at start,
    not after a long measurement. `makes_dirs`: the command creates missing directories."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory: give a file path (e.g. "
                         f"{os.path.join(path, 'out' + (os.path.splitext(path)[1] or '.json'))!r})")
    parent = os.path.dirname(path) or "."
    if makes_dirs:
        check_output_dir(flag, parent, given=path)
    elif not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ValueError(f"{flag} {path!r}: the directory {parent!r} {what}; create it or give "
                         "another path")
    elif not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path!r}: the directory {parent!r} cannot be written (permission "
                         "denied); give a path this user can write")
    if os.path.exists(path) and not os.access(path, os.W_OK):
        raise ValueError(f"{flag} {path!r} cannot be written (permission denied)")


@contextmanager
def interrupt_exits(prog: str) -> Iterator[None]:
    """Within: Ctrl-C ends the process at once with `PROG: interrupted` and status 130. For
    start-up (imports, parsing), where there is nothing to unwind yet, and where a library's
    import interrupted halfway can fail in ways that bury the interrupt (torch: RecursionError)."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(_signum: int, _frame) -> None:
        os.write(2, f"{prog}: interrupted\n".encode())
        os._exit(130)

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def unwind_on_sigterm(note: str | None = None) -> None:
    """SIGTERM raises SystemExit(143) in the main thread (logging `note` first): `finally`
    blocks run (a client says BYE, a probe ends its shard command) where the default action
    would kill the process wherever the signal found it. A SIGTERM that arrives once the main
    thread's code has ended, while the interpreter waits for its other threads
    (`threading._shutdown`), has nothing left to unwind: the process exits with 143 at once (a
    SystemExit raised there printed "Exception ignored in: <module 'threading'>" and a traceback)."""
    def handler(signum: int, frame) -> None:
        if note:
            logging.getLogger("mmdispatch").info(note)
        while frame is not None:
            code = frame.f_code
            if code.co_name == "_shutdown" and code.co_filename.endswith("threading.py"):
                logging.shutdown()
                os._exit(128 + signum)
            frame = frame.f_back
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def say(line: str, log_format: str | None = None, *, level: str = "ERROR") -> None:
    """One line for the operator on stderr: under `--log-format json` (given, or else the
    format logging was set up with) a JSON object like every log line, so a collector parses
    the line that matters most. Credentials in URLs are redacted (`redact`)."""
    line = redact(line)
    if log_format is None:
        log_format = "json" if any(isinstance(h.formatter, JsonFormatter) and
                                   getattr(h, "mmdispatch", False)
                                   for h in logging.getLogger().handlers) else "text"
    if log_format == "json":
        line = json_line(line, level)
    print(line, file=sys.stderr, flush=True)


def json_line(message: str, level: str = "INFO", **fields) -> str:
    """A line of ours outside logging (`say`, serve's ready line) as the JSON log lines are."""
    return json.dumps({"time": _utc(time.time()), "level": level, "logger": "mmdispatch",
                       "message": message, **fields})


#: namespace attribute mmdispatch.settings.apply_file sets: (the settings file, {flag: "key = value in [table]"} for
#: each option the file gave and the command line did not)
FROM_FILE = "_from_file"


def name_the_file(message: str, args: argparse.Namespace) -> str:
    """`message` (a mistake naming a flag, `--global-batch must be >= 1`) with where the value
    came from when the settings file gave it, not the command line: the user edits the file."""
    path, origins = getattr(args, FROM_FILE, (None, {}))
    named = [origin for flag, origin in origins.items()
             if re.search(re.escape(flag) + r"(?![\w-])", message)]
    return f"{message} (set by {'; '.join(named)} of {path})" if named else message


def run_reporting_errors(fn, prog: str, *, debug: bool = False,
                         args: argparse.Namespace | None = None) -> int:
    """`fn()`, with a user mistake turned into one line `PROG: error: ...` and exit status 2;
    a value the settings file gave `args` is named with the file (`name_the_file`)."""
    try:
        return int(fn() or 0)
    except KeyboardInterrupt:
        say(f"{prog}: interrupted")
        return 130
    except Exception as e:  # noqa: BLE001 - sorted into user mistakes and bugs just below
        if debug or not is_user_error(e):
            raise
        message = user_message(e)
        say(f"{prog}: error: {name_the_file(message, args) if args else message}")
        return 2
