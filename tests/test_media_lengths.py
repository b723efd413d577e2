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


def test_wavs_joined_with_cat_are_refused_and_what_else_may_follow_a_wav_is_not():
    """`cat a.wav b.wav`: the first file's header counted 1 s, while libsndfile refuses the
    whole file at the second RIFF header, so the clip trained on a blank input."""
    first, second = _wav(16000), _wav(8000)
    with pytest.raises(CountError, match=f"a second WAV file starts at byte {len(first)} \\(files "
                                         "joined with cat\\).*sox a.wav b.wav out.wav") as err:
        COUNTER.audio(first + second)
    assert err.value.reason == "bad_audio"
    with pytest.raises(RuntimeError):
        soundfile.read(io.BytesIO(first + second))
    for tail in (bytes(1000), b"TAG" + bytes(125), b"junk after the data " * 5):
        enc, rows = _rows_as_planned(first + tail)  # libsndfile reads these as the clip alone
        assert enc == rows == COUNTER.audio(first)[0]


def test_a_pcm_wav_whose_block_align_lies_is_refused():
    """Mono 16-bit with block_align 4 (and byte_rate to match) counted half the frames the
    decoder reads (it goes by channels and bits)."""
    d = bytearray(_wav(16000))
    fmt = d.find(b"fmt ") + 8
    struct.pack_into("<I", d, fmt + 8, 16000 * 4)  # byte_rate
    struct.pack_into("<H", d, fmt + 12, 4)  # block_align
    with pytest.raises(CountError, match="block_align=4 != channels=1 \\* 2 bytes"):
        COUNTER.audio(bytes(d))


def _mp3(rate: int, frames: int, *, cover_bytes: int = 0, xing: bool = False, container: str = "mp3",
         channels: int = 1, wave: np.ndarray | None = None, vbr_quality: int | None = None) -> bytes:
    """An MP3 of LAME frames without a Xing/Info frame (as some encoders and cutters leave),
    with an ID3v2 tag of `cover_bytes` in front when given; with `xing`, FFmpeg's Info frame
    first (as LAME writes by default); in a WAV (format tag 0x55) with `container="wav"`. Of
    `wave` ([channels, frames] in [-1, 1]) where given, else a sine; VBR at `vbr_quality`
    (LAME's -q:a) where given, else LAME's constant bitrate."""
    av = pytest.importorskip("av")
    out = io.BytesIO()
    options = {} if container != "mp3" else {"id3v2_version": "0"} if xing else {"write_xing": "0", "id3v2_version": "0"}
    try:
        container = av.open(out, "w", format=container, options=options)
        stream = container.add_stream("libmp3lame", rate=rate)
    except (av.error.FFmpegError, ValueError) as e:
        pytest.skip(f"no MP3 encoder in this PyAV: {e}")
    layout = "mono" if channels == 1 else "stereo"
    stream.layout = layout
    if vbr_quality is not None:
        stream.codec_context.qscale = vbr_quality
        stream.codec_context.flags |= av.codec.context.Flags.qscale
    step = stream.codec_context.frame_size or 1152
    fmt = stream.codec_context.format.name
    if wave is None:
        wave = np.repeat(0.3 * np.sin(np.arange(frames) * 0.05)[None], channels, axis=0)
    for pos in range(0, frames, step):
        chunk = wave[:, pos:pos + step]
        if not stream.codec_context.format.is_planar:
            chunk = chunk.T.reshape(1, -1)
        if fmt.startswith("s16"):
            chunk = (chunk * 32767).astype(np.int16)
        elif fmt.startswith("s32"):
            chunk = (chunk.astype(np.float64) * (2**31 - 1)).astype(np.int32)
        else:
            chunk = chunk.astype(np.float32)
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(chunk), format=fmt, layout=layout)
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


