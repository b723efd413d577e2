"""Audio written by streaming encoders, which cannot seek back to patch the length into the
header: a WAV with a placeholder data size, a FLAC whose STREAMINFO leaves total samples 0. Both
decode; each is counted by its real length, agreeing with what the decoder returns."""

from __future__ import annotations

import io
import struct
import tarfile

import numpy as np
import pytest
import soundfile

from pipeline.counting import AudioConfig, CountError, Counter, CountingConfig
from pipeline.errors import ErrorStats
from pipeline.headers import wav_header
from pipeline.reader import ReaderConfig, iter_samples

pytestmark = pytest.mark.timeout(120)

COUNTER = Counter(CountingConfig())
FFMPEG_UNKNOWN = 0xFFFFFFFF  # ffmpeg's RIFF and data sizes when its output is a pipe
SOX_UNKNOWN = 0x7FFFF000  # SoX's (MS_UNSPEC), rounded down to whole blocks


def _noise(frames: int, channels: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(-0.5, 0.5, (frames, channels)).astype(np.float32)


def _encode(frames: int, rate: int, channels: int, fmt: str, subtype: str) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, _noise(frames, channels), rate, format=fmt, subtype=subtype)
    return out.getvalue()


def _decoded(data: bytes) -> np.ndarray:
    """What a decoder returns for `data`: soundfile reads streaming WAVs front to back."""
    return soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)[0]


def _decoded_frames(data: bytes) -> int:
    return len(_decoded(data))


# ------------------------------------------------------------------------------------ WAV
def _streamed_wav(frames: int, rate: int = 16000, channels: int = 1, subtype: str = "PCM_16",
                  size: int | None = FFMPEG_UNKNOWN) -> bytes:
    """A WAV whose RIFF and data chunk sizes are a streaming writer's placeholder; `size=None`
    is SoX's, which depends on the block alignment."""
    data = bytearray(_encode(frames, rate, channels, "WAV", subtype))
    at = data.index(b"data") + 4
    if size is None:
        align = struct.unpack_from("<H", data, data.index(b"fmt ") + 20)[0]
        size = SOX_UNKNOWN // align * align
    struct.pack_into("<I", data, 4, min(size + at - 4, 0xFFFFFFFF))
    struct.pack_into("<I", data, at, size)
    return bytes(data)


@pytest.mark.parametrize("size", [FFMPEG_UNKNOWN, None], ids=["ffmpeg", "sox"])
@pytest.mark.parametrize(("rate", "channels", "subtype"), [
    (16000, 1, "PCM_16"), (44100, 2, "PCM_24"), (8000, 1, "FLOAT"), (48000, 6, "PCM_32"),
])
def test_a_streamed_wav_is_counted_to_the_end_of_its_member(size, rate, channels, subtype):
    frames = 20011
    data = _streamed_wav(frames, rate, channels, subtype, size)
    assert _decoded_frames(data) == frames  # libsndfile reads it whole
    enc, llm, meta = COUNTER.audio(data)
    assert meta == {"duration_s": pytest.approx(frames / rate), "sample_rate": rate, "channels": channels}
    assert wav_header(data) == (rate, channels, pytest.approx(frames / rate))


def test_a_streamed_wav_counts_what_the_decoder_reads_past_a_cut_block_or_a_trailing_chunk():
    """With no size to stop at, a decoder reads every whole block to the end of the file: the
    last, cut block is dropped and a chunk after the data is read as samples."""
    data = _streamed_wav(16000, 16000, 2, "PCM_24")  # 6-byte blocks
    for variant in (data[:-1], data[:-5], data + b"LIST" + struct.pack("<I", 4) + b"INFO"):
        frames = _decoded_frames(variant)
        assert frames == (len(variant) - len(data) + 16000 * 6) // 6
        assert COUNTER.audio(variant)[2]["duration_s"] == pytest.approx(frames / 16000)


def test_soundfile_info_agrees_on_a_streamed_wav():
    """The placeholder is no trap for libsndfile either: its header-only duration is right."""
    data = _streamed_wav(24000)
    assert soundfile.info(io.BytesIO(data)).duration == pytest.approx(1.5)
    assert COUNTER.audio(data)[2]["duration_s"] == pytest.approx(1.5)


@pytest.mark.parametrize("size", [FFMPEG_UNKNOWN - 1, 10**9, SOX_UNKNOWN + 2])
def test_a_wav_declaring_more_data_than_it_holds_is_still_refused(size):
    """Only the placeholders are no claim: any other size over the bytes present is a cut file
    (SoX's placeholder is a whole number of blocks, so SOX_UNKNOWN + 2 is not one for 2-byte ones)."""
    data = _streamed_wav(16000, size=size)
    with pytest.raises(CountError, match=f"declares {size} bytes but 32000 are present") as err:
        COUNTER.audio(data)
    assert err.value.reason == "bad_audio"


