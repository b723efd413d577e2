"""Header-only token counting: how long each image, audio clip and text is for every model phase.

Images are measured from their header (PNG/JPEG hand-parsed, other formats through Pillow's
lazy `Image.open`), audio from its header (hand-parsed WAV/FLAC, `soundfile.info` for the
rest), never decoding pixels or samples: counting must cost little more than reading bytes.
Text is tokenized (`pipeline.tokenize`): the ids are what the trainer receives, so its count is
exact; a fast estimator with a documented, tested error bound serves only `inspect --estimate-text`.
"""

from __future__ import annotations

import io
import json
import logging
import math
import os
import re
import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import soundfile
from PIL import Image

from dispatcher_server.protocol import ANCHOR
from pipeline.headers import (
    JPEG_DECODABLE, HeaderError, flac_header, flac_last_frame_whole, gif_problem, id3v2_end,
    jpeg_problem, jpeg_process_problem, jpeg_size, mp3_header, mp3_xing_problem, png_problem,
    png_size, wav_header,
)
from pipeline.tokenize import (
    ChatTemplateError, TextEncoder, TextTokens, check_chat_template, missing_file, normalize_turn,
)

if TYPE_CHECKING:
    from pipeline.video import VideoConfig


def _jpeg_decodable() -> frozenset[int]:
    """The JPEG processes (SOF markers) this Pillow decodes: lossless (SOF3) too where its
    libjpeg-turbo is 3.0 or newer (checked with Pillow 13 / libjpeg-turbo 3.2), of which
    `jpeg_process_problem` accepts grayscale only (colour decodes to wrong colours)."""
    from PIL import features

    try:
        major = int((features.version("libjpeg_turbo") or "0").split(".")[0])
    except (ValueError, KeyError):
        major = 0
    return JPEG_DECODABLE | {0xC3} if major >= 3 else JPEG_DECODABLE


_JPEG_DECODABLE = _jpeg_decodable()


def _jpeg_body_problem(data: bytes | memoryview) -> str | None:
    return jpeg_process_problem(data, _JPEG_DECODABLE) or jpeg_problem(data)


#: Checks of what follows a header, by image format (WEBP needs none: Pillow's open already
#: refuses a cut file): framing, and for JPEG whether Pillow decodes its coding process at all.
_BODY_CHECKS = {"PNG": png_problem, "JPEG": _jpeg_body_problem, "GIF": gif_problem}

#: What an image member may be, and magic bytes that name the formats it may not.
IMAGE_FORMATS = "JPEG, PNG, WebP or GIF"
_IMAGE_MAGIC = (
    (b"II*\0", "TIFF"), (b"MM\0*", "TIFF"), (b"\0\0\1\0", "ICO"), (b"\xff\x0a", "JPEG XL"),
    (b"\0\0\0\x0cJXL ", "JPEG XL"), (b"\0\0\0\x0cjP  ", "JPEG 2000"), (b"\xff\x4f\xff\x51", "JPEG 2000"),
    (b"8BPS", "Photoshop PSD"), (b"%PDF", "PDF"), (b"<svg", "SVG"), (b"\x76\x2f\x31\x01", "OpenEXR"),
)
#: ISO base media brands (bytes 8..12 after `ftyp`) of still-image formats.
_IMAGE_BRANDS = {b"avif": "AVIF", b"avis": "AVIF", b"heic": "HEIC", b"heix": "HEIC", b"mif1": "HEIF",
                 b"msf1": "HEIF", b"jxl ": "JPEG XL"}

#: What an audio member may be (libsndfile's formats), and magic bytes naming others.
AUDIO_FORMATS = "WAV, FLAC, MP3, Ogg Vorbis or Opus, or another format libsndfile reads (AIFF, CAF, W64...)"
_AUDIO_MAGIC = (
    (b"\x1a\x45\xdf\xa3", "WebM/Matroska"), (b"\x30\x26\xb2\x75\x8e\x66\xcf\x11", "WMA (ASF)"),
    (b"#!AMR", "AMR"), (b"MAC ", "Monkey's Audio (APE)"), (b"wvpk", "WavPack"), (b"MPCK", "Musepack"),
    (b".ra\xfd", "RealAudio"), (b".RMF", "RealMedia"),
)


def _magic_format(data: bytes | memoryview, table) -> str | None:
    """The name in `table` ((magic, name) pairs) of the first magic `data` starts with."""
    head = bytes(data[:16])
    return next((name for magic, name in table if head.startswith(magic)), None)


def _image_format(data: bytes | memoryview) -> str | None:
    """The format an image member's magic bytes name, where it is one images may not be."""
    head = bytes(data[:12])
    if head[4:8] == b"ftyp":
        return _IMAGE_BRANDS.get(head[8:12], f"an ISO media file (brand {head[8:12].decode('latin-1')!r})")
    if head[:2] == b"BM" and head[6:10] == bytes(4):  # BITMAPFILEHEADER: reserved words are 0
        return "BMP"
    return _magic_format(data, _IMAGE_MAGIC)


def _audio_format(data: bytes | memoryview) -> str | None:
    """The format an audio member's magic bytes name, where libsndfile reads no such format."""
    head = bytes(data[:12])
    if head[4:8] == b"ftyp":  # ISO base media: M4A, MP4, 3GP, MOV...
        brand = head[8:12].decode("latin-1").strip()
        return f"an MP4/M4A container (brand {brand!r}: AAC or ALAC audio)"
    if len(head) >= 2 and head[0] == 0xFF and head[1] & 0xF6 == 0xF0:  # ADTS: MPEG layer bits 00
        return "raw AAC (ADTS)"
    return _magic_format(data, _AUDIO_MAGIC)


class CountError(HeaderError):
    """A member cannot be counted; `reason` is a short stable name for error counters."""


class UndecodableError(ValueError):
    """A member whose header counted but whose body does not decode: only the decoder finds it,
    after the sample was planned (a trainer then stands a blank input in for it)."""


