"""Read shards into counted `SampleRecord`s: tar members -> samples grouped by key -> counts.

Stages are small generators (webdataset style). Grouping follows webdataset's key convention
(`dir/key.suffix`, the suffix starts at the basename's first dot), so `k.0.jpg` and `k.1.jpg`
are two images of sample `k`; a basename starting with a dot (macOS's `._k.jpg` and
`.DS_Store`) names no sample. Failures go through one `ErrorPolicy`; a sample's index is its
position in the shard counting failed samples too, so `start_index` resumes are stable.
"""

from __future__ import annotations

import argparse
import logging
import re
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from dispatcher_server.cliopts import event_line, finite_float, named_by_flags, redact
from pipeline.counting import (
    OVER_LENGTH, PLACEHOLDER_FLAGS, AudioConfig, Conversation, CountError, Counter, CountingConfig,
    EmptyField, FieldText, ImageConfig, TextConfig, gunzip, kept_text_len, pillow_pixel_limit,
)
from pipeline.fieldmap import FieldMap, ignored_label, is_gzip
from pipeline.errors import ERROR_MODES, ErrorPolicy, ErrorStats, SampleError
from pipeline.records import Item, SampleRecord
from pipeline.shards import MappedShard, open_shard, reads_can_wait, stream_stamp
from pipeline.tario import (
    Link, CopyIdentity, Special, TarError, TooLarge, gzip_named, open_decompressed, tar_members,
    valid_header,
)
from pipeline.tokenize import TextTokens
from pipeline.video import VideoConfig, count_video, video_config

log = logging.getLogger("mmdispatch.pipeline")
#: Tallied with the ignored members, after its extension: a JSON member holding none of the
#: text fields (metadata), carried as payload but counted as no text.
NO_TEXT_FIELD = "(no text field)"
#: ... and those whose text field is there but empty (`{"caption": ""}`) under this one.
EMPTY_TEXT_FIELD = "(empty text field)"
#: ... and text members with no text at all (a 0-byte `.txt`, a JSON `[]`) under this one.
EMPTY_TEXT = "(empty)"
#: Ignored members whose basename starts with a dot are tallied under this label: macOS tar
#: (bsdtar) writes an AppleDouble `._k.jpg` beside each `k.jpg`, and `.DS_Store` files.
DOT_FILE = ".* (dot file)"

#: Hears of each skipped sample: the error and the sample's index in the shard (-1 when the
#: rest of the shard is lost: a shard-level failure). With `iter_shard(resume_points=True)` it
#: is also given a third argument: where the next sample begins (as `SampleRecord.next_at`).
SkipSink = Callable[..., None]


@dataclass(kw_only=True, slots=True)
class ReaderConfig:
    """Counting rules, which member suffixes are which kind, and what to do with bad samples."""

    counting: CountingConfig = field(default_factory=CountingConfig)
    fields: FieldMap = field(default_factory=FieldMap)  # suffix -> kind; others are ignored
    errors: ErrorPolicy = field(default_factory=ErrorPolicy)
    keep_members: bool = True  # carry raw member bytes in records (False: counts only)
    # Members over this are read through and the sample skipped (`member_too_large`): one member
    # is held in memory whole, and the wire protocol's frame limit is 256 MiB anyway.
    max_member_bytes: int = 256 << 20
    # A sample's members are held together until its key changes; a shard whose members all
    # share one key would otherwise be held whole. 1 GiB is the wire protocol's message limit.
    max_sample_bytes: int = 1 << 30
    # Local uncompressed shards are read through a memory map (members are views of the page
    # cache, never copied; see `MappedShard`). False reads them with copies, for files that may
    # be truncated while read (a mapped file then kills the process with SIGBUS).
    map_shards: bool = True

    def __post_init__(self) -> None:
        if self.max_member_bytes < 1:
            raise ValueError(f"max_member_bytes={self.max_member_bytes} must be >= 1")
        if self.max_sample_bytes < 1:
            raise ValueError(f"max_sample_bytes={self.max_sample_bytes} must be >= 1")