def test_an_mp3_with_zeros_inside_is_refused_not_counted_to_the_gap():
    """Zero bytes are padding only at the end: a gap of zeros inside the frames was taken for it,
    and the frames before it counted (1.0 s), while the decoder resyncs and reads on (2.0 s)."""
    d = _mp3(44100, 2 * 44100)
    from pipeline.headers import _mpeg_frame

    pos = 0
    for _ in range(38):
        pos += _mpeg_frame(d, pos)[0]
    gapped = d[:pos] + bytes(64) + d[pos:]
    with pytest.raises(CountError, match=f"MP3 frames stop at byte {pos} of {len(gapped)}: junk"):
        COUNTER.audio(gapped)
    assert COUNTER.audio(d + bytes(64))[0] == COUNTER.audio(d)[0]  # padding at the end is none


def _sf_mp3(frames: int, rate: int) -> bytes:
    """An MP3 written by libsndfile (>= 1.1, through LAME): it has a Xing frame."""
    out = io.BytesIO()
    try:
        soundfile.write(out, 0.3 * np.sin(np.arange(frames) * 0.05), rate, format="MP3",
                        subtype="MPEG_LAYER_III")
    except (TypeError, ValueError, RuntimeError, soundfile.LibsndfileError) as e:
        pytest.skip(f"this libsndfile writes no MP3: {e}")
    return out.getvalue()


