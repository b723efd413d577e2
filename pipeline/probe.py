"""Probe a source before serving it: does any sample hold a member its field map can use?

A dataset whose suffixes no field map names (`.cls`, `.npy` only, or images under a suffix the
map lacks) would otherwise be read whole by every reader, every sample skipped, before the
dispatcher could tell. The probe reads the first samples of the first shards (bounded: cheap
at start) and stops at the first usable sample. It classifies members only (no counting), so a
usable member that later fails to count is the readers' `--errors` business, not the probe's.
A source whose every shard the probe read whole without finding one sample (empty tars,
zero-byte files, members with no key) is refused too: its readers would wait forever. So is a
source naming a remote shard that does not exist (no such object or bucket): every reader would
fail it the same way, and the job would lose its samples (a local path that does not exist is
refused earlier, as listed). Access denied or TLS that fails may be this host's credentials or
CA bundle alone, not the readers': those are warned of and left to the readers. The member
names of the first shard (a mapped local tar: no data is read) are walked to its end, bounded,
and a source whose samples' members lie apart in it is refused: readers group the members of a
key that lie together, so every sample of such a shard would train in pieces.
"""

from __future__ import annotations

import itertools
import logging
import mimetypes
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from dispatcher_server.cliopts import redact
from pipeline import remote
from pipeline.fieldmap import KINDS, ignored_label
from pipeline.reader import (ReaderConfig, group_samples, sample_builder, split_name,
                             unkeyed_label)
from pipeline.shards import open_shard
from pipeline.tario import TarError, open_decompressed, tar_members

log = logging.getLogger("mmdispatch.pipeline")


@dataclass(kw_only=True, slots=True)
class ProbeResult:
    """What the probe saw: samples read, how many had a usable member, members by suffix."""

    shards: list[str] = field(default_factory=list)  # shards opened, in order
    samples: int = 0  # samples read (grouped by key)
    problems: int = 0  # samples grouped but skipped whole (a link member...): still samples
    whole: int = 0  # shards read to their end, closed without an error
    usable: int = 0  # of those, samples with a member some kind of the field map names
    suffixes: Counter = field(default_factory=Counter)  # every member by its extension
    ignored: Counter = field(default_factory=Counter)  # members no kind names, by extension
    unreadable: list[tuple[str, str]] = field(default_factory=list)  # (shard, why)
    missing: list[tuple[str, str]] = field(default_factory=list)  # remote, not found: (shard, why)
    # (shard, key, first member, later member): a key whose members lie apart in a shard (a
    # tar not written grouped by key, `tar cf x.tar *.jpg *.txt`): readers would take each run
    # of its members as a sample, and train the samples of such a shard in pieces
    apart: tuple[str, str, str, str] | None = None
    # (shard, key, suffixes, other key, its suffixes): the members of each sample kept in one
    # directory per kind (`images/0.jpg`, `captions/0.txt`): a key includes its directory, so
    # readers would train the image and its text as two samples
    split: tuple[str, str, str, str, str] | None = None
    # the first shard's keys as the probe walked them, each with its members' suffixes
    key_suffixes: dict[str, set[str]] = field(default_factory=dict, repr=False)
    timed_out: bool = False  # `probe_within` gave up: what was read proves nothing
    gave_up_on: str | None = None  # the shard being read when `probe_within` gave up
    reading: object = field(default=None, repr=False)  # the shard stream open now, if any
    of: int = 0  # shards the source lists

    @property
    def empty(self) -> bool:
        """Every shard of the source was read whole and not one holds a sample."""
        return (self.of > 0 and self.whole == self.of and self.samples == 0 and self.problems == 0
                and not self.timed_out)

    @property
    def refused(self) -> bool:
        """Samples were read and not one had a usable member, or the source holds no sample at
        all (a probe cut short refuses nothing)."""
        return (self.samples > 0 and self.usable == 0 and not self.timed_out) or self.empty