def add_reader_arguments(parser: argparse.ArgumentParser) -> None:
    """Command-line options for counting rules and error policy (shared by inspect and read)."""
    image, audio, text, errors = ImageConfig(), AudioConfig(), TextConfig(), ErrorPolicy()
    video = VideoConfig()
    group = parser.add_argument_group("counting and errors")
    add = group.add_argument
    add("--min-pixels", type=int, default=image.min_pixels, help="image resize lower pixel budget")
    add("--max-pixels", type=int, default=image.max_pixels, help="image resize upper pixel budget")
    add("--patch-size", type=int, default=image.patch_size, help="vision patch side in pixels")
    add("--merge-size", type=int, default=image.merge_size, help="patches merged per side into one LLM token")
    add("--max-header-pixels", type=int, default=image.max_header_pixels,
        help=f"reject images declaring more pixels (at most {pillow_pixel_limit()}: Pillow decodes no more)")
    add("--video-fps", type=finite_float, default=video.fps, help="video frames sampled per second")
    add("--video-min-frames", type=int, default=video.min_frames,
        help="fewest video frames sampled of a clip that holds them (qwen_vl_utils' min_frames)")
    add("--video-max-pixels", type=int, default=video.max_pixels, help="video resize upper pixel budget per frame")
    add("--audio-frames-per-s", type=finite_float, default=audio.encoder_frames_per_s, help="audio encoder frames per second")
    add("--audio-tokens-per-s", type=finite_float, default=audio.llm_tokens_per_s, help="audio LLM tokens per second; a whole divisor of the frame rate pools the frames (50 / 25: floor(frames / 2), as Qwen2-Audio)")
    add("--max-clip-seconds", type=finite_float, default=audio.max_duration_s,
        help="skip audio and video members that last longer (bad_audio, bad_video): a header "
             "claiming days is corrupt; raise it for longer recordings (lectures, audiobooks)")
    add("--audio-pad-window", type=finite_float, default=None,
        help="cost the audio encoder padded to windows of this many seconds (30 for Whisper; a "
             "cost file's window counts frames; default: unset, no padding, each clip costs "
             "its own length)")
    add("--tokenizer", default=None,
        help="HF tokenizers JSON file (a model's tokenizer.json) that turns text into the ids "
             "trainers receive (unset: byte-level ids, the 256 UTF-8 byte values)")
    add("--chat-template", default=None,
        help="chat template for conversations: the name of one of the templates beside "
             "--tokenizer (listed in its tokenizer_config.json or saved as "
             "additional_chat_templates/NAME.jinja; it wins over a built-in of that name), a "
             "built-in name (chatml), a .jinja file or a tokenizer_config.json (unset: the "
             "tokenizer's own, chat_template.jinja else its tokenizer_config.json's, with its "
             "'tool_use' template for samples with tools where it names one; else chatml)")
    for modality, flag in PLACEHOLDER_FLAGS.items():
        add(flag, default=None,
            help=f"token of the tokenizer (an added or special one) marking in the text where "
                 f"each {modality} member goes, in natural name order of the members; removed "
                 f"from the ids (unset: a sample's items come before its text)")
    add("--max-seq-len", type=int, default=text.max_seq_len,
        help="the longest sample in LLM tokens (text plus every item's), as the model's context "
             "(unset: no limit)")
    add("--over-length", choices=OVER_LENGTH, default=text.over_length,
        help="a sample over --max-seq-len: skip it (as too_long), or truncate it: keep its text's "
             "first tokens (items are never cut: a sample whose cut falls in one is skipped)")
    add("--max-text-bytes", type=int, default=text.max_text_bytes, help="skip text members larger than this")
    add("--max-member-bytes", type=int, default=ReaderConfig().max_member_bytes,
        help="skip samples with a member larger than this (read through, never held)")
    add("--json-field", action="append", default=None,
        help=f"JSON text field, repeatable (default: {', '.join(text.json_fields)})")
    add("--map-shards", action=argparse.BooleanOptionalAction, default=True,
        help="memory-map local shards; --no-map-shards reads them with copies (for files that "
             "may be truncated while read)")
    add("--errors", choices=ERROR_MODES, default=errors.mode, help="what to do with a bad sample")
    add("--max-consecutive-errors", type=int, default=errors.max_consecutive, help="stop after this many failures in a row")


#: field -> flag of the counting options, whose config classes name their fields in messages
#: (VideoConfig says `video fps`; its other fields share the image options' names, and
#: `video_config` checks its pixel budget by flag)
COUNTING_FLAGS = {
    "min_pixels": "--min-pixels", "max_pixels": "--max-pixels", "patch_size": "--patch-size",
    "merge_size": "--merge-size", "max_header_pixels": "--max-header-pixels",
    "video fps": "--video-fps", "video min_frames": "--video-min-frames", "encoder_frames_per_s": "--audio-frames-per-s",
    "llm_tokens_per_s": "--audio-tokens-per-s", "pad_window_s": "--audio-pad-window",
    "max_duration_s": "--max-clip-seconds",
    "max_text_bytes": "--max-text-bytes", "max_member_bytes": "--max-member-bytes",
    "max_seq_len": "--max-seq-len", "over_length": "--over-length",
    "max_consecutive": "--max-consecutive-errors",
}


def counting_flag_errors():
    """Counting config classes' ValueErrors naming the flags of their fields: the readers,
    `inspect` and the trainer take the same counting options."""
    return named_by_flags(COUNTING_FLAGS)


def reader_config_from_args(args: argparse.Namespace, *, keep_members: bool = True) -> ReaderConfig:
    """The `ReaderConfig` described by options added with `add_reader_arguments`; a value out
    of range is a ValueError naming its flag."""
    with counting_flag_errors():
        return _reader_config(args, keep_members)


