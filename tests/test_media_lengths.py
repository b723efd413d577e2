"""Media whose header states another length than its decoder reads: each is counted as the
trainer decodes it (the planned rows are the rows it gets), or refused on the data node, or,
where only the decoder can tell (a corrupt stream), a blank input instead of a stopped loop."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest
import soundfile

from pipeline.counting import CountError, Counter, CountingConfig, UndecodableError
from pipeline.preprocess import PreprocessConfig, PreprocessError, preprocess_item

pytestmark = pytest.mark.timeout(120)

CONFIG = CountingConfig()
COUNTER = Counter(CONFIG)
PRE = PreprocessConfig.of(CONFIG)


def _rows_as_planned(data: bytes) -> tuple[int, int]:
    """(counted enc_len, rows the trainer's preprocessing gives) of an audio member."""
    enc, _, meta = COUNTER.audio(data)
    out = preprocess_item("audio", data, PRE, enc_len=enc, key="k", member="wav", meta=meta)
    return enc, out.shape[0]


def _decoded_s(data: bytes) -> float:
    wave, rate = soundfile.read(io.BytesIO(data))
    return len(wave) / rate


def _wav(frames: int, rate: int = 16000, subtype: str = "PCM_16", channels: int = 1) -> bytes:
    out = io.BytesIO()
    wave = (0.3 * np.sin(np.arange(frames * channels) * 0.05)).reshape(frames, channels)
    soundfile.write(out, wave.astype(np.float32), rate, format="WAV", subtype=subtype)
    return out.getvalue()


def _data_chunk(d: bytearray) -> int:
    return d.find(b"data")


@pytest.mark.parametrize(("channels", "subtype", "extra"), [(1, "PCM_16", 1), (2, "PCM_24", 5)])
def test_a_wav_data_chunk_ending_in_part_of_a_block_counts_whole_blocks(channels, subtype, extra):
    """641 bytes of 16-bit mono (20 ms and a byte) were counted as 2 rows; the decoder reads
    whole blocks, 1 row."""
    d = bytearray(_wav(320 if channels == 1 else 16000, subtype=subtype, channels=channels))
    pos = _data_chunk(d)
    (size,) = struct.unpack_from("<I", d, pos + 4)
    d += bytes(extra)
    struct.pack_into("<I", d, pos + 4, size + extra)
    struct.pack_into("<I", d, 4, len(d) - 8)
    enc, rows = _rows_as_planned(bytes(d))
    assert enc == rows
    assert COUNTER.audio(bytes(d))[2]["duration_s"] == pytest.approx(_decoded_s(bytes(d)))


@pytest.mark.parametrize("frames", [48123, 16000 * 2 + 7, 31999])
def test_a_compressed_wav_is_counted_by_its_decoder_not_its_nominal_byte_rate(frames):
    """GSM 6.10: data bytes / byte_rate said 3.02 s where the decoder reads 3.04 s (whole
    320-sample blocks)."""
    d = _wav(frames, subtype="GSM610")
    enc, rows = _rows_as_planned(d)
    assert enc == rows
    assert COUNTER.audio(d)[2]["duration_s"] == pytest.approx(_decoded_s(d))


def test_a_pcm_wav_whose_block_align_lies_is_refused():
    """Mono 16-bit with block_align 4 (and byte_rate to match) counted half the frames the
    decoder reads (it goes by channels and bits)."""
    d = bytearray(_wav(16000))
    fmt = d.find(b"fmt ") + 8
    struct.pack_into("<I", d, fmt + 8, 16000 * 4)  # byte_rate
    struct.pack_into("<H", d, fmt + 12, 4)  # block_align
    with pytest.raises(CountError, match="block_align=4 != channels=1 \\* 2 bytes"):
        COUNTER.audio(bytes(d))


def _mp3(rate: int, frames: int, *, cover_bytes: int = 0) -> bytes:
    """An MP3 of LAME frames without a Xing/Info frame (as some encoders and cutters leave),
    with an ID3v2 tag of `cover_bytes` in front when given."""
    av = pytest.importorskip("av")
    out = io.BytesIO()
    try:
        container = av.open(out, "w", format="mp3", options={"write_xing": "0", "id3v2_version": "0"})
        stream = container.add_stream("libmp3lame", rate=rate)
    except (av.error.FFmpegError, ValueError) as e:
        pytest.skip(f"no MP3 encoder in this PyAV: {e}")
    stream.layout = "mono"
    step = stream.codec_context.frame_size or 1152
    fmt = stream.codec_context.format.name
    wave = 0.3 * np.sin(np.arange(frames) * 0.05)
    for pos in range(0, frames, step):
        chunk = wave[pos:pos + step]
        if fmt.startswith("s16"):
            chunk = (chunk * 32767).astype(np.int16)
        elif fmt.startswith("s32"):
            chunk = (chunk * (2**31 - 1)).astype(np.int32)
        else:
            chunk = chunk.astype(np.float32)
        frame = av.AudioFrame.from_ndarray(chunk.reshape(1, -1), format=fmt, layout="mono")
        frame.sample_rate, frame.pts = rate, pos
        for packet in stream.encode(frame):
            container.mux(packet)
    for packet in stream.encode(None):
        container.mux(packet)
    container.close()
    data = out.getvalue()
    if cover_bytes:
        body = b"\x00image/jpeg\x00\x03\x00\xff\xd8" + bytes(cover_bytes)
        frame = b"APIC" + len(body).to_bytes(4, "big") + b"\x00\x00" + body
        n = len(frame)
        size = bytes([(n >> 21) & 127, (n >> 14) & 127, (n >> 7) & 127, n & 127])
        data = b"ID3\x03\x00\x00" + size + frame + data
    return data


@pytest.mark.parametrize(("rate", "frames", "cover"), [(44100, 88251, 0), (16000, 32005, 0),
                                                       (44100, 88251, 200_000), (22050, 40000, 3000)])
def test_an_mp3_without_a_xing_frame_is_counted_by_its_frames(rate, frames, cover):
    """libsndfile estimates such a file's length from its bytes (a cover-art tag included): a
    row too many, or 7x as many with 200 KB of cover art, and the trainer's loop stopped."""
    d = _mp3(rate, frames, cover_bytes=cover)
    enc, rows = _rows_as_planned(d)
    assert enc == rows
    assert COUNTER.audio(d)[2]["duration_s"] == pytest.approx(_decoded_s(d))


def test_a_corrupt_video_stream_is_undecodable_not_a_stopped_loop():
    """Intact tables over garbage H.264: PyAV's InvalidDataError is a ValueError, which passed
    as a plan disagreement (the loop stops) instead of an undecodable item (a blank input)."""
    av = pytest.importorskip("av")
    from pipeline.video import count_video

    out = io.BytesIO()
    try:
        with av.open(out, "w", format="mp4") as c:
            s = c.add_stream("libx264", rate=25)
            s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
            for i in range(20):
                frame = av.VideoFrame.from_ndarray(np.full((48, 64, 3), i * 10, np.uint8), format="rgb24")
                frame.pts = i
                for p in s.encode(frame):
                    c.mux(p)
            for p in s.encode(None):
                c.mux(p)
    except (av.error.FFmpegError, ValueError) as e:
        pytest.skip(f"no H.264 encoder in this PyAV: {e}")
    d = bytearray(out.getvalue())
    avcc = d.find(b"avcC")
    d[avcc:avcc + 4] = b"xxxx"  # the decoder's configuration is gone; the tables still count
    enc, _, meta = count_video(bytes(d), CONFIG.video)
    with pytest.raises(PreprocessError) as got:
        preprocess_item("video", bytes(d), PRE, enc_len=enc, key="k", member="mp4", meta=meta)
    assert got.value.undecodable and "does not decode" in str(got.value)
    assert issubclass(UndecodableError, ValueError)