def probe_source(urls: Sequence[str], reader_config: ReaderConfig, *, max_samples: int = 64,
                 max_shards: int = 4, into: ProbeResult | None = None) -> ProbeResult:
    """Read the first shards of `urls` until a sample with a usable member turns up, or
    `max_samples` samples (default 64) or `max_shards` shards (default 4) were read; the
    remote ones of the first `max_shards` left are opened only (do they exist?).

    A shard that cannot be opened or breaks is noted in `unreadable` and the next one tried
    (the dispatcher's host may not see the shards its readers see; the readers report such
    failures themselves). `into`: the result to fill (`probe_within` watches it).
    """
    if max_samples < 1 or max_shards < 1:
        raise ValueError(f"max_samples={max_samples} and max_shards={max_shards} must be >= 1")
    result = into if into is not None else ProbeResult()
    result.of = len(urls)
    builder = sample_builder(reader_config)
    for url in urls[:max_shards]:
        if result.timed_out:  # `probe_within` gave up: its thread reads no further shard
            break
        seen_enough = result.usable or result.samples >= max_samples
        if seen_enough and not remote.scheme(url):
            continue  # a remote shard is still opened (a request or two): is it there at all?
        try:
            stream = open_shard(url, mapped=reader_config.map_shards)
        except (OSError, ValueError) as e:  # ValueError: a URL this host has no backend for
            result.unreadable.append((url, f"cannot open: {e}"))
            # Not found is so on every host; denied or TLS may be this host's credentials or
            # CA bundle alone (readers may hold others): those are warned of, not refused.
            if remote.scheme(url) and isinstance(e, FileNotFoundError):
                result.missing.append((url, str(e).removeprefix(f"shard {url!r}: ")))
            continue
        if seen_enough:
            try:
                stream.close()
            except OSError:
                pass
            continue
        result.shards.append(url)
        result.reading = stream

        tallying = [True]  # members past the probed samples (the key walk) are not tallied

        def unnamed(name: str) -> None:
            if not tallying[0]:
                return
            label = unkeyed_label(name)
            result.ignored[label] += 1
            if not label:  # a dot file is no suffix the refusal could suggest mapping
                result.suffixes[label] += 1

        whole = False  # read to its end (a loop not left by `break`)
        try:
            members = _keys_apart(tar_members(open_decompressed(stream, url),
                                              reader_config.max_member_bytes), result, url,
                                  result.key_suffixes if len(result.shards) == 1 else None)
            groups = group_samples(members, unnamed, reader_config.max_sample_bytes)
            for _key, group, problem in groups:
                if result.apart is not None:
                    break
                if problem is not None:
                    result.problems += 1
                    continue  # its members were not kept; the readers report it
                result.samples += 1
                for suffix in group:
                    result.suffixes[ignored_label(suffix)] += 1
                builder.count_ignored(group, result.ignored)
                if any(builder.classify(suffix)[0] is not None for suffix in group):
                    result.usable += 1
                    if len(result.shards) == 1 and _mapped_tar(url, reader_config):
                        # The rest of the first shard's member names, its data left unread
                        # (mapped): are its samples' members together? (Bounded.)
                        tallying[0] = False
                        until = time.monotonic() + KEY_WALK_S
                        for _ in itertools.islice(groups, MAX_KEYS_CHECKED):
                            if result.apart is not None or time.monotonic() > until:
                                break
                    break
                if result.samples >= max_samples:
                    break
            else:
                whole = True
        except (TarError, OSError) as e:
            result.unreadable.append((url, str(e)))
        finally:
            if len(result.shards) == 1 and result.apart is None:
                result.split = _split_by_directory(url, result.key_suffixes)
            result.key_suffixes = {}
            result.reading = None
            try:
                stream.close()
                result.whole += whole
            except OSError as e:  # a pipe cut short exits non-zero; what was read stands
                if whole:  # a command that failed by itself: its output proves nothing
                    result.unreadable.append((url, str(e)))
    return result


