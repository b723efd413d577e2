"""Hand-parsed media headers for the hot formats: PNG and JPEG dimensions, WAV, FLAC and MP3 duration.

Measured: Pillow's `Image.open` (~25 us per JPEG) and `soundfile.info` (~100 us per FLAC) were
most of counting time; these parsers cost ~2 us, and what they cannot vouch for returns None and
goes to Pillow / libsndfile. Framing checks (`*_problem`, O(1) on whole files) catch a valid
header over a cut or garbage body, which a trainer's decoder would fail on after planning; a
FLAC's last frame is vouched whole by its CRCs (`flac_last_frame_whole`, ~9 us) before
libsndfile is asked to decode it (~75 us). An MP3 without a Xing/Info frame states no length
at all (libsndfile estimates one from its bytes, tags included; its decoder ignores VBRI), so its
frames are walked, as are those of MP3 inside a WAV; one with a Xing/Info frame must hold the
frames that frame claims (a cut file is refused: libsndfile would state the uncut length).
"""

from __future__ import annotations

import struct
import zlib

from pipeline import keepalive

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# SOF0..SOF15 carry the frame size; C4 (DHT), C8 (JPG) and CC (DAC) share the range but do not.
_JPEG_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}
#: The coding process each start-of-frame marker declares (ITU T.81 table B.1).
JPEG_PROCESSES = {
    0xC0: "baseline", 0xC1: "extended sequential", 0xC2: "progressive", 0xC3: "lossless",
    0xC5: "differential sequential", 0xC6: "differential progressive", 0xC7: "differential lossless",
    0xC9: "arithmetic-coded sequential", 0xCA: "arithmetic-coded progressive",
    0xCB: "arithmetic-coded lossless", 0xCD: "differential arithmetic-coded sequential",
    0xCE: "differential arithmetic-coded progressive", 0xCF: "differential arithmetic-coded lossless",
}
#: The processes Pillow's libjpeg(-turbo) decodes: never hierarchical (differential) JPEG, lossless
#: only from libjpeg-turbo 3.0 (`jpeg_process_problem`'s caller knows which library it has).
JPEG_DECODABLE = frozenset({0xC0, 0xC1, 0xC2, 0xC9, 0xCA})
_JPEG_STANDALONE = frozenset([0x01, *range(0xD0, 0xD9)])
_WAV_UNCOMPRESSED = (0x0001, 0x0003, 0xFFFE)  # PCM, IEEE float, WAVE_FORMAT_EXTENSIBLE
# MP3 in WAV (`ffmpeg -c:a libmp3lame x.wav`): libsndfile states its length from the byte rate,
# a frame or more off what its decoder reads (every frame of the data chunk), so those are walked.
_WAV_MPEG_LAYER3 = 0x0055
# A WAV writer that cannot seek back to patch its sizes (output to a pipe) leaves a placeholder:
# ffmpeg 0xFFFFFFFF, SoX 0x7FFFF000 rounded down to whole blocks. Decoders read such a data
# chunk to the end of the file.
_WAV_SIZE_UNKNOWN = 0xFFFFFFFF
_SOX_SIZE_UNKNOWN = 0x7FFFF000
# A FLAC frame is at least 6 header bytes, one subframe byte and a 2-byte CRC: a stream
# claiming more frames than its bytes can hold lies about its length.
_FLAC_MIN_FRAME_BYTES = 8


class HeaderError(ValueError):
    """A header that parses but declares something impossible; `reason` names the counter."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def png_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """(width, height) from a PNG's IHDR chunk, or None if it is not a well-formed one."""
    if len(data) < 33 or data[:8] != _PNG_SIGNATURE or data[12:16] != b"IHDR":
        return None
    (length,) = struct.unpack_from(">I", data, 8)
    (crc,) = struct.unpack_from(">I", data, 29)
    if length != 13 or zlib.crc32(data[12:29]) != crc:
        return None
    return struct.unpack_from(">II", data, 16)


_PNG_IEND = b"\x00\x00\x00\x00IEND\xaeB`\x82"