def _reader_config(args: argparse.Namespace, keep_members: bool) -> ReaderConfig:
    text_kwargs: dict = {"tokenizer_path": args.tokenizer, "max_text_bytes": args.max_text_bytes,
                         "chat_template": getattr(args, "chat_template", None),
                         "estimate": getattr(args, "estimate_text", False),
                         "max_seq_len": getattr(args, "max_seq_len", None),
                         "over_length": getattr(args, "over_length", "skip"),
                         **{f"{m}_placeholder": getattr(args, f"{m}_placeholder", None)
                            for m in PLACEHOLDER_FLAGS}}
    if args.json_field:
        blank = [f for f in args.json_field if not f.strip()]
        if blank:
            raise ValueError(f"--json-field {blank[0]!r} is empty: give the name of a JSON key "
                             "that holds the text (e.g. --json-field caption)")
        text_kwargs["json_fields"] = tuple(args.json_field)
    counting = CountingConfig(
        image=ImageConfig(
            min_pixels=args.min_pixels, max_pixels=args.max_pixels, patch_size=args.patch_size,
            merge_size=args.merge_size, max_header_pixels=args.max_header_pixels,
        ),
        audio=AudioConfig(
            encoder_frames_per_s=args.audio_frames_per_s, llm_tokens_per_s=args.audio_tokens_per_s,
            pad_window_s=args.audio_pad_window, max_duration_s=args.max_clip_seconds,
        ),
        text=TextConfig(**text_kwargs),
        video=video_config(fps=args.video_fps, min_frames=args.video_min_frames,
                           max_pixels=args.video_max_pixels, patch_size=args.patch_size,
                           merge_size=args.merge_size, max_duration_s=args.max_clip_seconds),
    )
    errors = ErrorPolicy(mode=args.errors, max_consecutive=args.max_consecutive_errors)
    return ReaderConfig(
        counting=counting, errors=errors, keep_members=keep_members, max_member_bytes=args.max_member_bytes,
        map_shards=getattr(args, "map_shards", True),
    )


def split_name(name: str) -> tuple[str, str] | None:
    """(key, suffix) of a member name, or None when the basename has no dot or starts with one
    (as webdataset, whose key needs a character before the dot: `._k.jpg` and `.DS_Store`,
    which macOS tar adds, belong to no sample)."""
    slash = name.rfind("/") + 1
    dot = name.find(".", slash)
    if dot <= slash:  # -1: no dot; slash: a dot first
        return None
    return name[:dot], name[dot + 1 :]


def unkeyed_label(name: str) -> str:
    """The ignored-member label of a member `split_name` gives no key: `DOT_FILE` for a dot
    file, "" for a name without any suffix."""
    return DOT_FILE if name.startswith(".", name.rfind("/") + 1) else ""


def _utf8_name(name: str) -> bool:
    """Whether a member name survives UTF-8 encoding (names travel as UTF-8 on the wire)."""
    if name.isascii():
        return True
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def printable_key(key: str) -> str:
    """`key` with the raw bytes of a non-UTF-8 name shown as `\\xNN`, safe to log and send."""
    return key if _utf8_name(key) else key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def quoted_name(name: str) -> str:
    """`name` quoted for a message, the raw bytes of a non-UTF-8 name shown once as `\\xNN`
    (`repr(printable_key(name))` would double the backslash)."""
    return repr(name) if _utf8_name(name) else repr(name.encode("utf-8", "surrogateescape"))[1:]


def group_samples(
    members: Iterable[tuple[str, bytes | TooLarge | Link | Special]],
    on_ignored: Callable[[str], None],
    max_sample_bytes: int | None = None,
) -> Iterator[tuple[str, dict[str, bytes], tuple[str, str] | None]]:
    """Yield (key, {suffix: bytes}, problem) per run of consecutive members sharing a key.

    `problem` is None or (reason, message) for a sample that must be skipped whole. A group
    still being filled when the member stream fails is dropped (its key is left on the error
    as `dropped_key`) unless the failure is known to lie in another sample's member, or, naming
    no member, past the archive's end or in extended headers no member follows (`TarError.after_end`).
    """
    key: str | None = None
    group: dict[str, bytes] = {}
    problem: tuple[str, str] | None = None
    held = 0  # bytes of the pending group
    try:
        for name, data in members:
            parts = split_name(name)
            if parts is None:
                on_ignored(name)
                continue
            k, suffix = parts
            if k != key:
                if key is not None:
                    yield key, group, problem
                key, group, problem, held = k, {}, None, 0
            if problem is not None:
                continue  # the first problem explains the skip; the sample's bytes are not kept
            if isinstance(data, Link):
                problem = ("link_member", f"member {quoted_name(name)} is a tar link to "
                           f"{quoted_name(data.target)}, not a file: the archive holds no bytes "
                           "for it (write shards with tar --hard-dereference, or -h for symlinks)")
            elif isinstance(data, Special):
                problem = ("special_member", f"member {quoted_name(name)} is a {data.kind} in the "
                           "tar, not a plain file")
            elif isinstance(data, TooLarge):
                problem = ("member_too_large", f"member {quoted_name(name)} holds {data.size} bytes, "
                           f"over max_member_bytes={data.limit} (see --max-member-bytes)")
            elif not _utf8_name(name):
                problem = ("bad_key", f"member name {quoted_name(name)} is not UTF-8")
            elif suffix in group:
                problem = ("duplicate_key", f"member {name!r} appears twice")
            elif max_sample_bytes is not None and held + len(data) > max_sample_bytes:
                problem = ("sample_too_large", f"members reach {held + len(data)} bytes at {name!r}, "
                           f"over max_sample_bytes={max_sample_bytes}")
            if problem is not None:
                group.clear()
                continue
            group[suffix] = data
            held += len(data)
    except TarError as e:
        # The pending sample is complete if the archive broke inside another sample's member.
        failed = split_name(e.member) if e.member is not None else None
        if key is not None and (failed[0] != key if failed is not None else e.after_end):
            yield key, group, problem
        elif key is not None:
            e.dropped_key = key
        raise
    if key is not None:
        yield key, group, problem