_BUFFER_REPR = re.compile(r" ?<_io\.BytesIO object at 0x[0-9a-fA-F]+>")


def library_message(e: Exception) -> str:
    """A decoding library's error text without the in-memory buffer it was handed (a repr with
    an address, which Pillow's and libsndfile's messages name): the caller names the member."""
    return _BUFFER_REPR.sub("", str(e))


@dataclass(kw_only=True, slots=True)
class ImageConfig:
    """Dynamic-resolution ViT resize policy; defaults are Qwen2-VL's.

    Source: Qwen2-VL's `smart_resize` as `qwen_vl_utils` (`vision_process.py`, the loader of the
    Qwen-VL model cards) has it: 14 px patches, 2x2 patch merge (factor 28), min_pixels 56*56, and
    max_pixels 28*28*1280 as the model card recommends. Encoder length = (H/patch)*(W/patch)
    patches, LLM length = that / merge^2. transformers' Qwen2-VL image processor shares the
    defaults but not the rule for thin images: it refuses a side under the factor (its newest
    versions count such images otherwise), where `qwen_vl_utils` rounds the side up to it.
    """

    patch_size: int = 14
    merge_size: int = 2
    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    max_aspect_ratio: float = 200.0  # Qwen2-VL refuses more extreme images
    # Decompression-bomb guard on the *declared* size, checked before any pixel is touched;
    # Pillow's own MAX_IMAGE_PIXELS (~9459x9459). At most twice that (`pillow_pixel_limit`):
    # Pillow refuses to decode more.
    max_header_pixels: int = 89_478_485

    def __post_init__(self) -> None:
        if self.patch_size < 1 or self.merge_size < 1:
            raise ValueError(f"patch_size={self.patch_size} and merge_size={self.merge_size} must be >= 1")
        if not 0 < self.min_pixels <= self.max_pixels:
            raise ValueError(f"need 0 < min_pixels={self.min_pixels} <= max_pixels={self.max_pixels}")
        if self.max_header_pixels < 1:  # every image would be skipped as image_too_large
            raise ValueError(f"max_header_pixels={self.max_header_pixels} must be >= 1")
        decodable = pillow_pixel_limit()
        if decodable is not None and self.max_header_pixels > decodable:
            # counted past it, an image would reach the trainer's decoder and be refused there
            raise ValueError(f"max_header_pixels={self.max_header_pixels} is over {decodable}, the "
                             "most pixels Pillow decodes (2 x PIL.Image.MAX_IMAGE_PIXELS, its "
                             "decompression-bomb limit): trainers would get blank inputs for the "
                             f"images counted past it; give at most {decodable}")


def pillow_pixel_limit() -> int | None:
    """The most pixels an image may have for Pillow to decode it: above 2 x MAX_IMAGE_PIXELS its
    open raises DecompressionBombError (between 1x and 2x it only warns); None when unset."""
    limit = Image.MAX_IMAGE_PIXELS
    return None if limit is None else 2 * int(limit)


#: The longest padded audio window, in seconds (real encoders' are 30 s; 1500, a window in
#: frames given as seconds, is refused).
MAX_PAD_WINDOW_S = 600.0


@dataclass(kw_only=True, slots=True)
class AudioConfig:
    """Audio encoder rates; defaults are Whisper's encoder with Qwen2-Audio's pooling.

    Whisper: 16 kHz, 10 ms hop = 100 mel frames/s, conv stride 2 -> 50 encoder frames/s, 30 s
    windows. Qwen2-Audio pools by 2 -> 25 LLM tokens/s: floor(frames / 2) of them, as its own
    processor counts the clip's <|AUDIO|> tokens (`audio_lengths`). With `pad_window_s` set the encoder is
    costed as padded (every window started is full: Whisper processes 1500 frames per 30 s),
    while the LLM length follows the real duration (padding is masked out before the LLM).
    """

    encoder_frames_per_s: float = 50.0
    llm_tokens_per_s: float = 25.0
    pad_window_s: float | None = None
    max_duration_s: float = 4 * 3600.0  # longer clips are corrupt headers or not training data
    # Telephone speech is 8 kHz, studio masters reach 384 kHz (a few 768 kHz): a header outside
    # this range is corrupt, and its duration cannot be trusted either.
    min_sample_rate: int = 1000
    max_sample_rate: int = 768_000

    def __post_init__(self) -> None:
        if self.encoder_frames_per_s <= 0 or self.llm_tokens_per_s <= 0:
            raise ValueError(
                f"encoder_frames_per_s={self.encoder_frames_per_s} and "
                f"llm_tokens_per_s={self.llm_tokens_per_s} must be > 0"
            )
        if self.pad_window_s is not None and self.pad_window_s <= 0:
            raise ValueError(f"pad_window_s={self.pad_window_s} must be > 0 seconds (unset: no padding)")
        if not self.max_duration_s > 0:
            raise ValueError(f"max_duration_s={self.max_duration_s} must be > 0 seconds")
        if self.pad_window_s is not None and not (
                1 <= self.pad_window_s * self.encoder_frames_per_s and self.pad_window_s <= MAX_PAD_WINDOW_S):
            # A window in frames (a cost file's, calibrate's: Whisper's 1500) given as seconds
            # padded every clip to 25 minutes of frames; one below a frame padded nothing.
            raise ValueError(f"pad_window_s={self.pad_window_s} must be seconds, at least one encoder "
                             f"frame ({1 / self.encoder_frames_per_s:g} s) and at most "
                             f"{MAX_PAD_WINDOW_S:g}: Whisper's window is 30 (its 1500 frames at "
                             f"{self.encoder_frames_per_s:g} frames/s)")
        if not 0 < self.min_sample_rate <= self.max_sample_rate:
            raise ValueError(
                f"need 0 < min_sample_rate={self.min_sample_rate} <= max_sample_rate={self.max_sample_rate}"
            )


#: What a reader does with a sample longer than `TextConfig.max_seq_len`.
OVER_LENGTH = ("skip", "truncate")