#: Samples of a source's first shard whose keys the probe checks for members lying apart, and
#: the seconds it may spend on them (100,000 members take about 0.6 s): within the probe's time.
MAX_KEYS_CHECKED = 200_000
KEY_WALK_S = 5.0


def _keys_apart(members, result: ProbeResult, url: str, suffixes: dict[str, set] | None = None):
    """`members`, passed on; notes in `result.apart` the first key whose run of members starts
    again after other keys' members (the shard is not grouped by key), and in `suffixes` (if
    given) each key's members' suffixes."""
    seen: dict[str, str] = {}  # key -> its first member's name
    last = None
    for name, data in members:
        parts = split_name(name)
        if parts is not None and parts[0] != last:
            last = parts[0]
            first = seen.setdefault(last, name)
            if first is not name and result.apart is None:
                result.apart = (url, last, first, name)
        if parts is not None and suffixes is not None:
            suffixes.setdefault(parts[0], set()).add(parts[1].lower())
        yield name, data


def _split_by_directory(url: str, suffixes: dict[str, set[str]]
                        ) -> tuple[str, str, str, str, str] | None:
    """The first two keys of `url` that are one sample kept in two directories by kind, when
    at least half of the names in directories are so: the same name under two directories
    whose members have no suffix in common (`images/0.jpg`, `captions/0.txt`). Folders of
    samples alike (`cat/001.jpg`, `dog/001.jpg`) share suffixes and are not."""
    by_name: dict[str, list[str]] = {}
    for key in suffixes:
        _, slash, name = key.rpartition("/")
        if slash:
            by_name.setdefault(name, []).append(key)

    def disjoint(keys: list[str]) -> bool:  # no suffix in two of the keys
        kinds = [suffixes[k] for k in keys]
        return sum(map(len, kinds)) == len(set().union(*kinds))

    pieces = [keys for keys in by_name.values() if len(keys) > 1 and disjoint(keys)]
    if not pieces or 2 * len(pieces) < len(by_name):
        return None
    a, b = pieces[0][:2]
    return url, a, ", ".join(sorted(suffixes[a])), b, ", ".join(sorted(suffixes[b]))


def _mapped_tar(url: str, config: ReaderConfig) -> bool:
    """A local plain tar that readers map: walking its member headers reads no member data."""
    return (config.map_shards and not remote.scheme(url) and not url.startswith("pipe:")
            and url.removeprefix("file:").endswith(".tar"))


def probe_within(urls: Sequence[str], reader_config: ReaderConfig, *, timeout_s: float,
                 **limits) -> ProbeResult:
    """`probe_source` given at most `timeout_s` seconds, so a shard that never answers (a
    `pipe:` command or a server that hangs) cannot hold the dispatcher's start. Past the
    limit the result is `timed_out` (it refuses nothing) and the shard being read is abandoned:
    a shard command is killed, which ends the probe's thread."""
    result = ProbeResult()
    worker = threading.Thread(target=probe_source, args=(urls, reader_config),
                              kwargs={**limits, "into": result}, daemon=True, name="mmdispatch-probe")
    worker.start()
    try:
        worker.join(timeout_s)
    finally:  # past the limit, or the caller stopped (SIGTERM, Ctrl-C): no command outlives it
        # (after a join an exception interrupted, is_alive() says False: the open stream tells)
        if worker.is_alive() or result.reading is not None:
            result.gave_up_on = result.shards[-1] if result.shards else None
            result.timed_out = True
            kill = getattr(result.reading, "kill", None)
            if kill is not None:
                kill()
    return result


def _example(suffixes: list[str]) -> tuple[str, str, str]:
    """(kind, suffix, caveat) of a field map example for a found suffix, its kind guessed from
    Python's built-in MIME table (not the host's /etc/mime.types: the same message everywhere)."""
    table = mimetypes.MimeTypes()
    for suffix in suffixes:
        kind = (table.guess_type(f"x.{suffix}")[0] or "").split("/")[0]
        if kind in KINDS:
            return kind, suffix, ""
    suffix = suffixes[0] if suffixes else "png"
    return "image", suffix, f" if the {suffix} members are images"