_DIGITS = re.compile(r"(\d+)")


def _natural(suffix: str) -> tuple:
    """Sort key putting `2.jpg` before `10.jpg`."""
    return tuple((0, int(t), "") if t.isdigit() else (1, 0, t) for t in _DIGITS.split(suffix))


class SampleBuilder:
    """Turns one grouped sample into a `SampleRecord` under a counting config."""

    def __init__(self, config: ReaderConfig) -> None:
        self.config = config
        self.counter = Counter(config.counting)
        # suffix -> (kind or None, ext, gzip): a dataset repeats a handful of suffixes millions of times.
        self._suffixes: dict[str, tuple[str | None, str, bool]] = {}

    def classify(self, suffix: str) -> tuple[str | None, str, bool]:
        """(kind, extension, gzip) of a member suffix under the field map; kind None: ignored."""
        got = self._suffixes.get(suffix)
        if got is None:
            kind, ext = self.config.fields.classify(suffix)
            got = (kind, ext, is_gzip(suffix))
            if len(self._suffixes) >= 4096:
                self._suffixes.clear()
            self._suffixes[suffix] = got
        return got

    def _say_joined(self, shard: str, key: str, texts: list) -> None:
        """One warning per set of plain text members a process sees joined in one sample
        (COCO's `key.0.txt`...`key.4.txt` captions train as one run-on text): the rule is the
        documented one, but rarely what several captions were meant for (probe)."""
        plain = tuple(sfx for sfx, _, ext, as_json in texts if not as_json and ext != "json")
        if len(plain) < 2 or plain in _JOINED_SAID or len(_JOINED_SAID) >= 64:
            return
        _JOINED_SAID.add(plain)
        log.warning("%s", event_line(
            "text_members_joined", shard=redact(shard), key=key, members=",".join(plain),
            why="a sample holds several text members: their ids are joined in natural name order, "
                "without separator, into one text, every token trained",
            fix="keep one text member per sample (several captions: a sample each), or write "
                "the separator you want into the texts"))

    def count_ignored(self, members: Iterable[str], into: Tally) -> None:
        """Add the members (suffixes) no kind maps to `into`, by `ignored_label`."""
        for suffix in members:
            if self.classify(suffix)[0] is None:
                into[ignored_label(suffix)] += 1

    def _video(self, data: bytes | memoryview) -> tuple[int, int, dict]:
        return count_video(data, self.config.counting.video)

    def build(self, key: str, members: dict[str, bytes], shard: str, index: int,
              unused: Tally | None = None) -> SampleRecord:
        """Count a sample; raises `CountError` when a member cannot be counted. JSON members
        that hold no text field (metadata), or hold it empty, travel as payload uncounted, and
        are tallied in `unused` as "<ext> (no text field)" or "<ext> (empty text field)"."""
        images: list[tuple[str, bytes]] = []
        audios: list[tuple[str, bytes]] = []
        videos: list[tuple[str, bytes]] = []
        texts: list[tuple[str, bytes, str, bool | None]] = []
        max_text = self.config.counting.text.max_text_bytes
        for suffix, data in members.items():
            kind, ext, gz = self.classify(suffix)
            if kind is None:
                continue  # ignored: counted by the reader (`count_ignored`), carried as payload
            if gz:
                data = gunzip(data, max_text)
            if kind == "image":
                images.append((suffix, data))
            elif kind == "video":
                videos.append((suffix, data))
            elif kind == "audio":
                audios.append((suffix, data))
            else:
                # JSON is read for its text field under either kind: a map naming json as text
                # trained the raw JSON source, braces, keys and URLs (probe)
                texts.append((suffix, data, ext, True if kind == "conversation" else None))
        items: list[Item] = []
        items_llm = 0
        # LLM sequence convention: images, then videos, then audio clips, each in natural name
        # order, then text, unless placeholders anchor them in it (`Counter.place_items`).
        # Videos run in the vision phase beside images (as in Qwen2-VL).
        for modality, group, count in (("image", images, self.counter.image), ("video", videos, self._video),
                                       ("audio", audios, self.counter.audio)):
            if len(group) > 1:
                group.sort(key=lambda m: _natural(m[0]))
            for suffix, data in group:
                try:
                    enc, llm, meta = count(data)
                except CountError as e:
                    raise CountError(e.reason, f"member {suffix!r}: {e}") from None
                items.append(Item(modality=modality, member=suffix, enc_len=enc, llm_len=llm, meta=meta))
                items_llm += llm
        text_len = 0
        tokens = TextTokens.empty()
        no_text: list[str] = []  # JSON members holding none of the text fields
        empty: list[tuple[str, EmptyField]] = []  # JSON members holding one, empty
        blank: list[tuple[str, str]] = []  # members with no text at all (a 0-byte .txt, `[]`), in words
        if texts:
            if len(texts) > 1:
                texts.sort(key=lambda m: _natural(m[0]))
                self._say_joined(shard, key, texts)
            values = []
            for sfx, d, ext, js in texts:
                value = self.counter.member_text(d, ext, f"member {sfx!r}", js)
                if value is None:
                    no_text.append(sfx)
                elif isinstance(value, EmptyField):
                    empty.append((sfx, value))
                elif isinstance(value, Conversation) and not value:  # `[]`: field ones are EmptyField
                    blank.append((sfx, f"JSON {sfx!r} is an empty list"))
                elif value == "" and not isinstance(value, FieldText):
                    blank.append((sfx, f"text member {sfx!r} is empty"))
                values.append((value, f"member {sfx!r}"))
            values = self.counter.sample_texts(values)  # a JSON caption beside a text member: once
            if self.counter.encoder is None:  # inspect's estimate: a count, no ids
                text_len = sum(self.counter.estimate_of(v) for v, _ in values)
            else:
                where = {"shard": shard, "key": key}  # (redacted when logged)
                tokens = TextTokens.concat([self.counter.text_of(v, what, where)
                                            for v, what in values])
                if self.counter.placeholders:
                    tokens = self.counter.place_items(tokens, items)
                text_len = len(tokens)
        if unused is not None:
            for sfx in no_text:
                unused[f"{ignored_label(sfx)} {NO_TEXT_FIELD}"] += 1
            for sfx, _ in empty:
                unused[f"{ignored_label(sfx)} {EMPTY_TEXT_FIELD}"] += 1
            for sfx, _ in blank:  # said like an empty field (probe: a 0-byte .txt was silent)
                unused[f"{ignored_label(sfx)} {EMPTY_TEXT}"] += 1
        if not items and not text_len:
            fields = self.config.counting.text.json_fields
            why = "".join(f"; {said}" for _, said in blank)
            why += "".join(f"; JSON {sfx!r} field {e.field!r} is empty ({e.value})" for sfx, e in empty)
            if no_text:
                why += (f"; JSON {', '.join(map(repr, no_text))} holds none of the text fields "
                        f"{', '.join(fields)} (see --json-field)")
            unmapped = sorted(s for s in members if self.classify(s)[0] is None)
            if unmapped:
                why += (f"; no kind of the field map names {', '.join(map(repr, unmapped))} (map "
                        "them in the dataset file's [sources.fields], or `inspect --map`)")
            raise CountError("empty_sample",
                             f"no countable text, image, video or audio among members {sorted(members)}{why}")
        whole = text_len
        if self.config.counting.text.max_seq_len is not None:
            tokens, text_len = self._within_length(tokens, text_len, items)
        return SampleRecord(
            key=key,
            shard=shard,
            index=index,
            items=items,
            text_len=text_len,
            llm_len=text_len + items_llm,
            tokens=tokens,
            members=members if self.config.keep_members else {},
            truncated=whole - text_len,
        )

    def _within_length(self, tokens: TextTokens, text_len: int,
                       items: list[Item]) -> tuple[TextTokens, int]:
        """(tokens, text_len) of a sample within --max-seq-len (`kept_text_len`): its text's
        first tokens where it is truncated. A cut that leaves none of the text's loss tokens
        is `too_long` too: the sample would train on nothing."""
        text = self.config.counting.text
        keep = kept_text_len(text_len, items, text.max_seq_len, text.over_length)
        if keep == text_len or self.counter.encoder is None:  # an estimate: a count, no ids
            return tokens, keep
        kept = TextTokens(tokens.ids[:keep], tokens.mask[:keep])
        if tokens.mask.any() and not kept.mask.any():
            first = int(tokens.mask.argmax())
            raise CountError("too_long", f"the sample is {text_len + sum(it.llm_len for it in items)} "
                                         f"LLM tokens, over --max-seq-len {text.max_seq_len}, and "
                                         f"truncating it keeps {keep} text tokens, none of its "
                                         f"trained ones (the first is text token {first}): nothing "
                                         "would be left to learn from; raise --max-seq-len")
        return kept, keep


