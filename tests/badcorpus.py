"""A generated corpus of broken shards, each a named case with the outcome a reader must report.

Shards are written byte by byte (hand-made tar headers, hand-cut gzip and media files) so the
damage lands exactly where a case says; bad samples sit between good ones in the same shard.
`write_corpus(dir)` writes every case and returns what each must yield; tests compare.
"""

from __future__ import annotations

import gzip
import io
import os
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import soundfile
from PIL import Image

#: Size of the huge-text case: far over `TextConfig.max_text_bytes`, the documented limit.
HUGE_TEXT_BYTES = 50 << 20

_BLOCK = 512


@dataclass(frozen=True, slots=True, kw_only=True)
class CorpusShard:
    """One written case: where it is and what reading it must produce."""

    case: str
    path: str
    reason: str  # reason code of pipeline.errors.REASONS the reader must count, or "ok"
    good_keys: tuple[str, ...]  # keys the reader yields, in order
    bad_key: str | None  # key the error names; None for shard-level faults (and "ok" cases)
    num_before_bad: int  # good samples in the shard before the failure (all of them if none)
    what: str  # what is broken, in words


# -- building blocks -------------------------------------------------------------------------
def tar_header(name: bytes, size: int, kind: bytes = b"0", *, size_field: bytes | None = None,
               link: bytes = b"") -> bytes:
    """A ustar header block with a correct checksum (so only the damage a case adds is wrong)."""
    h = bytearray(_BLOCK)
    h[: len(name)] = name
    h[157 : 157 + len(link)] = link
    h[100:108] = b"0000644\0"
    h[108:116] = h[116:124] = b"0000000\0"
    h[124:136] = size_field if size_field is not None else b"%011o\0" % size
    h[136:148] = b"00000000000\0"
    h[156:157] = kind
    h[257:265] = b"ustar\x0000"
    h[148:156] = b" " * 8
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


def tar_member(name: str | bytes, data: bytes, kind: bytes = b"0") -> bytes:
    raw = name.encode() if isinstance(name, str) else name
    return tar_header(raw, len(data), kind) + data + bytes(-len(data) % _BLOCK)


def tar_bytes(members: list[tuple[str | bytes, bytes]], *, end: bool = True) -> bytes:
    """A complete archive (with its two zero end blocks unless `end` is False)."""
    return b"".join(tar_member(n, d) for n, d in members) + (bytes(2 * _BLOCK) if end else b"")


def _text(key: str) -> list[tuple[str, bytes]]:
    return [(f"{key}.txt", f"a perfectly fine caption for {key}".encode())]


def jpeg(width: int, height: int) -> bytes:
    out = io.BytesIO()
    pixels = np.random.default_rng(width * 7 + height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, "JPEG")
    return out.getvalue()


def png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("L", (width, height), 9).save(out, "PNG")
    return out.getvalue()


def _pillow(width: int, height: int, fmt: str) -> bytes:
    out = io.BytesIO()
    pixels = np.random.default_rng(width + height).integers(0, 256, (height, width, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(out, fmt)
    return out.getvalue()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_ihdr(width: int, height: int) -> bytes:
    """PNG signature plus a valid IHDR declaring width x height (8-bit RGB)."""
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))