def refusal(result: ProbeResult, source: str = "default") -> str | None:
    """The one-line refusal of a source in which no probed sample has a usable member, or that
    holds no sample at all, or that names a remote shard that does not exist, or None."""
    if result.missing:
        url, why = result.missing[0]
        more = f" (and {len(result.missing) - 1} more shard(s) likewise)" if len(result.missing) > 1 else ""
        return redact(f"source {source!r}: shard {url!r} cannot be read: {why}{more}; every reader "
                      f"would fail it the same way: fix the URL or the access, or leave the shard "
                      f"out of the source (checked at start; --probe-samples 0 skips the check)")
    if result.apart is not None:
        url, key, first, later = result.apart
        return redact(f"source {source!r}: shard {url!r} is not grouped by sample key: the "
                      f"members of key {key!r} lie apart ({first!r}, then {later!r} after other "
                      f"keys' members); readers take the members of a key that lie together as "
                      f"one sample, so its samples would train in pieces: write the shard with "
                      f"its files sorted by name (tar --sort=name -cf, or webdataset's "
                      f"TarWriter) (checked at start; --probe-samples 0 skips the check)")
    if result.split is not None:
        url, key, found, other, other_found = result.split
        name = key.rpartition("/")[2]
        return redact(f"source {source!r}: shard {url!r} keeps each sample's members in a "
                      f"directory per kind ({key!r} holds {found}, {other!r} holds "
                      f"{other_found}): a sample's key is its members' path up to the first dot, "
                      f"directory included, so readers would train these as separate samples "
                      f"(the {found} without the {other_found}): write each sample's members "
                      f"side by side under one key ({name}.{found.split(', ')[0]}, "
                      f"{name}.{other_found.split(', ')[0]}), e.g. with webdataset's TarWriter "
                      f"(checked at start; --probe-samples 0 skips the check)")
    if not result.refused:
        return None
    shown = ", ".join(result.shards[:3]) + (f" and {len(result.shards) - 3} more"
                                            if len(result.shards) > 3 else "")
    if result.empty:
        found = ", ".join(f"{label or '(no suffix)'} {n}" for label, n in result.ignored.most_common())
        return (f"source {source!r} (shards {shown}): holds no sample: its {result.whole} shard(s) were "
                f"read whole and hold {'only members with no sample key: ' + found if found else 'no member'} "
                f"(a sample is members named KEY.SUFFIX, e.g. 000.jpg and 000.txt); check that these "
                f"are the shards you meant, or that their writer finished")
    found = sorted(s for s in result.suffixes if s)
    kind, suffix, caveat = _example(found)
    return (f"source {source!r} (shards {shown}): no sample has a usable member (the first "
            f"{result.samples} samples read); found suffixes {', '.join(found) or 'none'}; map them "
            f"to a kind ({', '.join(KINDS)}) with a field map in a dataset file (e.g. {kind}: "
            f"[{suffix}]{caveat}; try it with `mmdispatch inspect --map {kind}={suffix}`), or "
            f"check that these are the shards you meant")


def log_unprobed(result: ProbeResult, source: str = "default") -> None:
    """Warn when the probe was cut short or could read no sample at all (nothing was checked)."""
    if result.timed_out:
        where = result.gave_up_on or "its first shard"
        log.warning("mmdispatch.pipeline: source %r not probed: gave up waiting on %s (a shard "
                    "command or server that does not answer?); serving without the check, the "
                    "readers will report what they find", source, where)
    elif result.samples == 0 and result.unreadable and not result.missing:  # missing: refused
        url, why = result.unreadable[0]
        log.warning("mmdispatch.pipeline: source %r not probed: no sample readable here from "
                    "%d shard(s) (first: %s: %s); the readers will report what they find",
                    source, len(result.unreadable), url, why)


__all__ = ["ProbeResult", "log_unprobed", "probe_source", "probe_within", "refusal"]