def test_a_sox_placeholder_of_another_block_size_is_refused():
    """SoX rounds its placeholder down to whole blocks: 0x7FFFF000 with 3-byte blocks is not it."""
    data = bytearray(_streamed_wav(16000, subtype="PCM_24", size=None))
    struct.pack_into("<I", data, data.index(b"data") + 4, SOX_UNKNOWN)
    with pytest.raises(CountError, match="declares 2147479552 bytes"):
        COUNTER.audio(bytes(data))


def test_a_wav_whose_data_size_is_zero_is_refused_as_the_decoder_reads_it_empty():
    """Some writers leave 0 instead of a placeholder; libsndfile then reads no samples, so the
    trainer would get an empty clip: refused, saying why."""
    data = _streamed_wav(16000, size=0)
    assert _decoded_frames(data) == 0
    with pytest.raises(CountError, match="declares 0 bytes although 32000 follow it") as err:
        COUNTER.audio(data)
    assert err.value.reason == "bad_audio"


def test_a_streamed_wav_with_no_samples_is_empty():
    data = _streamed_wav(16000)
    head = data[: data.index(b"data") + 8]
    with pytest.raises(CountError, match="empty") as err:
        COUNTER.audio(head)
    assert err.value.reason == "bad_audio"
    with pytest.raises(CountError, match="empty"):
        COUNTER.audio(head + b"\x01")  # less than one block


# ----------------------------------------------------------------------------------- FLAC
_FLAC_SAMPLES = (1 << 36) - 1


def _unstated(data: bytes, *, frame_sizes: bool = True, max_block: int | None = None) -> bytes:
    """`data` with STREAMINFO's total samples and MD5 zeroed, as a streaming encoder leaves
    them; `frame_sizes=False` zeroes the min/max frame sizes too (unknown)."""
    out = bytearray(data)
    (packed,) = struct.unpack_from(">Q", out, 18)  # rate:20 channels-1:3 bits-1:5 samples:36
    struct.pack_into(">Q", out, 18, packed & ~_FLAC_SAMPLES)
    out[26:42] = bytes(16)
    if not frame_sizes:
        out[12:18] = bytes(6)
    if max_block is not None:
        struct.pack_into(">H", out, 10, max_block)
    return bytes(out)


def _flac(frames: int, rate: int = 16000, channels: int = 1, subtype: str = "PCM_16") -> bytes:
    return _encode(frames, rate, channels, "FLAC", subtype)


FLAC_CASES = [  # frames: a partial last frame, one frame, a whole number of frames, under one
    (32000, 16000, 1, "PCM_16"), (4096, 16000, 1, "PCM_16"), (3 * 4096, 44100, 2, "PCM_24"),
    (1000, 8000, 1, "PCM_16"), (44100, 48000, 2, "PCM_16"),
]


@pytest.mark.parametrize(("frames", "rate", "channels", "subtype"), FLAC_CASES)
def test_a_flac_of_unstated_length_is_refused_saying_so(frames, rate, channels, subtype):
    """libsndfile reports no length for it (SF_COUNT_MAX frames, which counting took for a
    5.8e14 s clip) and soundfile.read, the trainer's decoder, cannot read it: it is refused as
    what it is, with the fix."""
    data = _unstated(_flac(frames, rate, channels, subtype))
    info = soundfile.info(io.BytesIO(data))
    assert info.frames == 2**63 - 1
    with pytest.raises(Exception):
        soundfile.read(io.BytesIO(data))
    with pytest.raises(CountError, match=r"does not state its length .* re-encode it") as err:
        COUNTER.audio(data)
    assert err.value.reason == "bad_audio" and "max_duration_s" not in str(err.value)


# --------------------------------------------------------------------------------- reader
def test_the_reader_delivers_a_streamed_wav_and_skips_an_unstated_flac_saying_why(tmp_path):
    path = tmp_path / "streams.tar"
    members = [("a.wav", _streamed_wav(32000)), ("a.txt", b"c"),
               ("b.flac", _unstated(_flac(32000))), ("b.txt", b"c")]
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    stats = ErrorStats()
    records = list(iter_samples([str(path)], ReaderConfig(), stats=stats))
    assert {r.key: [i.meta["duration_s"] for i in r.items] for r in records} == {"a": [2.0]}
    assert [(key, reason) for reason, _, key, _ in stats.recent] == [("b", "bad_audio")]


# ----------------------------------------------------------------------------- preprocess
def test_preprocess_decodes_a_streamed_wav_to_the_counted_length():
    from pipeline.preprocess import N_MELS, PreprocessConfig, preprocess_item

    data = _streamed_wav(24000)
    enc, _, _ = COUNTER.audio(data)
    out = preprocess_item("audio", data, PreprocessConfig(), enc_len=enc, key="k", member="wav")
    assert enc == 75 and out.shape == (enc, 2 * N_MELS)