def _png_chunk_end(data: bytes | memoryview, pos: int) -> int:
    """End of the PNG chunk starting at `pos`, or -1 when its type or length cannot be right."""
    if pos + 12 > len(data) or not bytes(data[pos + 4 : pos + 8]).isalpha():
        return -1
    (length,) = struct.unpack_from(">I", data, pos)
    end = pos + 12 + length
    return end if end <= len(data) else -1


def png_problem(data: bytes | memoryview) -> str | None:
    """Why a PNG with a valid IHDR cannot be whole (garbage or a cut after it), or None.

    Checks chunk framing only, never pixels: O(1) when the chunk after IHDR is well formed and
    the file ends with IEND (the usual case), a walk over chunk headers otherwise.
    """
    pos = 33  # IHDR is always first and 13 bytes long
    if _png_chunk_end(data, pos) < 0:
        return "the chunk after IHDR is malformed (garbage, or the file is cut)"
    if data[-12:] == _PNG_IEND:
        return None
    while pos < len(data):  # trailing bytes after IEND are harmless; find IEND by walking
        end = _png_chunk_end(data, pos)
        if end < 0:
            return f"malformed chunk at byte {pos} before IEND (garbage, or the file is cut)"
        if data[pos + 4 : pos + 8] == b"IEND":
            return None
        pos = end
    return "the file ends before its IEND chunk (truncated)"


def jpeg_problem(data: bytes | memoryview) -> str | None:
    """Why a JPEG cannot be whole, or None: its scan must be followed by an end-of-image marker.

    Pillow refuses to decode a JPEG without one ("image file is truncated"), so a trainer would
    fail on it. O(1) when the file ends with the marker; otherwise a search after the first scan
    (inside entropy-coded data 0xFF is always stuffed, so FF D9 there is the real marker).
    """
    if data[-2:] == b"\xff\xd9":
        return None
    raw = bytes(data)
    scan = _jpeg_first_scan(raw)
    if scan < 0:
        return "no start-of-scan marker: the file ends inside its headers"
    if raw.find(b"\xff\xd9", scan) < 0:
        return "no end-of-image marker after the scan: the file is truncated"
    return None


def gif_problem(data: bytes | memoryview) -> str | None:
    """Why a GIF is cut inside a block (Pillow fails to decode it), or None.

    Walks the block structure (extensions, image descriptors, their 255-byte sub-blocks):
    GIFs are rare in training data and small, and this is the only way to see a cut.
    A missing trailer alone is tolerated, as Pillow's decoder tolerates it.
    """
    end = len(data)
    if end < 13:
        return "the file ends inside its header"
    flags = data[10]
    pos = 13 + (3 << ((flags & 7) + 1) if flags & 0x80 else 0)  # global color table
    while pos < end:
        block = data[pos]
        if block == 0x3B:  # trailer
            return None
        if block == 0x21:  # extension: label, then sub-blocks
            pos += 2
        elif block == 0x2C:  # image descriptor (10 bytes), local color table, LZW code size
            if pos + 10 > end:
                break
            local = data[pos + 9]
            pos += 10 + (3 << ((local & 7) + 1) if local & 0x80 else 0) + 1
        else:
            return f"unknown block 0x{block:02x} at byte {pos} (garbage, or the file is cut)"
        while pos < end and data[pos] != 0:  # sub-blocks, each led by its length, 0 ends them
            pos += 1 + data[pos]
        if pos >= end:
            return "the file ends inside a block (truncated)"
        pos += 1  # the block's terminator
    return None if pos == end else "the file ends inside a block (truncated)"


def _jpeg_first_scan(data: bytes) -> int:
    """Offset of the first start-of-scan marker, walking segment lengths (so an EXIF thumbnail's
    own markers are stepped over), or -1."""
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return -1
        marker = data[pos + 1]
        if marker == 0xFF:
            pos += 1
        elif marker in _JPEG_STANDALONE:
            pos += 2
        elif marker == 0xDA:
            return pos
        else:
            pos += 2 + int.from_bytes(data[pos + 2 : pos + 4], "big")
    return -1