@pytest.mark.parametrize("writer", ["lame 44100", "lame 16000", "libsndfile 44100", "libsndfile 22050"])
def test_an_mp3_with_a_xing_frame_cut_short_is_refused(writer):
    """libsndfile states the length a Xing/Info frame claims, however much of the file is there:
    a partial download of 3 s, cut by one byte, was counted 150 rows and decoded to 149; cut in
    half, 150 against 74. The whole file counts as it decodes; every cut is refused as truncated."""
    name, rate = writer.split()
    rate = int(rate)
    data = _mp3(rate, 3 * rate, xing=True) if name == "lame" else _sf_mp3(3 * rate, rate)
    assert b"Xing" in data[:200] or b"Info" in data[:200]
    enc, rows = _rows_as_planned(data)
    assert enc == rows
    assert COUNTER.audio(data)[2]["duration_s"] == pytest.approx(_decoded_s(data))
    assert COUNTER.audio(data + b"TAG" + bytes(125))[0] == enc  # an ID3v1 tag after it is no cut
    for cut in (1, 2, 100, 417, 1300, len(data) // 2, len(data) - 300):
        part = data[:len(data) - cut]
        with pytest.raises(CountError, match=r"MP3 is truncated: its (Xing|Info) header claims \d+ "
                                             r"frames but only \d+ are whole") as err:
            COUNTER.audio(part)
        assert err.value.reason == "bad_audio"


@pytest.mark.parametrize("writer", ["lame 44100", "libsndfile 22050"])
@pytest.mark.parametrize("missing", ["half", "a tenth", "2000 bytes"])
def test_a_preallocated_partial_mp3_download_is_refused(writer, missing):
    """aria2, BitTorrent clients and other preallocating downloaders leave an interrupted file
    at its full size, zeros where the later frames should be: its Xing/Info byte count matched
    the file, so it was counted whole and trained on a blank input (the decoder fails or
    stops at the zeros)."""
    name, rate = writer.split()
    data = _mp3(int(rate), 3 * int(rate), xing=True) if name == "lame" else _sf_mp3(3 * int(rate), int(rate))
    cut = {"half": len(data) // 2, "a tenth": len(data) * 9 // 10, "2000 bytes": len(data) - 2000}[missing]
    partial = data[:cut] + bytes(len(data) - cut)
    with pytest.raises(CountError, match=r"MP3 is truncated: its (Xing|Info) header claims \d+ "
                                         r"frames but only \d+ are whole") as err:
        COUNTER.audio(partial)
    assert err.value.reason == "bad_audio"


def _vbr_mp3(xing: bool, rate: int = 44100) -> bytes:
    """4 s of a VBR MP3 (LAME -q:a 4): 2 s of loud noise, then 2 s of silence, so its first
    frames are far richer than its mean; with FFmpeg's Info frame first, or without
    (`-write_xing 0`, as a stripped header or a stream rip leaves)."""
    t = np.arange(4 * rate) / rate
    noise = np.random.default_rng(0).standard_normal(t.size)
    wave = np.clip(np.where(t < 2, 0.3 * np.sin(2 * np.pi * 440 * t) + 0.2 * noise, 0), -1, 1)
    return _mp3(rate, t.size, xing=xing, wave=wave[None], vbr_quality=4)


def test_a_vbr_mp3_without_its_xing_frame_is_refused_where_libsndfile_reads_a_prefix():
    """Without a Xing/Info frame libsndfile reads up to its estimate of the length, from the
    first frame's bitrate: 1.28 s of the 4.05 s a VBR stream that starts loud holds. It was
    counted by its frames and trained on a blank input; it is refused naming the fix. With its
    Info frame the same audio counts as it decodes."""
    plain = _vbr_mp3(xing=False)
    assert _decoded_s(plain) < 2.0  # what the trainers' decoder reads of it
    with pytest.raises(CountError, match=r"MP3 without a Xing/Info header: libsndfile \(the "
                                         r"trainers' decoder\) reads only its estimate of 1\.\d+ s "
                                         r"of the 4\.\d+ s its frames hold.*ffmpeg -i in\.mp3 "
                                         r"-c:a copy out\.mp3") as err:
        COUNTER.audio(plain)
    assert err.value.reason == "bad_audio"
    tagged = _vbr_mp3(xing=True)
    enc, rows = _rows_as_planned(tagged)
    assert enc == rows and COUNTER.audio(tagged)[2]["duration_s"] == pytest.approx(_decoded_s(tagged))


def test_an_mp3_with_a_vbri_frame_is_counted_by_its_frames():
    """libsndfile's decoder reads no VBRI frame (Fraunhofer's Xing): it estimated the length from
    the bytes (3.05 s for 3.03 s of frames, 153 rows counted, 152 decoded) and decodes the VBRI
    frame as one more frame, which the frame walk counts."""
    from pipeline.headers import _mpeg_frame

    plain = _mp3(44100, 3 * 44100)
    size = _mpeg_frame(plain, 0)[0]
    vbri = bytearray(size)
    vbri[:4] = plain[:4]
    vbri[36:62] = b"VBRI" + struct.pack(">HHHIIHHHH", 1, 576, 75, len(plain), len(plain) // size, 0, 1, 1, 1)
    data = bytes(vbri) + plain[size:]
    enc, rows = _rows_as_planned(data)
    assert enc == rows
    assert COUNTER.audio(data)[2]["duration_s"] == pytest.approx(_decoded_s(data))
    with pytest.raises(CountError, match="MP3 is cut inside its last frame"):
        COUNTER.audio(data[:-1])


@pytest.mark.parametrize(("rate", "channels", "seconds"), [(44100, 1, 3.0), (16000, 2, 1.7),
                                                           (22050, 1, 0.5), (48000, 2, 7.3)])
def test_an_mp3_inside_a_wav_is_counted_by_its_frames(rate, channels, seconds):
    """`ffmpeg -c:a libmp3lame x.wav` (format tag 0x55): libsndfile states the length from the
    byte rate (153 rows of a 3 s clip) while its decoder reads every frame (152 rows)."""
    data = _mp3(rate, int(rate * seconds), container="wav", channels=channels)
    assert data[20:22] == b"\x55\x00"
    enc, rows = _rows_as_planned(data)
    assert enc == rows
    assert COUNTER.audio(data)[2]["duration_s"] == pytest.approx(_decoded_s(data))
    with pytest.raises(CountError, match=r"wav \(MP3\) data chunk declares \d+ bytes but \d+ are "
                                         "present: the file is truncated"):
        COUNTER.audio(data[:len(data) * 2 // 3])


@pytest.mark.parametrize("subtype", ["ULAW", "ALAW", "IMA_ADPCM", "MS_ADPCM", "GSM610", "G721_32"])
def test_other_compressed_wavs_count_as_they_decode(subtype):
    """The WAV codecs libsndfile both states and decodes alike keep its count."""
    d = _wav(16000 * 2 + 123, rate=8000 if subtype in ("GSM610", "G721_32") else 16000, subtype=subtype)
    enc, rows = _rows_as_planned(d)
    assert enc == rows
    assert COUNTER.audio(d)[2]["duration_s"] == pytest.approx(_decoded_s(d))


def test_a_cut_ogg_vorbis_is_refused_as_empty_or_truncated():
    """A cut Ogg Vorbis whose header libsndfile reads as 0 samples was refused as `audio clip is
    empty`, which sent one looking for a silent file rather than a partial download."""
    out = io.BytesIO()
    soundfile.write(out, 0.3 * np.sin(np.arange(3 * 44100) * 0.05), 44100, format="OGG", subtype="VORBIS")
    data = out.getvalue()
    refused = 0
    for cut in range(len(data) // 2, len(data), len(data) // 16):
        try:
            enc, rows = _rows_as_planned(data[:cut])
        except CountError as e:
            assert e.reason == "bad_audio" and "empty or truncated" in str(e), e
            refused += 1
        else:
            assert enc == rows
    assert refused


def test_audio_of_a_format_libsndfile_cannot_read_is_refused_naming_it():
    """An M4A mapped as audio was refused with libsndfile's bare `Format not recognised.`"""
    av = pytest.importorskip("av")
    out = io.BytesIO()
    try:
        with av.open(out, "w", format="ipod") as c:
            s = c.add_stream("aac", rate=44100)
            s.layout = "mono"
            fmt = s.codec_context.format.name
            for pos in range(0, 44100, 1024):
                frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format=fmt, layout="mono")
                frame.sample_rate, frame.pts = 44100, pos
                for p in s.encode(frame):
                    c.mux(p)
            for p in s.encode(None):
                c.mux(p)
    except (av.error.FFmpegError, ValueError) as e:
        pytest.skip(f"no AAC encoder or M4A muxer in this PyAV: {e}")
    with pytest.raises(CountError, match=r"this is an MP4/M4A container \(brand 'M4A': AAC or ALAC "
                                         r"audio\), which audio members may not be \(they may be WAV, "
                                         "FLAC, MP3, Ogg Vorbis or Opus") as err:
        COUNTER.audio(out.getvalue())
    assert err.value.reason == "bad_audio"
    with pytest.raises(CountError, match="Format not recognised. Audio members may be WAV, FLAC, MP3"):
        COUNTER.audio(b"neither of them " * 20)


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


def test_a_long_header_walk_lets_the_reader_s_session_heartbeat():
    """Probe: counting a long clip in the reader's session thread (a local shard) held its
    heartbeats back past the dispatcher's timeout: the reader was dropped three times and a
    good sample abandoned. Long walks call the thread's keepalive hook every 4096 frames."""
    import threading

    from pipeline import headers, keepalive

    d = _mp3(16000, 16000)
    start = headers.id3v2_end(d)
    first = headers._mpeg_frame(d, start)[0]
    middle = d[start + 4 * first:start + 5 * first]  # a CBR frame, repeated: hours of audio
    long = d[:start] + middle * 20_000
    beats: list[str] = []
    keepalive.install(lambda: beats.append(threading.current_thread().name))
    try:
        rate, _, seconds = headers.mp3_header(long)
    finally:
        keepalive.install(None)
    assert seconds > 600 and len(beats) == 20_000 // (keepalive.EVERY + 1)
    other: list[float] = []  # a thread without the hook (read-ahead, inspect): none called
    t = threading.Thread(target=lambda: other.append(headers.mp3_header(long)[2]))
    t.start()
    t.join(60)
    assert other == [seconds] and len(beats) == 20_000 // (keepalive.EVERY + 1)