_BUILDERS: dict[str, SampleBuilder] = {}
_DEFECTS_LOGGED: set[str] = set()


def _log_defect_once(e: Exception, url: str, key: str) -> None:
    """The traceback of an unexpected counting error, once per error type in this process: the
    sample is skipped as `count_failed`, and the traceback is what a bug report needs."""
    kind = type(e).__name__
    if kind not in _DEFECTS_LOGGED:
        _DEFECTS_LOGGED.add(kind)
        log.error("mmdispatch.pipeline: counting shard %r key %s raised %s (a defect: please report "
                  "it with this sample); skipped as count_failed", url, quoted_name(key), kind,
                  exc_info=e)


_JOINED_SAID: set[tuple[str, ...]] = set()  # the plain text member sets text_members_joined named
_TEXTLESS_SAID: list[str] = []  # the first shard samples_without_text was said for


def _no_text_fields(ignored) -> dict[str, int]:
    """The tallies of JSON members holding none of the text fields, by label."""
    return {k: n for k, n in ignored.items() if n and k.endswith(NO_TEXT_FIELD)}


def _say_textless(url: str, samples: int, labels: list[str]) -> None:
    """Said once a process (the caller checks `_TEXTLESS_SAID`): a shard none of whose samples holds text while their JSON members hold
    none of the text fields (OBELICS' or MMC4's text lists, a transcript under another key):
    they train as their media alone, on no token, with only a tally to tell (probe)."""
    _TEXTLESS_SAID.append(url)
    log.warning("%s", event_line(
        "samples_without_text", shard=redact(url), samples=samples, members=",".join(labels),
        why="no sample of the shard holds text, and their JSON members hold none of the text "
            "fields: they train as their images, video or audio alone, on no token",
        fix="name the JSON's text field with --json-field (json_field in the config file's "
            "[counting] table), or, "
            "for interleaved documents, see 'Placeholders' in docs/datasets.md"))