@dataclass(kw_only=True, slots=True)
class TextConfig:
    """Text members and how they become token ids.

    Text is tokenized with `tokenizer_path` (an HF `tokenizers` JSON file), or without one by
    the byte-level tokenizer (256 ids, the UTF-8 bytes); either way the count is the number
    of ids the trainer receives. Plain text is all training targets (loss mask 1). A
    conversation is rendered through `chat_template`: the name of one of the tokenizer's own
    named templates (a list in its tokenizer_config.json, or additional_chat_templates/*.jinja
    beside it; a name it shares with a built-in is the tokenizer's), a built-in name
    (`chatml`), a .jinja file or a tokenizer_config.json; unset, the tokenizer's own template
    (chat_template.jinja, else the `chat_template` of the tokenizer_config.json beside the
    tokenizer file; of named templates, "tool_use" for a conversation given `tools` where
    there is one, else "default", as transformers picks), else ChatML. Only its
    assistant tokens are targets. Several
    text members of one sample are concatenated in natural name order, without separator.

    With `estimate` (`mmdispatch inspect --estimate-text` only: no ids, approximate counts)
    the estimator charges one token per `ascii_bytes_per_token` ASCII characters (the usual ~4
    characters per BPE token of English) plus `tokens_per_non_ascii_char` per non-ASCII
    character (CJK runs near one token per character). Against a byte-level BPE trained in
    the tests on Python's documentation it is within 15% in total, with median per-text error
    under 20% and 95th percentile under 45% for texts of 100+ characters. It costs two C-speed
    `len` calls, versus ~1 us per word for a regex pre-tokenizer.
    JSON members use the first of `json_fields` present, or are a list of turns themselves; a
    list value is a conversation of
    {role|from, content|value} turns (ShareGPT's human/gpt are user/assistant), each costing the
    estimator `chat_turn_overhead` extra tokens (ChatML's `<|im_start|>role\\n ... <|im_end|>\\n`).
    """

    tokenizer_path: str | None = None
    chat_template: str | None = None
    estimate: bool = False
    json_fields: tuple[str, ...] = ("text", "caption", "conversations", "messages")
    chat_turn_overhead: int = 5
    ascii_bytes_per_token: float = 4.0
    tokens_per_non_ascii_char: float = 1.0
    # Largest text member, raw or inflated from .gz (zip-bomb guard); larger ones are skipped as
    # `text_too_large` before decoding. 4 MiB is at most 4M byte-level tokens (~1M BPE tokens),
    # beyond any model's context, and a sample's tokens travel in one message header at 5 bytes
    # a token (32 MiB limit in the wire protocol).
    max_text_bytes: int = 4 << 20
    # A token of the tokenizer (an added or special token) standing, in the text, where an item
    # of that modality goes in the LLM sequence (LLaVA's `<image>`, Qwen2-VL's `<|image_pad|>`):
    # unset, a sample's items come before its text. See `Counter.place_items`.
    image_placeholder: str | None = None
    video_placeholder: str | None = None
    audio_placeholder: str | None = None
    # The longest sample in LLM tokens (text plus every item's), as the model's context
    # (HF `model_max_length`); unset, no limit. A longer one is skipped (`over_length` "skip")
    # or loses text from its end (`truncate`, HF's right side): see `kept_text_len`.
    max_seq_len: int | None = None
    over_length: str = "skip"

    def __post_init__(self) -> None:
        if self.max_seq_len is not None and self.max_seq_len < 1:
            raise ValueError(f"max_seq_len={self.max_seq_len} must be >= 1 LLM tokens (unset: no limit)")
        if self.over_length not in OVER_LENGTH:
            raise ValueError(f"over_length={self.over_length!r} must be one of {', '.join(OVER_LENGTH)}")
        if self.over_length == "truncate" and self.max_seq_len is None:
            # refused, not warned: a job asking to truncate would otherwise run with no limit at all
            raise ValueError("over_length='truncate' needs max_seq_len: give the longest sample in "
                             "LLM tokens (e.g. max_seq_len=4096), or drop over_length")
        given = list(self.placeholders.values())
        for modality, token in self.placeholders.items():
            if not token:
                raise ValueError(f"--{modality}-placeholder ([counting] {modality}_placeholder) is "
                                 "empty: give the token, or leave it unset (items come before "
                                 "the text)")
        if len(set(given)) != len(given):
            raise ValueError(f"placeholders {self.placeholders} name one token for two modalities: "
                             "give each modality its own token")
        if self.ascii_bytes_per_token <= 0:
            raise ValueError(f"ascii_bytes_per_token={self.ascii_bytes_per_token} must be > 0")
        if self.max_text_bytes < 1:
            raise ValueError(f"max_text_bytes={self.max_text_bytes} must be >= 1")
        # Checked here, not at first use: a reader would otherwise fail only once a shard arrives.
        if self.tokenizer_path is not None and not os.path.isfile(self.tokenizer_path):
            raise ValueError(f"tokenizer file {self.tokenizer_path!r} "
                             f"{missing_file(self.tokenizer_path)}: pass an HF "
                             f"tokenizers JSON file (a model's tokenizer.json), or leave --tokenizer "
                             f"unset for the byte-level tokenizer")
        check_chat_template(self.chat_template, self.tokenizer_path)

    @property
    def placeholders(self) -> dict[str, str]:
        """modality -> its placeholder token, for the modalities that have one."""
        return {m: t for m, t in (("image", self.image_placeholder), ("video", self.video_placeholder),
                                  ("audio", self.audio_placeholder)) if t is not None}


#: modality -> the flag of its placeholder token
PLACEHOLDER_FLAGS = {"image": "--image-placeholder", "video": "--video-placeholder",
                     "audio": "--audio-placeholder"}


def placeholder_identity(text: TextConfig) -> str:
    """The `placeholders` input rule: where items go in the LLM sequence ("none": before the
    text), so readers placing items by other tokens are refused like another tokenizer."""
    marks = text.placeholders
    return ";".join(f"{m}={t}" for m, t in marks.items()) if marks else "none"