def _jpeg_frame(data: bytes | memoryview) -> int:
    """Offset of a JPEG's start-of-frame marker with a nonzero size, walking segment lengths
    up to it, or -1 where none is found cleanly."""
    if data[:2] != b"\xff\xd8":
        return -1
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return -1
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _JPEG_STANDALONE:
            pos += 2
            continue
        if marker in _JPEG_SOF:
            if pos + 10 > end or not (data[pos + 5] or data[pos + 6]) or not (data[pos + 7] or data[pos + 8]):
                return -1  # cut inside the frame header, or a zero height or width
            return pos
        if marker in (0xDA, 0xD9):  # scan data or end before any frame header
            return -1
        (length,) = struct.unpack_from(">H", data, pos + 2)
        pos += 2 + length
    return -1


def jpeg_size(data: bytes | memoryview) -> tuple[int, int] | None:
    """(width, height) from a JPEG's start-of-frame marker, or None if not found cleanly."""
    pos = _jpeg_frame(data)
    if pos < 0:
        return None
    height, width = struct.unpack_from(">HH", data, pos + 5)
    return width, height


def jpeg_process_problem(data: bytes | memoryview, decodable: frozenset[int] = JPEG_DECODABLE) -> str | None:
    """Why Pillow cannot decode a JPEG whose size reads, or None: a coding process outside
    `decodable` (SOF markers), samples of other than 8 bits (Pillow opens 8-bit JPEG only: not
    12-bit DCT, nor the 9-bit lossless RGB FFmpeg's ljpeg writes), or other than 1, 3 or 4
    components. The trainer would otherwise stand a blank input in for a planned image. A lossless
    JPEG of more than one component decodes, but to wrong colours: refused too."""
    pos = _jpeg_frame(data)
    if pos < 0:
        return None
    marker, bits, components = data[pos + 1], data[pos + 4], data[pos + 9]
    what = f"{JPEG_PROCESSES[marker]} JPEG (SOF{marker - 0xC0})"
    if marker not in decodable:
        known = ", ".join(JPEG_PROCESSES[m] for m in sorted(decodable))
        return f"{what} is not decodable by Pillow (it decodes {known})"
    if bits != 8:
        return f"{what} with {bits}-bit samples is not decodable by Pillow (8-bit samples only)"
    if components not in (1, 3, 4):
        return (f"{what} with {components} components is not decodable by Pillow (1, 3 or 4: "
                "grayscale, YCbCr or RGB, CMYK)")
    if marker == 0xC3 and components != 1:
        # libjpeg-turbo returns a lossless JPEG's stored planes unconverted (the YCbCr FFmpeg's
        # ljpeg writes) and Pillow labels them RGB: the model would see wrong colours.
        return (f"{what} with {components} components decodes to wrong colours (libjpeg-turbo "
                "returns its stored YCbCr planes unconverted, Pillow reads them as RGB; only "
                "grayscale lossless JPEG decodes right): convert it, e.g. ffmpeg -i IN OUT.png")
    return None