def sample_builder(config: ReaderConfig) -> SampleBuilder:
    """The SampleBuilder of `config`, built (its tokenizer and chat template loaded) once per
    process: keyed by the config's value, as loading a tokenizer per shard would dominate small
    shards."""
    cache_key = repr(config)
    builder = _BUILDERS.get(cache_key)
    if builder is None:
        if len(_BUILDERS) > 16:
            _BUILDERS.clear()
        builder = _BUILDERS[cache_key] = SampleBuilder(config)
    return builder


def mapped_copy_identity(url: str) -> dict | None:
    """The identity (`tario.CopyIdentity`, wire form) of a local uncompressed shard, from a
    walk of its headers through a memory map (members are views, never read): about a
    microsecond a member. None for another kind of shard (a stream cannot be walked twice
    without reading it twice) or one that cannot be walked whole (its own read reports why).
    Such a shard is not opened: a `pipe:` command would run, a remote one be requested, only to
    be dropped."""
    if reads_can_wait(url) or gzip_named(url):
        return None
    try:
        stream = open_shard(url, mapped=True)
    except OSError:
        return None
    try:
        if not isinstance(stream, MappedShard):
            return None
        identity = CopyIdentity()
        for _ in tar_members(stream, identity=identity):
            pass
        return identity.to_wire() if identity.complete else None
    except (TarError, OSError):
        return None
    finally:
        stream.close()