def length_identity(text: TextConfig) -> str:
    """The `max_seq_len` input rule ("none", or e.g. "4096 truncate"): readers cutting samples
    at another length, or skipping where others truncate, send trainers other sequences."""
    return "none" if text.max_seq_len is None else f"{text.max_seq_len} {text.over_length}"


def item_ends(items: list) -> list[int]:
    """Where each item ends in its sample's LLM sequence, in `items` order: items without an
    anchor come first, then the text, each anchored item after the text tokens before its
    placeholder (its anchor less the anchored items before it: their placeholders were removed)."""
    ends = [0] * len(items)
    first = 0  # LLM tokens of the items before the text
    for k, it in enumerate(items):
        if ANCHOR not in it.meta:
            first += it.llm_len
            ends[k] = first
    placed = 0  # LLM tokens of the anchored items up to this one
    anchored = sorted((k for k, it in enumerate(items) if ANCHOR in it.meta),
                      key=lambda k: items[k].meta[ANCHOR])
    for n, k in enumerate(anchored):
        placed += items[k].llm_len
        ends[k] = first + placed + items[k].meta[ANCHOR] - n
    return ends


def kept_text_len(text_len: int, items: list, limit: int, policy: str) -> int:
    """The text tokens a sample keeps within `limit` LLM tokens: all of them when it fits; with
    `policy` "truncate" the first `limit` less its items' tokens, as long as no item reaches
    past the limit (an item is never cut nor dropped). CountError `too_long` otherwise."""
    items_llm = sum(it.llm_len for it in items)
    total = text_len + items_llm
    if total <= limit:
        return text_len
    if policy == "skip":
        raise CountError("too_long", f"the sample is {total} LLM tokens, over --max-seq-len "
                                     f"{limit}: raise --max-seq-len, or keep its start with "
                                     "--over-length truncate")
    ends = item_ends(items)
    past = next((k for k, end in enumerate(ends) if end > limit), None)
    if past is not None:
        it = items[past]
        start = ends[past] - it.llm_len
        where = "inside" if start < limit else "before"
        raise CountError("too_long", f"the sample is {total} LLM tokens, over --max-seq-len {limit}, "
                                     f"and the cut would fall {where} {it.modality} member "
                                     f"{it.member!r} (its LLM tokens {start} to {ends[past]}), which "
                                     "is never cut nor dropped: raise --max-seq-len")
    return limit - items_llm


def _video_config() -> VideoConfig:
    from pipeline.video import VideoConfig  # pipeline.video builds on this module's resize rule

    return VideoConfig()


@dataclass(kw_only=True, slots=True)
class CountingConfig:
    """All counting rules; every default mirrors a real model (see each section)."""

    image: ImageConfig = field(default_factory=ImageConfig)
    audio: AudioConfig = field(default_factory=AudioConfig)
    text: TextConfig = field(default_factory=TextConfig)
    video: VideoConfig = field(default_factory=_video_config)