def wav_header(data: bytes | memoryview) -> tuple[int, int, float] | None:
    """(sample_rate, channels, duration_s) from a RIFF/WAVE header, or None if not plain RIFF.

    The data chunk's declared size must fit in the bytes present: a lying header is an error
    (`HeaderError`), not a 10-hour clip. A streaming writer's placeholder size (see
    `_wav_size_unknown`) is no claim: that data runs to the end, as decoders read it.
    """
    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos, end = 12, len(data)
    fmt = None
    while pos + 8 <= end:
        chunk_id = bytes(data[pos : pos + 4])
        (size,) = struct.unpack_from("<I", data, pos + 4)
        body = pos + 8
        if chunk_id == b"fmt ":
            if size < 16 or body + 16 > end:
                raise HeaderError("bad_audio", f"wav fmt chunk of {size} bytes is too short")
            tag, channels, rate, byte_rate, align, bits = struct.unpack_from("<HHIIHH", data, body)
            if tag == _WAV_MPEG_LAYER3:
                fmt = (channels, rate, None, align)  # no byte rate: its frames are walked
            elif tag not in _WAV_UNCOMPRESSED:
                # ADPCM, GSM 6.10...: byte_rate is the codec's nominal rate, and the samples a
                # block holds are the codec's; libsndfile counts what its decoder reads.
                return None
            else:
                fmt = _wav_pcm_format(channels, rate, byte_rate, align, bits)
        elif chunk_id == b"data":
            if fmt is None:
                raise HeaderError("bad_audio", "wav data chunk before fmt chunk")
            channels, rate, byte_rate, align = fmt
            if byte_rate is None:
                return _wav_mp3(data, body, size, rate, align)
            if rate == 0 or byte_rate == 0 or channels == 0:
                raise HeaderError(
                    "bad_audio", f"wav header declares rate={rate} byte_rate={byte_rate} channels={channels}"
                )
            present = end - body
            if size > present:
                if not _wav_size_unknown(size, align):
                    raise HeaderError("bad_audio", f"wav data chunk declares {size} bytes but {present} are present")
                size = present
            elif size == 0 and present:
                # libsndfile reads no samples from it, so the trainer would get an empty clip.
                raise HeaderError(
                    "bad_audio",
                    f"wav data chunk declares 0 bytes although {present} follow it: decoders read it as empty",
                )
            _check_no_second_wav(data, body + size + (size & 1))
            # Decoders read whole blocks only: a part block at the end is no sample.
            return rate, channels, (size - size % align) / byte_rate
        pos = body + size + (size & 1)  # chunks are word-aligned
    raise HeaderError("bad_audio", "wav has no fmt/data chunks")


#: Chunks after a WAV's data chunk `_check_no_second_wav` looks at (a LIST, an id3 tag...).
_WAV_TRAILING_CHUNKS = 64


def _check_no_second_wav(data: bytes | memoryview, pos: int) -> None:
    """HeaderError where another RIFF file starts among the chunks after the data chunk (WAV
    files joined with `cat`): libsndfile refuses the whole file ("No 'RIFF' chunk marker"),
    while the first file's header alone counts as a clip."""
    for _ in range(_WAV_TRAILING_CHUNKS):
        if pos + 8 > len(data):
            return
        if bytes(data[pos:pos + 4]) in (b"RIFF", b"RIFX", b"RF64"):
            raise HeaderError("bad_audio", f"a second WAV file starts at byte {pos} (files joined "
                                           "with cat), which libsndfile cannot open: join them "
                                           "with sox a.wav b.wav out.wav, or ffmpeg's concat")
        (size,) = struct.unpack_from("<I", data, pos + 4)
        pos += 8 + size + (size & 1)