def iter_shard(
    url: str,
    config: ReaderConfig | None = None,
    *,
    start_index: int = 0,
    stats: ErrorStats | None = None,
    spans: bool = False,
    on_skip: SkipSink | None = None,
    ignored: Tally | None = None,
    on_open: Callable[[BinaryIO], BinaryIO] | None = None,
    identity: CopyIdentity | None = None,
    offset: int | None = None,
    resume_points: bool = False,
) -> Iterator[SampleRecord]:
    """Counted samples of one shard from sample `start_index` on; failures per `config.errors`.

    With `spans`, each record also says where its items' bytes lie in the shard file
    (`SampleRecord.spans`); only uncompressed shards have such offsets (ValueError otherwise).

    Pass an `ErrorStats` to read the counters afterwards (samples cut to --max-seq-len count
    in `num_truncated`), and `on_skip` to hear of every skipped sample as it happens, with its
    index (-1: the rest of the shard). `on_open` gets the
    opened shard stream and returns the stream to read through (a watcher). A shard holding
    fewer than `start_index` samples is reported as `shard_changed`: it is not the file that
    was read before.

    Members no kind of `config.fields` maps are counted by `ignored_label` in
    `stats.ignored_members`, and also in `ignored` when given (this shard's alone). They are
    counted over the whole walk, samples before `start_index` included, so a shard resumed by
    index by another reader is counted whole by the one that finishes it (a walk from `offset`
    counts from there on). `identity` is built over the
    whole walk likewise (`tario.CopyIdentity`), complete once the archive's end is read.

    Resume points: with `resume_points`, a shard that can be read at an offset (a local or
    remote plain tar; not a `pipe:` command or gzip) says where each next sample begins: a
    record's `next_at`, and `on_skip`'s third argument (-1: not known, e.g. past a damaged
    member). `offset`, with `start_index` > 0, is where sample `start_index` begins (one of
    those, reported by an earlier read of the same shard): the walk starts there and numbers
    samples from `start_index`, so resuming costs nothing for the samples before. Such a walk
    covers only the rest of the shard: `identity` is never complete (the copy is not compared),
    members ignored and keys repeated before `offset` are not seen. An offset that does not hold
    a tar header (the file changed, or it is a gzip or `pipe:` shard) is logged and the shard
    walked from its start, as without one: no sample is lost or repeated.
    """
    config = config or ReaderConfig()
    if start_index < 0:
        raise ValueError(f"start_index={start_index} must be >= 0")
    if spans and gzip_named(url):
        raise ValueError(f"spans need an uncompressed shard; {url!r} is gzip")
    stats = stats if stats is not None else ErrorStats()
    policy = config.errors
    builder = sample_builder(config)
    stats.num_shards += 1

    def skip(error: SampleError, index: int, at: list[int] | None = None) -> None:
        stats.handle(error, policy)  # raises under mode="raise"
        if on_skip is not None:
            if resume_points:
                on_skip(error, index, at[0] if at is not None and index >= 0 else -1)
            else:
                on_skip(error, index)

    try:
        stream = open_shard(url, mapped=config.map_shards)
    except OSError as e:
        # The skip line names the shard already: not twice when the error does too (remote).
        why = str(e).removeprefix(f"shard {url!r}: ")
        skip(SampleError("open_failed", url, None, f"cannot open: {why}"), -1)
        return
    # A local file read through a buffer shows an append as bytes after the end: the version
    # opened tells that change from a damaged shard.
    opened = stream_stamp(stream) if not reads_can_wait(url) and not isinstance(stream, MappedShard) else 0
    if on_open is not None:
        stream = on_open(stream)
    seekable = not url.startswith("pipe:") and not gzip_named(url)
    at: list[int] | None = [-1] if resume_points and seekable else None
    start = 0
    if offset is not None and offset > 0 and start_index > 0:
        start = _resume_at(stream, url, offset, start_index) if seekable else 0
        if not start:
            log.warning("mmdispatch event=resume_offset_refused shard=%s index=%d offset=%d: %s; "
                        "walking the shard from its start", url, start_index, offset,
                        "no tar header there (the file changed?)" if seekable
                        else "a pipe: or gzip shard is not read at an offset")

    shard_ignored = ignored if ignored is not None else Tally()

    def unnamed(name: str) -> None:  # a member without a key (no suffix, or a dot file)
        shard_ignored[unkeyed_label(name)] += 1

    index = start_index - 1 if start else -1
    sent = with_text = 0  # samples counted, and of those with any text
    # (`ignored` may hold earlier shards' tallies: this shard's are what it adds)
    no_text_before = _no_text_fields(shard_ignored)
    last_key: str | None = None
    seen: set[str] = set()
    failure: SampleError | None = None
    unterminated: list[int] = []  # where the archive ended without its end-of-archive blocks
    try:
        offsets: dict[str, int] | None = {} if spans else None
        members_of = tar_members(open_decompressed(stream, url), config.max_member_bytes,
                                 None if offsets is None else offsets.__setitem__,
                                 on_unterminated=unterminated.append,
                                 identity=None if start else identity, start=start, at=at)
        for key, members, problem in group_samples(members_of, unnamed, config.max_sample_bytes):
            if offsets is not None:
                where = {sfx: offsets.pop(f"{key}.{sfx}", -1) for sfx in members}
                if len(offsets) > 1:  # members read but not grouped (ignored, skipped samples)
                    # The newest entry may be the next sample's first member: keep only that one.
                    newest = next(reversed(offsets.items()))
                    offsets.clear()
                    offsets[newest[0]] = newest[1]
            index += 1
            last_key = key
            builder.count_ignored(members, shard_ignored)
            if key in seen and problem is None:
                problem = ("duplicate_key", f"key {key!r} appears again at sample {index}: keys must be "
                           "unique in a shard and a sample's members adjacent (write shards sorted by "
                           "name, e.g. tar --sort=name)")
            seen.add(key)
            if index < start_index:
                continue
            if problem is not None:
                skip(SampleError(problem[0], url, printable_key(key), problem[1]), index, at)
                continue
            try:
                record = builder.build(key, members, url, index, shard_ignored)
                if offsets is not None:
                    record.spans = {it.member: (where[it.member], len(members[it.member]))
                                    for it in record.items}
            except CountError as e:
                skip(SampleError(e.reason, url, key, str(e)), index, at)
                continue
            except Exception as e:  # noqa: BLE001 - a defect on one sample must not stop the reader
                _log_defect_once(e, url, key)
                skip(SampleError("count_failed", url, printable_key(key),
                                 f"counting raised {type(e).__name__}: {e}"[:500]), index, at)
                continue
            if at is not None:
                record.next_at = at[0]
            stats.ok()
            if record.truncated:
                stats.num_truncated += 1
            sent += 1
            with_text += record.text_len > 0
            yield record
        if sent and not with_text and not _TEXTLESS_SAID:
            added = sorted(k for k, n in _no_text_fields(shard_ignored).items()
                           if n > no_text_before.get(k, 0))
            if added:
                _say_textless(url, sent, added)
        if unterminated:  # nothing is lost, but the writer may have stopped inside a sample
            last = f"its last sample {quoted_name(last_key)}" if last_key is not None else "its last member"
            log.warning("mmdispatch.pipeline: shard %r ends at byte %d without the end-of-archive blocks "
                        "of a tar (its writer was killed or never closed it?): read as it is, but %s "
                        "may be incomplete", url, unterminated[0], last)
    except TarError as e:
        after = f" after key {quoted_name(last_key)}" if last_key is not None else ""
        lost = f" from key {quoted_name(e.dropped_key)}" if e.dropped_key is not None else ""
        # A server answering with a page (a login, an error with status 200) sends no tar.
        page = (" (the server sent text/html: an error or login page, not the shard?)"
                if getattr(stream, "mimetype", None) == "text/html" else "")
        lost = ("; every sample before them was read, any after them are lost"
                if e.after_end and e.dropped_key is None
                else f"; samples from index {index + 1}{lost} on are lost")
        if e.after_end and opened and stream_stamp(stream) != opened:
            failure = SampleError("shard_changed", url, None, f"shard file changed while being read "
                                  f"(appended to or rewritten): {e}{after}{lost}")
        else:
            failure = SampleError(e.reason, url, None, f"{e}{after}{page}{lost}")
    except OSError as e:  # a read failing for good (a remote shard after its retries, EIO)
        after = f" after key {quoted_name(last_key)}" if last_key is not None else ""
        failure = SampleError("shard_failed", url, None,
                              f"{e}{after}; samples from index {index + 1} on are lost")
    finally:
        stats.ignored_members.update(shard_ignored)
        try:
            stream.close()
        except OSError as e:
            failure = failure or SampleError("shard_failed", url, None, str(e))
    if failure is not None:
        skip(failure, -1)
    elif index + 1 < start_index:
        skip(SampleError("shard_changed", url, None, f"holds {index + 1} samples but reading "
                         f"resumes at sample {start_index}: rewritten since it was read"), -1)
    elif index < 0:
        skip(SampleError("empty_shard", url, None, "shard holds no samples"), -1)