def smart_resize(height: int, width: int, cfg: ImageConfig) -> tuple[int, int]:
    """Qwen2-VL's resize: fit [min_pixels, max_pixels], keep aspect, sides multiple of patch*merge.

    Mirrors `qwen_vl_utils.smart_resize` (not transformers' image processor, which refuses a side
    under the factor), including Python's round-half-to-even and a side shorter than the factor
    rounding up to the factor, so counts match what that loader feeds the model.
    """
    factor = cfg.patch_size * cfg.merge_size
    if min(height, width) < 1:
        raise CountError("bad_image", f"image has empty side: {width}x{height}")
    if max(height, width) / min(height, width) > cfg.max_aspect_ratio:
        raise CountError("bad_image", f"aspect ratio of {width}x{height} exceeds {cfg.max_aspect_ratio}")
    h_bar = max(factor, round(height / factor) * factor)
    w_bar = max(factor, round(width / factor) * factor)
    if h_bar * w_bar > cfg.max_pixels:
        beta = math.sqrt(height * width / cfg.max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < cfg.min_pixels:
        beta = math.sqrt(cfg.min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def image_lengths(width: int, height: int, cfg: ImageConfig) -> tuple[int, int]:
    """(encoder patches, LLM tokens) of an image of the given size under the resize policy."""
    h_bar, w_bar = smart_resize(height, width, cfg)
    patches = (h_bar // cfg.patch_size) * (w_bar // cfg.patch_size)
    return patches, patches // (cfg.merge_size * cfg.merge_size)


def _ceil(x: float) -> int:
    """ceil of a duration times a rate, without its floating-point noise: 35520 samples at
    16 kHz are 2.22 s, and 2.22 * 50 is 111.00000000000001 (111 frames: Whisper's 35520 / 320)."""
    return math.ceil(round(x, 9))


def audio_lengths(duration_s: float, cfg: AudioConfig) -> tuple[int, int]:
    """(encoder frames, LLM tokens) of a clip; the encoder is costed padded when configured.

    Encoder frames are the clip's duration at `encoder_frames_per_s`, rounded up: Whisper's
    mel frames are ceil(samples / 160) at 16 kHz, its encoder's ceil(mel / 2). Where the encoder
    rate is a whole multiple k of `llm_tokens_per_s` the LLM tokens are those frames pooled by
    k, rounded down, as Qwen2-Audio's average pool of 2 (`_get_feat_extract_output_lengths`:
    (frames - 2) // 2 + 1) gives them; otherwise the duration at `llm_tokens_per_s`, rounded up.
    At least one of each."""
    enc = max(1, _ceil(duration_s * cfg.encoder_frames_per_s))
    pool = cfg.encoder_frames_per_s / cfg.llm_tokens_per_s
    if pool >= 1 and pool == int(pool):
        llm = max(1, enc // int(pool))
    else:
        llm = max(1, _ceil(duration_s * cfg.llm_tokens_per_s))
    if cfg.pad_window_s is not None:
        windows = max(1, _ceil(duration_s / cfg.pad_window_s))
        return _ceil(windows * cfg.pad_window_s * cfg.encoder_frames_per_s), llm
    return enc, llm


def _utf8(data: bytes | memoryview, what: str) -> str:
    try:
        text = str(data, "utf-8")
    except UnicodeDecodeError as e:
        head = bytes(data[:2])
        if head in (b"\xff\xfe", b"\xfe\xff"):  # a UTF-16 byte-order mark (Windows "Unicode")
            order = "little" if head == b"\xff\xfe" else "big"
            raise CountError("bad_text", f"{what} is UTF-16 ({order}-endian, byte-order mark "
                                         f"{head.hex(' ').upper()}), not UTF-8: re-encode it as "
                                         "UTF-8 (iconv -f UTF-16 -t UTF-8)") from None
        if _wide_text(data):
            raise CountError("bad_text", f"{what} is not UTF-8 ({e.reason} at byte {e.start}){_WIDE}") from None
        raise CountError("bad_text", f"{what} is not UTF-8 ({e.reason} at byte {e.start})") from None
    at = text.find("\0")
    if at >= 0:  # valid UTF-8, but no text: ASCII in UTF-16/32 without a byte-order mark, binary
        why = _WIDE if _wide_text(data) else ": binary data in a text member? remove them"
        raise CountError("bad_text", f"{what} holds NUL characters (U+0000, the first at character "
                                     f"{at}){why}")
    return text


#: Why a text whose bytes are a quarter or more NULs is not UTF-8, and the fix.
_WIDE = (": UTF-16 or UTF-32 without a byte-order mark (every other byte NUL)? re-encode it as "
         "UTF-8 (iconv -f UTF-16LE -t UTF-8)")


def _wide_text(data: bytes | memoryview) -> bool:
    """Whether `data` looks like UTF-16/UTF-32 text: a quarter or more of its first 4 KiB NULs."""
    head = bytes(data[:4096])
    return len(head) >= 2 and head.count(0) * 4 >= len(head)


def gunzip(data: bytes | memoryview, max_bytes: int) -> bytes:
    """Decompress a gzip file, refusing to inflate beyond `max_bytes`.

    Concatenated gzip members (`gzip -c a >> b`) are one file, as gzip itself reads them: the
    first member alone would silently undercount the text. Trailing NUL padding is tolerated.
    """
    out = b""
    rest = data
    try:
        while True:
            inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
            out += inflater.decompress(rest, max_bytes + 1 - len(out))
            if len(out) > max_bytes:
                raise CountError("text_too_large", f"gzip member inflates beyond max_text_bytes={max_bytes}")
            if not inflater.eof:
                raise CountError("bad_gzip", "gzip member is truncated")
            rest = inflater.unused_data
            if not rest.strip(b"\0"):
                return out
    except zlib.error as e:
        raise CountError("bad_gzip", f"gzip member is corrupt: {e}") from None


def _flac_unreadable(data: bytes | memoryview) -> str | None:
    """Why libsndfile cannot read a FLAC stream to its last sample (None: it can). Seeking there
    decodes the frames it lands on (a fraction of a millisecond); a cut stream fails it."""
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as f:
            if f.frames > 0:
                f.seek(f.frames - 1)
                if len(f.read(1)) == 1:
                    return None
    except Exception as e:  # libsndfile reports every malformed input as a RuntimeError
        return f"cannot be read to its last sample: {library_message(e)} (truncated or corrupt)"
    return "cannot be read to its last sample (truncated or corrupt)"


def _check_flac_tag_readable(data: bytes | memoryview, tag: int) -> None:
    """CountError unless libsndfile (the trainer's decoder) opens a FLAC stream behind `tag`
    bytes of ID3v2 tags: it skips one tag without a footer, and refuses a footer or a second tag."""
    try:
        soundfile.info(io.BytesIO(data))
    except Exception as e:  # libsndfile reports every malformed input as a RuntimeError
        why = library_message(e).strip().rstrip(".")
        raise CountError("bad_audio", f"FLAC behind {tag} bytes of ID3v2 tags that libsndfile does "
                                      f"not read ({why}; it reads one tag without a footer): strip "
                                      "the tags, e.g. ffmpeg -i IN -map_metadata -1 -c:a copy "
                                      "OUT.flac") from None


#: libsndfile's frame count for a stream that does not state its length (a FLAC whose STREAMINFO
#: total is 0): not a duration.
_UNSTATED_FRAMES = 2**63 - 1


def _sndfile_header(data: bytes | memoryview) -> tuple[int, int, float]:
    """(sample_rate, channels, duration_s) from libsndfile, for what the hand parsers leave."""
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception as e:  # libsndfile reports every malformed input as a RuntimeError
        real = _audio_format(data)
        if real is not None:
            raise CountError("bad_audio", f"this is {real}, which audio members may not be (they may be "
                                          f"{AUDIO_FORMATS}): convert it, e.g. ffmpeg -i IN OUT.flac") from None
        message = library_message(e)
        if "Format not recognised" in message:
            message += f" Audio members may be {AUDIO_FORMATS}."
        raise CountError("bad_audio", f"unreadable audio header: {message}") from None
    rate, channels, frames = info.samplerate, info.channels, info.frames
    if rate <= 0 or frames < 0:
        raise CountError("bad_audio", f"audio header declares rate={rate} frames={frames}")
    if frames == _UNSTATED_FRAMES:
        # soundfile.read (the trainer's decoder) cannot read such a stream either
        raise CountError("bad_audio", "audio stream does not state its length (a FLAC with "
                                      "total samples 0, as encoders writing to a pipe leave): "
                                      "re-encode it to a file (flac -f, or ffmpeg -i)")
    return rate, channels, frames / rate


def _check_mp3_read_whole(data: bytes | memoryview, header: tuple[int, int, float],
                          cfg: AudioConfig) -> None:
    """CountError unless libsndfile, the trainers' decoder, reads an MP3 without a Xing/Info
    frame to as many encoder rows as its frames hold (`header`, from walking them). Without such
    a frame it reads up to its own estimate of the length, made from the bytes and the first
    frame's bitrate, and stops there: a variable bitrate stream whose first frame is richer than
    the rest (its header stripped, a stream rip) would decode to a prefix, and train on a blank
    input in its planned place."""
    duration = header[2]
    try:
        info = soundfile.info(io.BytesIO(data))
    except Exception as e:  # libsndfile reports every malformed input as a RuntimeError
        raise CountError("bad_audio", f"MP3 that libsndfile (the trainers' decoder) cannot open: "
                                      f"{library_message(e)}") from None
    read = info.frames / info.samplerate if info.samplerate > 0 else 0.0
    # An estimate above the frames is harmless: the decoder stops at the last one.
    if read < duration and audio_lengths(read, cfg) != audio_lengths(duration, cfg):
        raise CountError("bad_audio", f"MP3 without a Xing/Info header: libsndfile (the trainers' "
                                      f"decoder) reads only its estimate of {read:.2f} s of the "
                                      f"{duration:.2f} s its frames hold (a variable bitrate "
                                      f"stream without its header); give it one: ffmpeg -i in.mp3 -c:a "
                                      f"copy out.mp3")


class Counter:
    """Counts members under one `CountingConfig`; holds the loaded tokenizer and chat template."""

    def __init__(self, config: CountingConfig) -> None:
        self.config = config
        t = config.text
        self.encoder = None if t.estimate else TextEncoder.load(t.tokenizer_path, t.chat_template)
        self._pil_formats = ["JPEG", "PNG", "WEBP", "GIF"]
        # modality -> (placeholder id, token); an estimate has no ids to find them in
        self.placeholders: dict[str, tuple[int, str]] = {} if self.encoder is None else {
            m: (self.encoder.token_id(tok, PLACEHOLDER_FLAGS[m]), tok) for m, tok in t.placeholders.items()}
        if self.encoder is None and t.placeholders:
            logging.getLogger("mmdispatch.counting").warning(
                "mmdispatch event=placeholders_ignored flags=%s why='text is only estimated: "
                "placeholders are neither checked nor removed, and count as text' fix='drop "
                "--estimate-text to count what readers send'",
                ",".join(PLACEHOLDER_FLAGS[m] for m in t.placeholders))

    # -- placeholders ---------------------------------------------------------------------
    def place_items(self, tokens: TextTokens, items: list) -> TextTokens:
        """The text without its placeholders, each item of a modality with placeholders
        anchored at its own (`meta["anchor"]`: its placeholder's position in the text's ids,
        placeholders counted: the items placed before it stand for the placeholders before it).

        The k-th item of a modality (natural name order of its members, as items are sent)
        takes the k-th placeholder of that modality; a modality with none in the text keeps its
        items before the text (no anchor). Other counts cannot be matched: CountError `placeholder_mismatch`.
        """
        ids = tokens.ids
        found, where = [], []
        for modality, (pid, tok) in self.placeholders.items():
            at = np.flatnonzero(ids == pid)
            if not len(at):
                continue
            mine = [it for it in items if it.modality == modality]
            if len(at) != len(mine):
                raise CountError("placeholder_mismatch",
                                 f"the text holds {len(at)} {tok!r} placeholders for {len(mine)} "
                                 f"{modality} members: each {modality} needs its own placeholder, "
                                 "or the text none")
            found.append(mine)
            where.append(at)
        if not found:
            return tokens
        at = np.concatenate(where)
        # Each item's anchor is its placeholder's position in the ids as they were: it orders
        # items whose placeholders stand side by side (`<audio><image>`) as they were written.
        for it, anchor in zip((it for mine in found for it in mine), at.tolist()):
            it.meta[ANCHOR] = anchor
        keep = np.ones(len(ids), dtype=bool)
        keep[at] = False
        return TextTokens(ids[keep], tokens.mask[keep])

    # -- images ---------------------------------------------------------------------------
    def image(self, data: bytes | memoryview) -> tuple[int, int, dict]:
        """(encoder length, LLM length, meta) from the image header."""
        cfg = self.config.image
        size = png_size(data)
        fmt = "PNG"
        if size is None:
            size, fmt = jpeg_size(data), "JPEG"
        if size is not None:
            width, height = size
        else:
            width, height, fmt = self._pil_size(data)
        if width * height > cfg.max_header_pixels:
            raise CountError(
                "image_too_large",
                f"image header declares {width}x{height} pixels, over max_header_pixels={cfg.max_header_pixels}",
            )
        enc, llm = image_lengths(width, height, cfg)
        # A header can be intact over a cut or garbage body; the trainer's decoder would fail on
        # it after the sample was planned, so the cheap framing checks run here.
        check = _BODY_CHECKS.get(fmt)
        problem = check(data) if check is not None else None
        if problem is not None:
            raise CountError("bad_image", f"{fmt} {width}x{height}: {problem}")
        return enc, llm, {"width": width, "height": height, "format": fmt}

    def _pil_size(self, data: bytes | memoryview) -> tuple[int, int, str]:
        try:
            # Lazy open: parses the header only; Pillow allocates pixels at .load(), never here.
            with Image.open(io.BytesIO(data), formats=self._pil_formats) as im:
                return im.size[0], im.size[1], im.format
        except Image.DecompressionBombError as e:
            raise CountError("image_too_large", str(e)) from None
        except Exception as e:  # Pillow raises many types on garbage: all mean "not an image"
            real = _image_format(data)
            if real is not None:
                raise CountError("bad_image", f"this is {real}, which image members may not be (they "
                                              f"may be {IMAGE_FORMATS}): convert it") from None
            raise CountError("bad_image", f"unreadable image header: {library_message(e)}") from None

    # -- audio ----------------------------------------------------------------------------
    def audio(self, data: bytes | memoryview) -> tuple[int, int, dict]:
        """(encoder length, LLM length, meta) from the audio header."""
        cfg = self.config.audio
        # An ID3v2 tag in front of a FLAC stream (taggers write them; libsndfile skips one):
        # the FLAC checks run on the stream behind it, or a cut file would count at full length.
        tag = id3v2_end(data)
        stream = memoryview(data)[tag:] if tag else data
        try:
            header = wav_header(data)
            flac = header is None and (header := flac_header(stream)) is not None
            walked = header is None and (header := mp3_header(data)) is not None
        except HeaderError as e:
            raise CountError(e.reason, str(e)) from None
        if walked:
            _check_mp3_read_whole(data, header, cfg)
        if header is None and not flac:
            # libsndfile states the length a Xing/Info frame claims, however much of it is there
            problem = mp3_xing_problem(data)
            if problem is not None:
                raise CountError("bad_audio", f"MP3 {problem}")
        if flac and tag:
            _check_flac_tag_readable(data, tag)
        if flac and not flac_last_frame_whole(stream):
            # WAV's data chunk size is checked against the bytes present; a FLAC's frames have no
            # such total, and one cut short would fail the trainer's decoder after planning. A last
            # frame not vouched whole by its CRC is left to libsndfile to read.
            problem = _flac_unreadable(data)
            if problem is not None:
                raise CountError("bad_audio", f"FLAC {problem}")
        rate, channels, duration = header if header is not None else _sndfile_header(data)
        if not cfg.min_sample_rate <= rate <= cfg.max_sample_rate:
            raise CountError(
                "bad_audio",
                f"audio header declares {rate} Hz, outside [{cfg.min_sample_rate}, {cfg.max_sample_rate}]",
            )
        if duration > cfg.max_duration_s:
            raise CountError("bad_audio", f"audio lasts {duration:.0f} s, over the {cfg.max_duration_s:g} s "
                                          f"limit (--max-clip-seconds; raise it for longer recordings)")
        if duration <= 0:
            raise CountError("bad_audio", "audio header states no samples: the clip is empty or truncated")
        enc, llm = audio_lengths(duration, cfg)
        return enc, llm, {"duration_s": duration, "sample_rate": rate, "channels": channels}

    # -- text -----------------------------------------------------------------------------
    def text(self, data: bytes | memoryview, ext: str, what: str, *,
             as_json: bool | None = None) -> TextTokens:
        """Token ids and loss mask of a text or JSON member; JSON without a text field gives none."""
        if self.encoder is None:
            raise ValueError("TextConfig.estimate counts text without ids: use estimate_text")
        return self.text_of(self.member_text(data, ext, what, as_json), what)

    def text_of(self, value: str | list[dict] | EmptyField | None, what: str,
                where: dict | None = None) -> TextTokens:
        """Token ids and loss mask of a `member_text` value (None, `EmptyField`: JSON without
        text); `where`, the sample's shard and key, for what its conversation logs."""
        if value is None or isinstance(value, EmptyField):
            return TextTokens.empty()  # metadata JSON: carried as payload, not text
        if isinstance(value, str):
            return self.encoder.plain(value)
        try:
            return self.encoder.conversation(value, **getattr(value, "context", {}), where=where)
        except ChatTemplateError as e:
            raise CountError("chat_template", f"{what}: {e}") from None

    def estimate_text(self, data: bytes | memoryview, ext: str, what: str, *,
                      as_json: bool | None = None) -> int:
        """Approximate tokens of a text or JSON member by the estimator (no tokenizer run)."""
        return self.estimate_of(self.member_text(data, ext, what, as_json))

    def estimate_of(self, value: str | list[dict] | EmptyField | None) -> int:
        """Approximate tokens of a `member_text` value by the estimator."""
        if value is None or isinstance(value, EmptyField):
            return 0
        if isinstance(value, str):
            return estimate_tokens(value, self.config.text)
        return (sum(estimate_tokens(_content_text(t["content"]), self.config.text) for t in value)
                + self.config.text.chat_turn_overhead * len(value))

    @staticmethod
    def sample_texts(values: list[tuple[str | list[dict] | None, str]]
                     ) -> list[tuple[str | list[dict] | None, str]]:
        """A sample's (`member_text` value, what) pairs as its text: a JSON member's plain
        text/caption field (`FieldText`) counts only when the sample has no text member, as
        img2dataset's `key.txt` beside `key.json` (whose `caption` repeats it) would otherwise
        count the caption twice. A blank text member (0 bytes, or white space) holds nothing to
        count twice: the caption counts, in its place."""
        if any(isinstance(v, str) and not isinstance(v, FieldText) and v.strip() for v, _ in values):
            return [(v, what) for v, what in values if not isinstance(v, FieldText)]
        if any(isinstance(v, FieldText) for v, _ in values):  # blank text members beside it: none
            return [(v, what) for v, what in values
                    if isinstance(v, FieldText) or not (isinstance(v, str) and not v.strip())]
        return values

    def member_text(self, data: bytes | memoryview, ext: str, what: str,
                     as_json: bool | None = None) -> str | list[dict] | EmptyField | None:
        """A member's plain text, its conversation turns ({"role", "content"} strings), None for
        JSON that holds none of `json_fields` (metadata: carried as payload, not text), or
        `EmptyField` for JSON whose text fields are there but empty (no text either).
        `as_json`: the member is JSON (a conversation-kind member); None: when `ext` is "json"."""
        cfg = self.config.text
        if len(data) > cfg.max_text_bytes:
            raise CountError(
                "text_too_large", f"{what} holds {len(data)} bytes, over max_text_bytes={cfg.max_text_bytes}"
            )
        text = _utf8(data, what)
        if text.startswith("\ufeff"):  # a byte-order mark (Windows editors) marks, it says nothing
            text = text[1:]
        if not ((ext == "json") if as_json is None else as_json):
            return text
        if not text.strip():  # a 0-byte JSON (a writer killed mid-way): no text, as a 0-byte .txt
            return ""
        try:
            obj = json.loads(text)
        except ValueError as e:
            raise CountError("bad_json", f"{what} is not valid JSON: {e}") from None
        except RecursionError:
            raise CountError("bad_json", f"{what} nests arrays or objects deeper than the JSON "
                                         "parser allows (about 1000 levels)") from None
        if isinstance(obj, list):  # a conversation: the list of turns itself
            return Conversation(_turn(turn, what) for turn in obj)
        if not isinstance(obj, dict):
            raise CountError("bad_json", f"{what} holds {json_kind(obj)}, expected an object or a list of turns")
        # the first of the fields that holds something: {"text": "", "caption": "..."} is a caption
        name = next((f for f in cfg.json_fields if not _blank(obj.get(f))), None)
        if name is None:
            empty = next((f for f in cfg.json_fields if f in obj), None)
            return None if empty is None else EmptyField(empty, json.dumps(obj[empty]))
        value = obj[name]
        if isinstance(value, str):
            return FieldText(_sendable(value, what))
        if isinstance(value, list):
            return Conversation((_turn(turn, what) for turn in value),
                                {k: obj[k] for k in _CONTEXT_FIELDS if obj.get(k) is not None})
        raise CountError("bad_json", f"{what} field {name!r} holds {json_kind(value)}, expected text or turns")


def _sendable(text: str, what: str) -> str:
    """`text`, refused if a JSON escape left an unpaired surrogate: it cannot be encoded as
    UTF-8, so it could be neither counted nor sent."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise CountError("bad_text", f"{what} escapes an unpaired surrogate at character {e.start}") from None
    return text


def _blank(value: object) -> bool:
    """Whether a JSON text field holds no text: null, white space alone, or an empty list."""
    if isinstance(value, str):
        return not value or value.isspace()
    return value is None or value == []


class EmptyField(NamedTuple):
    """`member_text` of a JSON member whose text field is there but empty (`{"caption": ""}`,
    `{"conversations": []}`, null): no text, as for metadata, but the field is named."""

    field: str
    value: str  # as JSON writes it: "", [] or null


def json_kind(value: object) -> str:
    """What a parsed JSON value is, in words, with its article: "a string", "a number", "an
    object", "an empty list", "null"."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"[:60]
    if isinstance(value, str):
        return "an empty string" if not value else "a string"
    if isinstance(value, list):
        return "an empty list" if not value else "a list"
    return "an empty object" if not value else "an object"


class FieldText(str):
    """A JSON member's plain text field (`text`, `caption`): the sample's text only when it
    has no text member (`Counter.sample_texts`)."""


#: A conversation object's top-level fields that `apply_chat_template` passes to the template.
_CONTEXT_FIELDS = ("tools", "documents")


class Conversation(list):
    """A conversation's turns, with `context`: the sample's `tools` and `documents` when its
    JSON gives them (the template renders them, as transformers' `apply_chat_template`)."""

    def __init__(self, turns=(), context: dict | None = None) -> None:
        super().__init__(turns)
        self.context = context or {}


def _content_text(content: object) -> str:
    """The text of a turn's content: a string, or the text parts of a content list."""
    if isinstance(content, list):
        return "".join(p["text"] for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def _turn(turn: object, what: str) -> dict:
    """A conversation turn as chat templates take it: "role" (normalized) and "content" (a
    string, or OpenAI-style content parts as given), with every other field of the turn kept
    (`tool_calls`, `tool_call_id`, `name`, `reasoning_content`, ...), as transformers passes
    them; an assistant turn of tool calls alone has content ""."""
    if not isinstance(turn, dict):
        raise CountError("bad_json", f"{what} conversation turn is {json_kind(turn)}, expected an object")
    role, content = normalize_turn(turn)
    if role is None:
        raise CountError("bad_json", f"{what} conversation turn has no role/from string")
    if isinstance(content, list):  # OpenAI-style parts: {"type": "text", "text": ...}, {"type": "image"}
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                raise CountError("bad_json", f"{what} conversation turn's content list holds "
                                             f"{json_kind(part)} ({str(part)[:40]!r}), expected "
                                             "parts such as {\"type\": \"text\", \"text\": ...}")
            if part["type"] == "text":
                if not isinstance(part.get("text"), str):
                    raise CountError("bad_json", f"{what} conversation turn has a text part without a text string")
                _sendable(part["text"], what)
    elif content is None and turn.get("tool_calls"):
        content = ""
    elif not isinstance(content, str):
        raise CountError("bad_json", f"{what} conversation turn has no content/value text")
    else:
        content = _sendable(content, what)
    out = {k: v for k, v in turn.items() if k not in ("role", "from", "content", "value", "weight")}
    out["role"], out["content"] = role, content
    weight = turn.get("weight")
    if weight is not None:  # ShareGPT's (axolotl's) per-turn weight: 0 leaves the turn untrained
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0:
            raise CountError("bad_json", f"{what} conversation turn has weight {weight!r}, "
                                         "expected a number >= 0")
        out["weight"] = weight
    return out


def estimate_tokens(text: str, cfg: TextConfig, num_bytes: int | None = None) -> int:
    """Fast token estimate from character statistics only (C-speed str methods, no regex)."""
    if not text:
        return 0
    num_chars = len(text)
    if num_bytes is None:
        num_bytes = num_chars if text.isascii() else len(text.encode("utf-8"))
    # Every non-ASCII char takes 2-4 UTF-8 bytes; assume 3 (the CJK case) to split the two.
    non_ascii = min(num_chars, (num_bytes - num_chars) // 2)
    est = (num_chars - non_ascii) / cfg.ascii_bytes_per_token + non_ascii * cfg.tokens_per_non_ascii_char
    return max(1, math.ceil(est))


__all__ = [
    "AudioConfig", "Conversation", "CountError", "Counter", "CountingConfig", "EmptyField", "FieldText",
    "ImageConfig",
    "OVER_LENGTH", "PLACEHOLDER_FLAGS", "TextConfig",
    "audio_lengths", "estimate_tokens", "gunzip", "image_lengths", "item_ends", "json_kind", "kept_text_len",
    "length_identity", "pillow_pixel_limit", "placeholder_identity", "smart_resize", "wav_header",
]