def _wav_pcm_format(channels: int, rate: int, byte_rate: int, align: int, bits: int) -> tuple[int, int, int, int]:
    """(channels, rate, byte_rate, block_align) of a PCM/float fmt chunk, checked consistent.

    Duration is whole blocks / rate, and a block is one sample of every channel, as decoders read
    it: block_align must be that, and byte_rate rate * block_align, or the duration is a lie
    (libsndfile decodes by channels and bits, whatever the rest).
    """
    if channels and (bits == 0 or align != channels * -(-bits // 8)):
        raise HeaderError(
            "bad_audio",
            f"wav header is inconsistent: block_align={align} != channels={channels} * "
            f"{-(-bits // 8)} bytes of {bits}-bit samples",
        )
    if byte_rate != rate * align:
        raise HeaderError(
            "bad_audio",
            f"wav header is inconsistent: byte_rate={byte_rate} != rate={rate} * block_align={align}",
        )
    return channels, rate, byte_rate, align


def _wav_mp3(data, body: int, size: int, rate: int, align: int) -> tuple[int, int, float]:
    """(sample_rate, channels, duration_s) of the MP3 frames in a WAV's data chunk, all of which
    libsndfile's decoder reads; HeaderError where they cannot be walked to its end."""
    present = len(data) - body
    if size > present:
        if not _wav_size_unknown(size, max(align, 1)):
            raise HeaderError("bad_audio", f"wav (MP3) data chunk declares {size} bytes but {present} "
                                           "are present: the file is truncated")
        size = present
    stream = _mpeg_stream(memoryview(data)[body:body + size])
    if stream is None:
        raise HeaderError("bad_audio", "wav of format 0x0055 (MP3) has no MPEG audio frame at the "
                                       "start of its data chunk")
    if stream[0] != rate:
        raise HeaderError("bad_audio", f"wav fmt chunk declares {rate} Hz but its MP3 frames are "
                                       f"{stream[0]} Hz")
    return stream


def _wav_size_unknown(size: int, align: int) -> bool:
    """Whether a data chunk size is a streaming writer's placeholder rather than a length."""
    return size == _WAV_SIZE_UNKNOWN or (align > 0 and size == _SOX_SIZE_UNKNOWN // align * align)


def flac_header(data: bytes | memoryview) -> tuple[int, int, float] | None:
    """(sample_rate, channels, duration_s) from a FLAC STREAMINFO block, or None.

    None also when the stream does not state its length (total samples 0), so libsndfile
    decides.
    """
    if len(data) < 42 or data[:4] != b"fLaC" or data[4] & 0x7F != 0 or data[5:8] != b"\x00\x00\x22":
        return None
    (packed,) = struct.unpack_from(">Q", data, 18)  # rate:20 channels-1:3 bits-1:5 samples:36
    rate = packed >> 44
    channels = ((packed >> 41) & 0x7) + 1
    total = packed & ((1 << 36) - 1)
    if rate == 0 or total == 0:
        return None
    (max_block,) = struct.unpack_from(">H", data, 10)
    if max_block < 16:
        max_block = 65535  # invalid STREAMINFO block size: assume the largest, the weakest bound
    frames = -(-total // max_block)
    if frames * _FLAC_MIN_FRAME_BYTES > len(data) - 42:
        raise HeaderError(
            "bad_audio",
            f"flac declares {total} samples ({frames}+ frames) but holds only {len(data)} bytes",
        )
    return rate, channels, total / rate


# -- FLAC: is the last frame whole? ------------------------------------------------------
# A FLAC stream cut short still has a valid STREAMINFO; only its last frame shows the cut. Its
# header (CRC-8) says which samples it holds, and its footer is a CRC-16 (polynomial 0x8005,
# initial 0, MSB first) of the whole frame: the final frame is whole when it ends the stream's
# samples and the CRC-16 of its bytes through the end of the data, footer included, is 0.
# That check costs ~9 us per clip against ~75 us for libsndfile to open, seek and decode it.


def _crc8_of(byte: int) -> int:
    """FLAC's frame-header CRC-8 (polynomial 0x07) of one byte."""
    for _ in range(8):
        byte = ((byte << 1) ^ 0x07) & 0xFF if byte & 0x80 else (byte << 1) & 0xFF
    return byte


_CRC8 = bytes(_crc8_of(b) for b in range(256))
_CRC_CHUNK = 256  # bytes whose CRC-16 contributions one table lookup and one XOR-reduce give
_crc16_tables: tuple | None = None
# Block sizes by the header's 4-bit code (None: read after the coded number; 0: reserved).
_FLAC_BLOCK = [0, 192, 576, 1152, 2304, 4608, None, None, *(256 << k for k in range(8))]


def _crc16_advance(crc, base):
    """CRC state(s) after one more zero byte."""
    return ((crc << 8) & 0xFFFF) ^ base[crc >> 8]


def _crc16_setup():
    """(T, hi, lo): T[j][b] is byte b's CRC-16 contribution at offset j of a _CRC_CHUNK-byte
    chunk; hi/lo advance a state past a whole chunk of zeros (the CRC is linear in its state)."""
    import numpy as np

    base = np.zeros(256, np.uint32)
    for b in range(256):
        c = b << 8
        for _ in range(8):
            c = ((c << 1) ^ 0x8005) & 0xFFFF if c & 0x8000 else (c << 1) & 0xFFFF
        base[b] = c
    table = np.zeros((_CRC_CHUNK, 256), np.uint32)
    table[-1] = base
    for j in range(_CRC_CHUNK - 2, -1, -1):
        table[j] = _crc16_advance(table[j + 1], base)
    hi, lo = np.arange(256, dtype=np.uint32) << 8, np.arange(256, dtype=np.uint32)
    for _ in range(_CRC_CHUNK):
        hi, lo = _crc16_advance(hi, base), _crc16_advance(lo, base)
    return table.astype(np.uint16), hi.tolist(), lo.tolist()


def flac_crc16(data: bytes | memoryview) -> int:
    """FLAC's frame CRC-16 of `data` (polynomial 0x8005, initial 0, MSB first, no final XOR)."""
    import numpy as np

    global _crc16_tables
    if _crc16_tables is None:
        _crc16_tables = _crc16_setup()
    table, hi, lo = _crc16_tables
    raw = np.frombuffer(data, np.uint8)
    pad = -len(raw) % _CRC_CHUNK  # leading zero bytes leave a CRC with initial 0 unchanged
    if pad:
        raw = np.concatenate([np.zeros(pad, np.uint8), raw])
    chunks = raw.reshape(-1, _CRC_CHUNK)
    parts = np.bitwise_xor.reduce(table[np.arange(_CRC_CHUNK), chunks], axis=1).tolist()
    crc = 0
    for part in parts:
        crc = hi[crc >> 8] ^ lo[crc & 0xFF] ^ part
    return crc


def _flac_coded_number(data: bytes, at: int) -> tuple[int, int] | None:
    """(value, next offset) of the UTF-8-style coded frame or sample number at `at`."""
    first = data[at]
    if first < 0x80:
        return first, at + 1
    n = 0
    while first & (0x80 >> n):
        n += 1
    if n < 2 or n > 7 or at + n > len(data):
        return None
    value = first & (0x7F >> n)
    for b in data[at + 1:at + n]:
        if b & 0xC0 != 0x80:
            return None
        value = (value << 6) | (b & 0x3F)
    return value, at + n


def _flac_frame_span(data: bytes, at: int, min_block: int) -> tuple[int, int] | None:
    """(first sample, samples) of the frame whose header starts at `at`, if one does."""
    if len(data) - at < 6 or data[at + 3] & 1:
        return None
    code, rate_code = data[at + 2] >> 4, data[at + 2] & 0xF
    if code == 0 or rate_code == 15 or data[at + 3] >> 4 >= 11:
        return None
    number = _flac_coded_number(data, at + 4)
    if number is None:
        return None
    value, end = number
    block = _FLAC_BLOCK[code]
    if block is None:
        width = 1 if code == 6 else 2
        if end + width > len(data):
            return None
        block = int.from_bytes(data[end:end + width], "big") + 1
        end += width
    end += {12: 1, 13: 2, 14: 2}.get(rate_code, 0)
    if end >= len(data):
        return None
    crc = 0
    for b in data[at:end]:
        crc = _CRC8[crc ^ b]
    if crc != data[end]:
        return None
    first = value if data[at + 1] & 1 else value * min_block  # variable: sample; fixed: frame
    return first, block


def flac_last_frame_whole(data: bytes | memoryview) -> bool:
    """Whether a FLAC stream's last frame is vouched whole: it ends the samples STREAMINFO
    declares, and its CRC-16 runs exactly to the end of the data. False means "not vouched
    here" (cut short, trailing bytes, an unusual layout), for libsndfile to decide."""
    if len(data) < 42 or data[:4] != b"fLaC" or data[4] & 0x7F != 0:
        return False
    min_block, _, _, max_frame = struct.unpack_from(">HH3s3s", data, 8)
    (packed,) = struct.unpack_from(">Q", data, 18)
    total = packed & ((1 << 36) - 1)
    bits = ((packed >> 36) & 0x1F) + 1
    if total == 0 or min_block < 16 or bits > 24:  # 32-bit FLAC: whether it decodes, ask libsndfile
        return False
    window = int.from_bytes(max_frame, "big") or 1 << 20
    start = max(42, len(data) - window - 2)
    tail = bytes(data[start:])
    at = len(tail)
    while True:
        at = max(tail.rfind(b"\xff\xf8", 0, at), tail.rfind(b"\xff\xf9", 0, at))
        if at < 0:
            return False
        span = _flac_frame_span(tail, at, min_block)
        if span is not None and span[0] + span[1] == total:
            return flac_crc16(memoryview(tail)[at:]) == 0


# -- MPEG audio (MP3) ----------------------------------------------------------------------------
# Bitrates (kbit/s) by [MPEG-1?][layer 1..3][index]; sample rates by version; samples per frame.
_MPEG_BITRATES = {
    (True, 1): (0, 32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (True, 2): (0, 32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (True, 3): (0, 32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (False, 1): (0, 32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (False, 2): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (False, 3): (0, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
_MPEG_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
# Tags a stream may end with (ID3v1, APEv2, Lyrics3): no frames, and no decoder reads them.
_MPEG_TRAILERS = (b"TAG", b"APETAGEX", b"LYRICSBEGIN")


def _mpeg_frame(data, pos: int) -> tuple[int, int, int, int] | None:
    """(frame bytes, samples, sample rate, channels) of the MPEG audio frame header at `pos`,
    or None where there is none (free-format frames included: they state no length)."""
    if pos + 4 > len(data) or data[pos] != 0xFF or data[pos + 1] & 0xE0 != 0xE0:
        return None
    b1, b2, b3 = data[pos + 1], data[pos + 2], data[pos + 3]
    version, layer_bits = (b1 >> 3) & 3, (b1 >> 1) & 3
    index, rate_index = b2 >> 4, (b2 >> 2) & 3
    if version == 1 or layer_bits == 0 or index in (0, 15) or rate_index == 3:
        return None
    layer, mpeg1 = 4 - layer_bits, version == 3
    bitrate = _MPEG_BITRATES[(mpeg1, layer)][index] * 1000
    rate = _MPEG_RATES[version][rate_index]
    padding = (b2 >> 1) & 1
    if layer == 1:
        size, samples = (12 * bitrate // rate + padding) * 4, 384
    elif layer == 3 and not mpeg1:
        size, samples = 72 * bitrate // rate + padding, 576
    else:
        size, samples = 144 * bitrate // rate + padding, 1152
    return size, samples, rate, 1 if b3 >> 6 == 3 else 2


def id3v2_end(data) -> int:
    """Where the audio starts after any ID3v2 tags at the front (0 without one): each tag is its
    10-byte header, the syncsafe size it states, and a 10-byte footer where its flag says so."""
    pos = 0
    while len(data) >= pos + 10 and bytes(data[pos:pos + 3]) == b"ID3":
        size = 0
        for b in data[pos + 6:pos + 10]:
            size = (size << 7) | (b & 0x7F)
        pos += 10 + size + (10 if data[pos + 5] & 0x10 else 0)  # footer present
    return pos


def _mpeg_walk(data, start: int, rate: int) -> tuple[int, int, int, str | None]:
    """(whole frames, their samples, where the walk stopped, why it stopped short: "junk", "cut"
    or None) of the MPEG audio frames from `start`: a clean walk ends at the end of the data or
    at a trailing tag (or zero padding), which no decoder reads."""
    pos, frames, samples, end = start, 0, 0, len(data)
    known: dict[bytes, tuple[int, int]] = {}  # a stream repeats a few headers: parse each once
    while pos < end:
        head = bytes(data[pos:pos + 4])
        frame = known.get(head)
        if frame is None:
            parsed = _mpeg_frame(data, pos)
            if parsed is None or parsed[2] != rate:
                rest = bytes(data[pos:pos + 11])
                if rest.startswith(_MPEG_TRAILERS) or not bytes(data[pos:]).strip(b"\0"):
                    break  # zero padding must run to the end: a decoder resyncs after a gap of zeros
                return frames, samples, pos, "junk"
            frame = known[head] = parsed[:2]
        if pos + frame[0] > end:
            return frames, samples, pos, "cut"
        frames += 1
        samples += frame[1]
        pos += frame[0]
        if not frames & keepalive.EVERY:  # hours of audio: seconds of walking
            keepalive.alive()
    return frames, samples, pos, None


def _mpeg_stream(data, start: int = 0) -> tuple[int, int, float] | None:
    """(sample_rate, channels, duration_s) of the MPEG audio frames from `start` to the end, as
    a decoder reads them all; None where no frame starts there. HeaderError where the frames stop
    before the data ends (junk, or a cut frame), since a decoder would resync or stop elsewhere."""
    first = _mpeg_frame(data, start)
    if first is None:
        return None
    _, _, rate, channels = first
    _, samples, pos, stop = _mpeg_walk(data, start, rate)
    if stop == "junk":
        raise HeaderError("bad_audio", f"MP3 frames stop at byte {pos} of {len(data)}: junk or a "
                                       "cut frame a decoder reads differently")
    if stop == "cut":
        raise HeaderError("bad_audio", f"MP3 is cut inside its last frame (byte {pos} of {len(data)})")
    return rate, channels, samples / rate


def _xing_claims(frame: bytes) -> tuple[str, int | None, int | None] | None:
    """(tag, frames after this one, bytes from this frame on) a Xing/Info frame claims (None for a
    field it leaves out), or None if `frame` is not one. The tag follows the side information
    (4..36 bytes)."""
    at = max(frame.find(b"Xing", 0, 44), frame.find(b"Info", 0, 44))
    if at < 0 or len(frame) < at + 8:
        return None
    (flags,) = struct.unpack_from(">I", frame, at + 4)
    fields, pos = [], at + 8
    for bit in (1, 2):  # frame count, byte count: each present when its flag is set
        if flags & bit and len(frame) >= pos + 4:
            fields.append(struct.unpack_from(">I", frame, pos)[0])
            pos += 4
        else:
            fields.append(None)
    return frame[at:at + 4].decode(), fields[0], fields[1]


def mp3_xing_problem(data: bytes | memoryview) -> str | None:
    """Why an MP3 whose first frame is a Xing/Info frame does not hold the frames it claims (cut
    short: libsndfile states the uncut length, its decoder reads what is there), or None.

    A walk over the frame headers (headers only): a partial download that its downloader
    preallocated (aria2, BitTorrent clients) is as long as the whole file, so its byte count
    matches the file while zeros stand where the later frames should be. None also for a
    stream without such a frame.
    """
    start = id3v2_end(data)
    first = _mpeg_frame(data, start)
    if first is None:
        return None
    claims = _xing_claims(bytes(data[start:start + min(first[0], 200)]))
    if claims is None:
        return None
    tag, frames, _ = claims
    present, _, pos, stop = _mpeg_walk(data, start, first[2])
    present -= 1  # the tag's own frame is no audio
    if frames is not None and present < frames:
        where = {"cut": f"the next is cut at byte {pos} of {len(data)}", None: f"they end at byte {pos}",
                 "junk": f"frames stop at byte {pos} of {len(data)}: junk or a cut frame"}[stop]
        return (f"is truncated: its {tag} header claims {frames} frames but only {max(present, 0)} "
                f"are whole ({where})")
    if frames is None and stop == "cut":
        return f"is cut inside its last frame (byte {pos} of {len(data)}): the file is truncated"
    return None


def mp3_header(data: bytes | memoryview) -> tuple[int, int, float] | None:
    """(sample_rate, channels, duration_s) of an MP3 without a Xing/Info frame, by walking every
    frame header; None for anything else (not MPEG audio, or a stream whose first frame states
    its length: libsndfile reads that, as its decoder does, once `mp3_xing_problem` vouched that
    the frames it claims are there).

    Without such a frame libsndfile only estimates the length, from the bytes (ID3 tags, cover
    art included) and the first frame's bitrate: off by a frame or more, by several times with
    a large tag, while its decoder reads every frame. A VBRI frame (Fraunhofer's) is no
    exception: libsndfile's decoder does not read it, and decodes it as one more (silent) frame.
    HeaderError where the frames stop before the data ends (junk, or a cut frame), since a
    decoder would resync or stop elsewhere.
    """
    start = id3v2_end(data)
    first = _mpeg_frame(data, start)
    if first is None:
        return None
    if _xing_claims(bytes(data[start:start + min(first[0], 200)])) is not None:
        return None
    return _mpeg_stream(data, start)