def _resume_at(stream, url: str, offset: int, start_index: int) -> int:
    """`offset` once `stream` is positioned there, if a tar header lies there; else 0 (the
    stream back at its start)."""
    try:
        stream.seek(offset)
        head = stream.read(512)
        ok = valid_header(head) or _archive_end(stream, head)
        stream.seek(offset if ok else 0)
    except (OSError, ValueError, TarError) as e:
        log.warning("mmdispatch event=resume_offset_failed shard=%s index=%d offset=%d: %s",
                    url, start_index, offset, e)
        stream.seek(0)
        return 0
    return offset if ok else 0


def _archive_end(stream, head: bytes | memoryview, most: int = 1 << 20) -> bool:
    """Whether `head`, the block at a resume offset, and all that follows it are zeros (or it is
    the file's end): the end of the archive, where a reader that sent every sample but was not
    heard finishing the shard stopped. Zeros inside a member (silence) are not the end: more
    bytes follow them. (An archive that ends without its zero blocks is walked again: an
    offset past a file's end reads as nothing too.)"""
    if len(head) != 512 or bytes(head).strip(b"\0"):
        return False
    read = 0
    while read < most:
        chunk = stream.read(64 << 10)
        if not chunk:
            return True
        if bytes(chunk).strip(b"\0"):
            return False
        read += len(chunk)
    return False


def iter_samples(
    urls: Iterable[str], config: ReaderConfig | None = None, *, stats: ErrorStats | None = None
) -> Iterator[SampleRecord]:
    """Counted samples of several shards in order, sharing one set of error counters."""
    config = config or ReaderConfig()
    stats = stats if stats is not None else ErrorStats()
    for url in urls:
        yield from iter_shard(url, config, stats=stats)


__all__ = [
    "ReaderConfig", "SampleBuilder", "SkipSink", "add_reader_arguments", "group_samples", "iter_samples", "iter_shard",
    "printable_key", "quoted_name", "reader_config_from_args", "split_name", "unkeyed_label",
]