def wav(seconds: float, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, np.zeros(int(seconds * rate), np.float32), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def wav_with(*, rate: int, byte_rate: int | None = None, data_size: int | None = None) -> bytes:
    """A 1 s mono 16-bit WAV whose fmt/data fields are overwritten (uint32, as on disk)."""
    data = bytearray(wav(1.0))
    fmt = data.index(b"fmt ") + 8
    byte_rate = rate * 2 if byte_rate is None else byte_rate
    struct.pack_into("<II", data, fmt + 4, rate & 0xFFFFFFFF, byte_rate & 0xFFFFFFFF)
    if data_size is not None:
        struct.pack_into("<I", data, data.index(b"data") + 4, data_size)
    return bytes(data)


def flac_with(*, rate: int | None = None, total: int | None = None) -> bytes:
    """A 1 s 8 kHz FLAC whose STREAMINFO sample rate or total sample count is overwritten."""
    out = io.BytesIO()
    soundfile.write(out, np.zeros(8000, np.float32), 8000, format="FLAC")
    data = bytearray(out.getvalue())
    (packed,) = struct.unpack_from(">Q", data, 18)  # rate:20 channels-1:3 bits-1:5 samples:36
    if rate is not None:
        packed = (packed & ((1 << 44) - 1)) | (rate << 44)
    if total is not None:
        packed = (packed & ~((1 << 36) - 1)) | total
    struct.pack_into(">Q", data, 18, packed)
    return bytes(data)


def flac_noise(seconds: float = 1.0, rate: int = 16000) -> bytes:
    """A FLAC of white noise: its frames hold real data, so cutting it cuts frames."""
    out = io.BytesIO()
    noise = np.random.default_rng(0).uniform(-0.5, 0.5, int(seconds * rate)).astype(np.float32)
    soundfile.write(out, noise, rate, format="FLAC")
    return out.getvalue()


def clip(fmt: str = "mp4") -> bytes:
    """A real 2 s, 10 fps, 64x48 clip (PyAV, the `[video]` extra; imported only when a case is built)."""
    from pipeline.gendata import video_clip

    return video_clip(64, 48, 10, 20, seed=3, fmt=fmt)


def mp4_with(*, delta: int | None = None, size: tuple[int, int] | None = None) -> bytes:
    """`clip()` whose stts sample duration (ticks per frame) or stsd frame size is overwritten."""
    data = bytearray(clip())
    if delta is not None:
        stts = data.index(b"stts") + 4  # version/flags, entry count, then (count, delta) runs
        struct.pack_into(">I", data, stts + 12, delta)
    if size is not None:
        entry = data.index(b"stsd") + 4 + 8  # the first sample entry
        struct.pack_into(">HH", data, entry + 32, *size)
    return bytes(data)


def gif_screen(width: int, height: int) -> bytes:
    """A GIF whose logical screen declares width x height (Pillow parses it, our parsers do not)."""
    out = io.BytesIO()
    Image.new("P", (4, 4)).save(out, "GIF")
    data = bytearray(out.getvalue())
    struct.pack_into("<HH", data, 6, width, height)
    return bytes(data)


# -- the cases --------------------------------------------------------------------------------
# A builder returns (shard bytes, good keys, bad key, good keys before the bad sample); the
# last two are omitted by shard-level cases (no key; every good sample precedes the fault).
_Builder = Callable[[str], tuple]
_CASES: dict[str, tuple[str, str, str, _Builder]] = {}  # name -> (reason, suffix, what, builder)


def _case(name: str, reason: str, what: str, *, suffix: str = ".tar") -> Callable[[_Builder], _Builder]:
    def register(build: _Builder) -> _Builder:
        _CASES[name] = (reason, suffix, what, build)
        return build

    return register


def _sample_case(name: str, reason: str, what: str, members: Callable[[], dict[str, bytes]]) -> None:
    """A shard of good samples with one sample `<name>_bad` made of `members` in the middle."""

    def build(p: str) -> tuple:
        bad = f"{p}_bad"
        body = [
            *_text(f"{p}_g0"),
            (f"{p}_g1.jpg", jpeg(40, 30)),
            *_text(f"{p}_g1"),
            *[(f"{bad}.{suffix}", data) for suffix, data in members().items()],
            *_text(f"{p}_g2"),
        ]
        good = (f"{p}_g0", f"{p}_g1", bad, f"{p}_g2") if reason == "ok" else (f"{p}_g0", f"{p}_g1", f"{p}_g2")
        return tar_bytes(body), good, None if reason == "ok" else bad, 2 + (reason == "ok") * 2

    _CASES[name] = (reason, ".tar", what, build)


def _half(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _zero_tail(data: bytes) -> bytes:
    """`data` of its full length, its second half zeros."""
    return _half(data) + bytes(len(data) - len(data) // 2)


def _drop_frames(mp4: bytes, count: int) -> bytes:
    """An MP4 (moov after mdat) whose mdat loses its last `count` bytes, box sizes kept consistent:
    the sample table then claims more bytes than mdat holds."""
    at = mp4.index(b"mdat") - 4
    (size,) = struct.unpack_from(">I", mp4, at)
    head = bytearray(mp4[: at + size - count])
    struct.pack_into(">I", head, at, size - count)
    return bytes(head) + mp4[at + size :]


def _four(p: str) -> list[tuple[str, bytes]]:
    return [m for i in range(4) for m in _text(f"{p}_g{i}")]


def _header_offset(archive: bytes, name: str) -> int:
    return archive.index(name.encode() + b"\0")


# Tar structure. When the archive breaks where no member name is known, the sample still being
# gathered is dropped too (its members may continue past the damage): the rest is lost.
@_case("tar_cut_in_header", "truncated_tar", "archive ends 200 bytes into a member header")
def _(p):
    data = tar_bytes(_four(p))
    return data[: _header_offset(data, f"{p}_g2.txt") + 200], (f"{p}_g0",)


@_case("tar_cut_in_body", "truncated_tar", "archive ends inside a member's data")
def _(p):
    data = tar_bytes([*_text(f"{p}_g0"), *_text(f"{p}_g1"), (f"{p}_g2.txt", b"q" * 3000), *_text(f"{p}_g3")])
    return data[: _header_offset(data, f"{p}_g2.txt") + _BLOCK + 1000], (f"{p}_g0", f"{p}_g1")


@_case("tar_cut_in_padding", "truncated_tar", "archive ends inside the zero padding after a member")
def _(p):
    data = tar_bytes([*_text(f"{p}_g0"), *_text(f"{p}_g1"), (f"{p}_g2.txt", b"q" * 100), *_text(f"{p}_g3")])
    return data[: _header_offset(data, f"{p}_g2.txt") + _BLOCK + 300], (f"{p}_g0", f"{p}_g1")


@_case("tar_no_end_blocks", "ok", "archive stops right after a member, without end-of-archive blocks: "
       "read whole, as webdataset does, with a warning")
def _(p):
    return tar_bytes(_four(p), end=False), (f"{p}_g0", f"{p}_g1", f"{p}_g2", f"{p}_g3")


@_case("tar_bad_checksum", "bad_tar", "a member header's name is damaged, checksum no longer matches")
def _(p):
    data = bytearray(tar_bytes(_four(p)))
    data[_header_offset(data, f"{p}_g2.txt") + 1] ^= 0x20
    return bytes(data), (f"{p}_g0",)


@_case("tar_bad_size_field", "bad_tar", "a member header's size is not octal (checksum is right)")
def _(p):
    members = _four(p)
    head = tar_bytes(members[:2], end=False)
    bad = tar_header(f"{p}_g2.txt".encode(), 0, size_field=b"0000000x9z\0\0")
    return head + bad + tar_bytes(members[3:]), (f"{p}_g0",)


@_case("tar_pax_zero_length", "bad_tar", "a pax header whose record says length 0 (would loop forever)")
def _(p):
    members = _four(p)
    pax = tar_member("PaxHeader", b"0 path=x\n", kind=b"x")
    return tar_bytes(members[:2], end=False) + pax + tar_bytes(members[2:]), (f"{p}_g0",)


@_case("tar_pax_garbage", "bad_tar", "a pax header whose records are not 'LEN key=value' lines")
def _(p):
    members = _four(p)
    pax = tar_member("PaxHeader", b"zz path=x\n\xff\xfe", kind=b"x")
    return tar_bytes(members[:2], end=False) + pax + tar_bytes(members[2:]), (f"{p}_g0",)


@_case("tar_unknown_member_type", "bad_tar", "a member of type 'Z', which no tar writer produces")
def _(p):
    members = _four(p)
    odd = tar_member("odd.bin", b"x", kind=b"Z")
    return tar_bytes(members[:2], end=False) + odd + tar_bytes(members[2:]), (f"{p}_g0",)


@_case("tar_gz_not_gzip", "bad_tar", "a .tar.gz holding a plain tar", suffix=".tar.gz")
def _(p):
    return tar_bytes(_four(p)), ()


@_case("tar_gz_garbage", "bad_tar", "a .tar.gz that is gzip magic followed by garbage", suffix=".tar.gz")
def _(p):
    return b"\x1f\x8b\x08\x00" + bytes(np.random.default_rng(3).integers(0, 256, 4000, dtype=np.uint8)), ()


@_case("tar_gzip_named_tar", "bad_tar", "a gzip-compressed tar whose name ends in .tar, not .tar.gz")
def _(p):
    return gzip.compress(tar_bytes(_four(p)), mtime=0), ()


@_case("tar_gz_truncated", "truncated_tar", "a .tar.gz cut inside its last member's data", suffix=".tar.gz")
def _(p):
    noise = np.random.default_rng(4).integers(0, 256, 64 << 10, dtype=np.uint8).tobytes()  # incompressible
    packed = gzip.compress(tar_bytes([*_four(p)[:3], (f"{p}_tail.bin", noise)]), mtime=0)
    return packed[: len(packed) - (20 << 10)], (f"{p}_g0", f"{p}_g1", f"{p}_g2")


# Zero-length members: an empty member is an empty file of its kind.
_sample_case("zero_txt_alone", "empty_sample", "a sample whose only member is an empty .txt", lambda: {"txt": b""})
_sample_case("zero_txt_with_image", "ok", "an empty .txt beside a good image: the image counts",
             lambda: {"jpg": jpeg(30, 30), "txt": b""})
_sample_case("zero_cls_with_text", "ok", "an empty label member beside good text", lambda: {"cls": b"", "txt": b"fine"})
_sample_case("zero_jpg", "bad_image", "a zero-byte .jpg", lambda: {"jpg": b"", "txt": b"caption"})
_sample_case("zero_png", "bad_image", "a zero-byte .png", lambda: {"png": b"", "txt": b"caption"})
_sample_case("zero_wav", "bad_audio", "a zero-byte .wav", lambda: {"txt": b"caption", "wav": b""})
_sample_case("zero_flac", "bad_audio", "a zero-byte .flac", lambda: {"flac": b"", "txt": b"caption"})
_sample_case("zero_json", "empty_sample", "a zero-byte .json (no text, as a zero-byte .txt)", lambda: {"json": b""})
_sample_case("json_nested_too_deep", "bad_json", "a .json caption whose metadata nests 5,000 objects deep",
             lambda: {"jpg": jpeg(16, 16),
                      "json": b'{"caption": "a cat", "meta": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5001})
_sample_case("zero_txt_gz", "bad_gzip", "a zero-byte .txt.gz", lambda: {"txt.gz": b""})

# Compressed text members.
_sample_case("txt_gz_not_gzip", "bad_gzip", "a .txt.gz holding plain text", lambda: {"txt.gz": b"plain text, not gzip"})
_sample_case("txt_gz_truncated", "bad_gzip", "a .txt.gz cut in half",
             lambda: {"txt.gz": _half(gzip.compress(bytes(range(256)) * 40, mtime=0))})
_sample_case("txt_gz_bomb", "text_too_large", "a .txt.gz inflating past max_text_bytes (16 MiB of zeros in 16 KiB)",
             lambda: {"txt.gz": gzip.compress(bytes(16 << 20), mtime=0)})

# Images whose header lies, or declares a bomb.
_sample_case("png_ihdr_then_garbage", "bad_image", "valid PNG IHDR (64x64) followed by garbage, no IEND",
             lambda: {"png": png_ihdr(64, 64) + bytes(range(256)) * 4, "txt": b"caption"})
_sample_case("png_truncated", "bad_image", "a real PNG cut in half: IHDR intact, IEND gone",
             lambda: {"png": _half(png(200, 100)), "txt": b"caption"})
_sample_case("png_zero_width", "bad_image", "PNG IHDR declaring 0x64",
             lambda: {"png": png_ihdr(0, 64) + png_chunk(b"IEND", b""), "txt": b"caption"})
_sample_case("png_bomb", "image_too_large", "PNG IHDR declaring 100000x100000",
             lambda: {"png": png_ihdr(100000, 100000) + png_chunk(b"IEND", b""), "txt": b"caption"})
_sample_case("jpeg_body_truncated", "bad_image", "a real JPEG cut just after its SOF header: size parses, no scan",
             lambda: {"jpg": jpeg(64, 48)[: jpeg(64, 48).index(b"\xff\xc0") + 20], "txt": b"caption"})
_sample_case("jpeg_scan_truncated", "bad_image", "a real JPEG cut inside its entropy-coded scan",
             lambda: {"jpg": jpeg(64, 48)[: len(jpeg(64, 48)) - 300], "txt": b"caption"})
_sample_case("jpeg_bomb", "image_too_large", "JPEG SOF declaring 65000x65000",
             lambda: {"jpg": b"\xff\xd8\xff\xc0\x00\x11\x08" + struct.pack(">HH", 65000, 65000) + bytes(10)
                      + b"\xff\xd9", "txt": b"caption"})
_sample_case("gif_bomb", "image_too_large", "GIF logical screen declaring 65535x65535 (Pillow path)",
             lambda: {"gif": gif_screen(65535, 65535), "txt": b"caption"})
_sample_case("gif_truncated", "bad_image", "a real GIF cut inside its image data",
             lambda: {"gif": _half(_pillow(64, 48, "GIF")), "txt": b"caption"})
_sample_case("webp_truncated", "bad_image", "a real WebP cut in half (Pillow path)",
             lambda: {"txt": b"caption", "webp": _half(_pillow(64, 48, "WEBP"))})
_sample_case("image_garbage", "bad_image", "a .webp that is random bytes",
             lambda: {"txt": b"caption", "webp": bytes(np.random.default_rng(5).integers(0, 256, 300, dtype=np.uint8))})
_sample_case("jpeg_trailing_bytes", "ok", "a good JPEG with junk after its end marker (common, decodable)",
             lambda: {"jpg": jpeg(64, 48) + b"\0" * 100, "txt": b"caption"})
_sample_case("png_trailing_bytes", "ok", "a good PNG with junk after IEND (decodable)",
             lambda: {"png": png(64, 48) + b"junk" * 10, "txt": b"caption"})

# Audio with impossible rates or lying sizes.
_sample_case("wav_rate_zero", "bad_audio", "WAV fmt declaring 0 Hz", lambda: {"txt": b"c", "wav": wav_with(rate=0)})
_sample_case("wav_rate_wraparound", "bad_audio", "WAV rate -1 stored as uint32 4294967295 (byte rate wrapped too)",
             lambda: {"txt": b"c", "wav": wav_with(rate=-1)})
_sample_case("wav_rate_1e9", "bad_audio", "WAV declaring 10^9 Hz with a consistent byte rate",
             lambda: {"txt": b"c", "wav": wav_with(rate=10**9)})
_sample_case("wav_byte_rate_lies", "bad_audio", "WAV at 16 kHz 16-bit declaring 100 bytes/s (1 s would read as 320 s)",
             lambda: {"txt": b"c", "wav": wav_with(rate=16000, byte_rate=100)})
_sample_case("wav_data_size_lies", "bad_audio", "WAV data chunk declaring 10^9 bytes, 32000 present",
             lambda: {"txt": b"c", "wav": wav_with(rate=16000, data_size=10**9)})
_sample_case("flac_rate_zero", "bad_audio", "FLAC STREAMINFO declaring 0 Hz",
             lambda: {"flac": flac_with(rate=0), "txt": b"c"})
_sample_case("flac_rate_1e6", "bad_audio", "FLAC STREAMINFO declaring 1,000,000 Hz",
             lambda: {"flac": flac_with(rate=1_000_000), "txt": b"c"})
_sample_case("flac_truncated", "bad_audio", "a FLAC of noise cut in half (its frames end early)",
             lambda: {"flac": _half(flac_noise()), "txt": b"c"})
_sample_case("flac_length_lies", "bad_audio", "FLAC claiming one hour (28.8M samples) in ~100 bytes",
             lambda: {"flac": flac_with(total=8000 * 3600), "txt": b"c"})
_sample_case("audio_garbage", "bad_audio", "an .mp3 that is random bytes",
             lambda: {"mp3": bytes(np.random.default_rng(6).integers(0, 256, 500, dtype=np.uint8)), "txt": b"c"})

# Video containers that are cut or lie (counted from headers: the lie must be seen there).
_sample_case("mp4_ok", "ok", "a good 2 s H.264 MP4 beside text: counted", lambda: {"mp4": clip(), "txt": b"c"})
_sample_case("zero_mp4", "bad_video", "a zero-byte .mp4", lambda: {"mp4": b"", "txt": b"c"})
_sample_case("mp4_truncated", "bad_video", "a real MP4 cut in half (its moov index, at the end, is gone)",
             lambda: {"mp4": _half(clip()), "txt": b"c"})
_sample_case("mp4_cut_in_mdat", "bad_video", "a real MP4 whose mdat lost 200 bytes of frames, box sizes mended",
             lambda: {"mp4": _drop_frames(clip(), 200), "txt": b"c"})
_sample_case("mp4_zero_duration", "bad_video", "MP4 whose frames last 0 ticks (duration 0 s)",
             lambda: {"mp4": mp4_with(delta=0), "txt": b"c"})
_sample_case("mp4_absurd_fps", "bad_video", "MP4 timing 10,240 frames per second",
             lambda: {"mp4": mp4_with(delta=1), "txt": b"c"})
_sample_case("mp4_absurd_size", "bad_video", "MP4 declaring 65535x65535 frames",
             lambda: {"mp4": mp4_with(size=(65535, 65535)), "txt": b"c"})
_sample_case("video_garbage", "bad_video", "an .mp4 that is random bytes (no container)",
             lambda: {"mp4": bytes(np.random.default_rng(7).integers(0, 256, 500, dtype=np.uint8)), "txt": b"c"})
_sample_case("mkv_truncated", "bad_video", "a real MKV cut in half (its Segment size overruns the file)",
             lambda: {"mkv": _half(clip("mkv")), "txt": b"c"})
_sample_case("mkv_zero_tail", "bad_video", "a real MKV whose second half is zeros (a preallocated partial "
             "download: its Segment size whole)", lambda: {"mkv": _zero_tail(clip("mkv")), "txt": b"c"})

# Text.
_sample_case("txt_not_utf8", "bad_text", "Latin-1 text in a .txt", lambda: {"txt": "café olé".encode("latin-1")})
_sample_case("json_not_utf8", "bad_text", "a .json with a Latin-1 byte", lambda: {"json": b'{"text": "caf\xe9"}'})
_sample_case("json_lone_surrogate", "bad_text", "JSON text escaping an unpaired surrogate (cannot be sent as UTF-8)",
             lambda: {"json": b'{"text": "broken \\ud800 pair"}'})
_sample_case("txt_huge", "text_too_large", f"{HUGE_TEXT_BYTES >> 20} MiB of text, over max_text_bytes",
             lambda: {"txt": b"many words here " * (HUGE_TEXT_BYTES // 16)})
_sample_case("txt_large_ok", "ok", "1 MiB of text, under max_text_bytes: counted",
             lambda: {"txt": b"word " * ((1 << 20) // 5)})


# Keys.
@_case("duplicate_key_later", "duplicate_key", "a key that appears again after another sample")
def _(p):
    good = tuple(f"{p}_g{i}" for i in range(4))
    return tar_bytes([*_four(p), (f"{p}_g1.txt", b"same key again")]), good, f"{p}_g1", 4


@_case("duplicate_member", "duplicate_key", "the same member name twice in a row")
def _(p):
    body = [*_text(f"{p}_g0"), (f"{p}_bad.txt", b"one"), (f"{p}_bad.txt", b"two"), *_text(f"{p}_g1")]
    return tar_bytes(body), (f"{p}_g0", f"{p}_g1"), f"{p}_bad", 1


@_case("key_not_utf8", "bad_key", "a member name with a Latin-1 byte (keys travel as UTF-8)")
def _(p):
    body = [*_text(f"{p}_g0"), (f"{p}_caf\xe9.txt".encode("latin-1"), b"text"), *_text(f"{p}_g1")]
    return tar_bytes(body), (f"{p}_g0", f"{p}_g1"), f"{p}_caf\\xe9", 1


# Links: tar stores a file linked twice as a hard link to its first copy (GNU tar's default), a
# symbolic link as its target's name; neither member holds the bytes.
@_case("hard_link_member", "link_member", "a .jpg stored as a hard link to another sample's image")
def _(p):
    first = [(f"{p}_g0.jpg", jpeg(8, 8)), (f"{p}_g0.txt", b"caption")]
    link = tar_header(f"{p}_bad.jpg".encode(), 0, b"1", link=f"{p}_g0.jpg".encode())
    body = tar_bytes(first, end=False) + link + tar_bytes([(f"{p}_bad.txt", b"caption"), *_text(f"{p}_g1")])
    return body, (f"{p}_g0", f"{p}_g1"), f"{p}_bad", 1


@_case("symlink_member", "link_member", "a sample whose only member is a symbolic link")
def _(p):
    link = tar_header(f"{p}_bad.txt".encode(), 0, b"2", link=f"{p}_g0.txt".encode())
    return (tar_bytes(_text(f"{p}_g0"), end=False) + link + tar_bytes(_text(f"{p}_g1")),
            (f"{p}_g0", f"{p}_g1"), f"{p}_bad", 1)


# Devices and FIFOs: tar records a name and a kind, and no bytes (a `tar -c` of a directory
# holding a named pipe writes one).
@_case("fifo_member", "special_member", "a .jpg stored as a FIFO (tar member type 6)")
def _(p):
    fifo = tar_header(f"{p}_bad.jpg".encode(), 0, b"6")
    return (tar_bytes(_text(f"{p}_g0"), end=False) + fifo + tar_bytes([(f"{p}_bad.txt", b"caption"),
                                                                        *_text(f"{p}_g1")]),
            (f"{p}_g0", f"{p}_g1"), f"{p}_bad", 1)


@_case("device_member", "special_member", "a sample whose only member is a character device")
def _(p):
    dev = tar_header(f"{p}_bad.txt".encode(), 0, b"3")
    return (tar_bytes(_text(f"{p}_g0"), end=False) + dev + tar_bytes(_text(f"{p}_g1")),
            (f"{p}_g0", f"{p}_g1"), f"{p}_bad", 1)


CASE_NAMES: tuple[str, ...] = tuple(_CASES)


def write_case(out_dir: str, name: str) -> CorpusShard:
    """Write one case's shard into `out_dir` and return its expectations."""
    if name not in _CASES:
        raise ValueError(f"unknown corpus case {name!r}; known: {', '.join(CASE_NAMES)}")
    reason, suffix, what, build = _CASES[name]
    data, good, *rest = build(name)
    bad_key, before = rest if rest else (None, len(good))
    path = os.path.join(out_dir, name + suffix)
    with open(path, "wb") as f:
        f.write(data)
    return CorpusShard(
        case=name, path=path, reason=reason, good_keys=good, bad_key=bad_key, num_before_bad=before, what=what
    )


def write_corpus(out_dir: str) -> dict[str, CorpusShard]:
    """Write every case into `out_dir` (one shard each); returns them by case name."""
    return {name: write_case(out_dir, name) for name in CASE_NAMES}


def write_clean_shard(out_dir: str, prefix: str, num_samples: int = 3) -> tuple[str, tuple[str, ...]]:
    """A healthy shard to read after a broken one: (path, keys)."""
    keys = tuple(f"{prefix}_c{i}" for i in range(num_samples))
    path = os.path.join(out_dir, f"{prefix}.tar")
    with open(path, "wb") as f:
        f.write(tar_bytes([m for k in keys for m in _text(k)]))
    return path, keys
