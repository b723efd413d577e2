"""Per-sample error handling for readers: one policy (`raise | skip | warn`) and counters by reason.

Bad input must neither crash a long-running reader nor pass silently: every failure is counted
under a stable reason name and remembered with its shard and key, and a run of consecutive
failures beyond a limit stops the reader (a wrong config looks like every sample failing).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field

from dispatcher_server.cliopts import event_line

log = logging.getLogger("mmdispatch.pipeline")

ERROR_MODES: tuple[str, ...] = ("raise", "skip", "warn")

#: Every reason a reader counts, and what it means. Shard-level reasons (the archive itself is
#: unusable from some byte on) carry no key; the others name the sample's key.
REASONS: dict[str, str] = {
    # shard level
    "open_failed": "the shard could not be opened",
    "shard_failed": "the shard's stream failed: a read error (a remote shard after its retries) "
                    "or a pipe: command that exited non-zero",
    "empty_shard": "the shard holds no samples",
    "truncated_tar": "the archive (or its gzip stream) ends inside a header or member; samples from "
                     "the break on are lost (one ending right after a member is read whole, with a warning)",
    "bad_tar": "a corrupt tar header, pax record or gzip stream, an extended header (pax, GNU long "
               "name) the end-of-archive blocks follow instead of a member, or bytes after those blocks "
               "that are not a tar header; samples from there on are lost",
    "shard_changed": "the shard file changed since it was read or mapped (rewritten, shrunk or "
                     "appended to); samples from the change on are not read",
    "shard_stalled": "the shard read no byte for the reader's --stall-timeout (a pipe: command or "
                     "server that hangs); the rest of the shard is not read",
    # sample level
    "duplicate_key": "a key or member name seen before in the same shard",
    "bad_key": "a member name that is not UTF-8 (keys and names travel as UTF-8)",
    "link_member": "a member stored as a hard or symbolic link (tar's way to store a file linked "
                   "twice): the archive holds no bytes for it",
    "special_member": "a member stored as a device, a FIFO or a sparse file: not a plain file's bytes",
    "member_too_large": "a member over ReaderConfig.max_member_bytes",
    "sample_too_large": "a sample whose members together exceed ReaderConfig.max_sample_bytes",
    "empty_sample": "no countable text, image, video or audio among the sample's members",
    "bad_image": "an image header that is unreadable, impossible, or over a cut or garbage body",
    "image_too_large": "an image header declaring more than ImageConfig.max_header_pixels",
    "bad_video": "a video container that is cut, not a container, or declares an impossible "
                 "duration, frame rate or size",
    "video_unsupported": "a WebM/MKV/AVI (or fragmented MP4) video on a data node without PyAV "
                         "(install the [video] extra)",
    "bad_audio": "an audio header that is unreadable, inconsistent, or lies about rate or length",
    "bad_text": "text that is not UTF-8 (or escapes an unpaired surrogate)",
    "text_too_large": "a text member, raw or inflated, over TextConfig.max_text_bytes, or a text "
                      "whose tokens alone pass what one reader message may carry",
    "bad_json": "a JSON member that does not parse or has no usable text field",
    "chat_template": "a conversation the chat template refuses, or renders so that its assistant "
                     "tokens cannot be located exactly",
    "placeholder_mismatch": "a text holding placeholders of a modality (--image-placeholder...) "
                            "in another number than the sample has members of it",
    "too_long": "a sample over --max-seq-len LLM tokens: under --over-length skip any, under "
                "truncate one whose cut would fall inside or before an item, or leave none of its "
                "trained (loss) tokens",
    "bad_gzip": "a .gz member that is corrupt or truncated",
    "count_failed": "counting the sample raised an unexpected error (a defect: please report it "
                    "with the sample; the reader logs its traceback once)",
}


class SkipDigest:
    """Repeated skip warnings, counted by (reason, shard) and logged as one line every `every_s`.

    A shard of 100 bad samples would otherwise write 100 lines; the first failure of each reason
    in a shard is still logged in full (it names the key and the cause), the rest only counted.
    """

    def __init__(self, every_s: float = 10.0, clock=time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self.pending: Counter = Counter()
        self.since = clock()
        self.lock = threading.Lock()

    def note(self, reason: str, shard: str) -> None:
        with self.lock:
            self.pending[(reason, shard)] += 1
            due = self.clock() - self.since >= self.every_s
        if due:
            self.flush()

    def flush_due(self) -> None:
        """Flush once skips are pending and `every_s` has passed since the last flush: called
        from a reader's loop, so one that stays up (or is killed) does not keep them unsaid
        until its next skip or its exit."""
        if self.pending and self.clock() - self.since >= self.every_s:
            self.flush()

    def flush(self) -> str | None:
        """Log (and return) the line for the failures counted since the last flush, if any."""
        with self.lock:
            pending, self.pending = self.pending, Counter()
            seconds, self.since = self.clock() - self.since, self.clock()
        if not pending:
            return None
        by_reason: dict[str, Counter] = {}
        for (reason, shard), n in pending.items():
            by_reason.setdefault(reason, Counter())[shard] += n
        parts = []
        for reason, shards in sorted(by_reason.items()):
            top = ", ".join(f"{shard} {n}" for shard, n in shards.most_common(3))
            more = f", {len(shards) - 3} more shards" if len(shards) > 3 else ""
            parts.append(f"{reason}={sum(shards.values())} ({top}{more})")
        line = event_line("samples_skipped", count=sum(pending.values()), seconds=round(seconds),
                          reasons="; ".join(parts), logged="the first of each reason and shard")
        log.warning("%s", line)
        return line


#: One digest per process: readers keep an ErrorStats per shard, the digest spans them.
DIGEST = SkipDigest()
atexit.register(DIGEST.flush)


class SampleError(ValueError):
    """A sample (or a whole shard) could not be read or counted."""

    def __init__(self, reason: str, shard: str, key: str | None, message: str) -> None:
        assert reason in REASONS, f"undocumented error reason {reason!r}"
        where = f"shard {shard!r}" + (f" key {key!r}" if key is not None else "")
        # A remote shard's errors name their URL already: the lines say it once, not twice.
        self.cause = message.removeprefix(f"shard {shard!r}: ")
        super().__init__(f"{reason}: {where}: {self.cause}")
        self.reason = reason
        self.shard = shard
        self.key = key
        self.detail = message


def _skip_line(error: SampleError, **fields) -> str:
    """A skip as one structured line: reason, shard and key are fields under --log-format json."""
    where = {"key": error.key} if error.key is not None else {}
    return event_line("sample_skipped", reason=error.reason, shard=error.shard, **where,
                      detail=error.cause, **fields)


class TooManyErrors(RuntimeError):
    """More consecutive failures than `ErrorPolicy.max_consecutive`: the input or config is wrong."""


@dataclass(kw_only=True, slots=True)
class ErrorPolicy:
    """What a reader does with a bad sample: raise, skip (count it), or warn (count and log it)."""

    mode: str = "warn"
    max_consecutive: int = 100

    def __post_init__(self) -> None:
        if self.mode not in ERROR_MODES:
            raise ValueError(f"error mode {self.mode!r} must be one of {ERROR_MODES}")
        if self.max_consecutive < 1:
            raise ValueError(f"max_consecutive={self.max_consecutive} must be >= 1")


@dataclass(kw_only=True, slots=True)
class ErrorStats:
    """Counters a reader keeps; share one instance across shards to get a run's totals."""

    num_samples: int = 0  # samples yielded
    num_errors: int = 0
    num_shards: int = 0  # shards opened
    num_truncated: int = 0  # samples yielded with their text cut to --max-seq-len
    # members no field map kind names, by extension ("cls"; "" for a name without a suffix)
    ignored_members: Counter = field(default_factory=Counter)
    by_reason: Counter = field(default_factory=Counter)
    recent: deque = field(default_factory=lambda: deque(maxlen=64))  # (reason, shard, key, message)
    consecutive: int = 0
    warned: set = field(default_factory=set)  # (reason, shard) already logged in full
    # A reader of a dispatcher: a shard it cannot open is reported, and the dispatcher gives it
    # to another reader or skips it; its line says so rather than that samples were skipped.
    dispatcher_decides: bool = False

    def ok(self) -> None:
        self.num_samples += 1
        self.consecutive = 0

    def handle(self, error: SampleError, policy: ErrorPolicy) -> None:
        """Count `error`, then raise it or carry on as the policy says."""
        self.num_errors += 1
        self.consecutive += 1
        self.by_reason[error.reason] += 1
        self.recent.append((error.reason, error.shard, error.key, error.detail))
        if policy.mode == "raise":
            raise error
        if policy.mode == "warn":
            if (error.reason, error.shard) in self.warned:
                DIGEST.note(error.reason, error.shard)
            elif self.dispatcher_decides and error.reason == "open_failed" and error.key is None:
                self.warned.add((error.reason, error.shard))
                log.warning("%s", event_line(
                    "shard_open_failed", shard=error.shard, detail=error.cause,
                    then="reported to the dispatcher: another reader reads it, or it is "
                         "skipped there"))
            else:
                self.warned.add((error.reason, error.shard))
                log.warning("%s", _skip_line(error, more="counted, not logged"))
        elif log.isEnabledFor(logging.DEBUG):  # skip mode: a line per sample only when asked
            log.debug("%s", _skip_line(error))
        if self.consecutive > policy.max_consecutive:
            raise TooManyErrors(
                f"{self.consecutive} consecutive failures (max_consecutive={policy.max_consecutive}); "
                f"last: {error}"
            ) from error

    def merge(self, other: ErrorStats) -> None:
        """Add another reader's counters (e.g. one shard's) to these totals."""
        self.num_samples += other.num_samples
        self.num_errors += other.num_errors
        self.num_shards += other.num_shards
        self.num_truncated += other.num_truncated
        self.ignored_members.update(other.ignored_members)
        self.by_reason.update(other.by_reason)
        self.recent.extend(other.recent)

    def as_dict(self) -> dict:
        return {
            "num_samples": self.num_samples,
            "num_errors": self.num_errors,
            "num_shards": self.num_shards,
            "num_truncated": self.num_truncated,
            "num_ignored_members": self.ignored_members.total(),
            "ignored_members": dict(sorted(self.ignored_members.items())),
            "by_reason": dict(sorted(self.by_reason.items())),
            "recent": [
                {"reason": r, "shard": shard, "key": key, "message": msg} for r, shard, key, msg in self.recent
            ],
        }
