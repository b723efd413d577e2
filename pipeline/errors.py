"""Per-sample error handling for readers: one policy (`raise | skip | warn`) and counters by reason.

Bad input must neither crash a long-running reader nor pass silently: every failure is counted
under a stable reason name and remembered with its shard and key, and a run of consecutive
failures beyond a limit stops the reader (a wrong config looks like every sample failing).
"""

from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field

log = logging.getLogger("mmdispatch.pipeline")

ERROR_MODES: tuple[str, ...] = ("raise", "skip", "warn")

#: Every reason a reader counts, and what it means. Shard-level reasons (the archive itself is
#: unusable from some byte on) carry no key; the others name the sample's key.
REASONS: dict[str, str] = {
    # shard level
    "open_failed": "the shard could not be opened",
    "shard_failed": "the shard's stream failed on close (e.g. a pipe: command exited non-zero)",
    "empty_shard": "the shard holds no samples",
    "truncated_tar": "the archive (or its gzip stream) ends early; samples from the break on are lost",
    "bad_tar": "a corrupt tar header, pax record or gzip stream; samples from there on are lost",
    "shard_changed": "the shard file changed since it was read or mapped (rewritten, shrunk or "
                     "appended to); samples from the change on are not read",
    # sample level
    "duplicate_key": "a key or member name seen before in the same shard",
    "bad_key": "a member name that is not UTF-8 (keys and names travel as UTF-8)",
    "member_too_large": "a member over ReaderConfig.max_member_bytes",
    "sample_too_large": "a sample whose members together exceed ReaderConfig.max_sample_bytes",
    "empty_sample": "no countable text, image or audio among the sample's members",
    "bad_image": "an image header that is unreadable, impossible, or over a cut or garbage body",
    "image_too_large": "an image header declaring more than ImageConfig.max_header_pixels",
    "bad_audio": "an audio header that is unreadable, inconsistent, or lies about rate or length",
    "bad_text": "text that is not UTF-8 (or escapes an unpaired surrogate)",
    "text_too_large": "a text member, raw or inflated, over TextConfig.max_text_bytes",
    "bad_json": "a JSON member that does not parse or has no usable text field",
    "bad_gzip": "a .gz member that is corrupt or truncated",
}


class SampleError(ValueError):
    """A sample (or a whole shard) could not be read or counted."""

    def __init__(self, reason: str, shard: str, key: str | None, message: str) -> None:
        assert reason in REASONS, f"undocumented error reason {reason!r}"
        where = f"shard {shard!r}" + (f" key {key!r}" if key is not None else "")
        super().__init__(f"{reason}: {where}: {message}")
        self.reason = reason
        self.shard = shard
        self.key = key
        self.detail = message


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
    num_ignored_members: int = 0  # tar members without a webdataset suffix
    by_reason: Counter = field(default_factory=Counter)
    recent: deque = field(default_factory=lambda: deque(maxlen=64))  # (reason, shard, key, message)
    consecutive: int = 0

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
            log.warning("mmdispatch.pipeline: skipped %s", error)
        else:
            log.debug("mmdispatch.pipeline: skipped %s", error)
        if self.consecutive > policy.max_consecutive:
            raise TooManyErrors(
                f"{self.consecutive} consecutive failures (max_consecutive={policy.max_consecutive}); "
                f"last: {error}"
            ) from error

    def as_dict(self) -> dict:
        return {
            "num_samples": self.num_samples,
            "num_errors": self.num_errors,
            "num_shards": self.num_shards,
            "num_ignored_members": self.num_ignored_members,
            "by_reason": dict(sorted(self.by_reason.items())),
            "recent": [
                {"reason": r, "shard": shard, "key": key, "message": msg} for r, shard, key, msg in self.recent
            ],
        }
