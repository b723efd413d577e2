"""Counting rules: image resize policy, audio durations from headers, text estimator accuracy."""

from __future__ import annotations

import argparse
import io
import json
import struct
import warnings
import zlib

import numpy as np
import pytest
import soundfile
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from pipeline.counting import (
    AudioConfig,
    CountError,
    Counter,
    CountingConfig,
    EmptyField,
    ImageConfig,
    TextConfig,
    audio_lengths,
    estimate_tokens,
    gunzip,
    image_lengths,
    smart_resize,
    wav_header,
)
from pipeline.tokenize import ByteTokenizer

QWEN = ImageConfig()


def _png(width: int, height: int) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), (1, 2, 3)).save(out, "PNG")
    return out.getvalue()


def _wav(seconds: float, rate: int = 16000, channels: int = 1) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, np.zeros((int(seconds * rate), channels), np.float32), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


@pytest.mark.parametrize(
    ("width", "height", "expected_hw", "patches"),
    [
        # 800/28=28.57 -> 29*28=812, 1000/28=35.71 -> 36*28=1008; 812*1008 fits the budget.
        (1000, 800, (812, 1008), 58 * 72),
        # 12M px over 1003520: beta=sqrt(12e6/1003520)=3.4580; floor(3000/beta/28)=30 -> 840,
        # floor(4000/beta/28)=41 -> 1148.
        (4000, 3000, (840, 1148), 60 * 82),
        # 20x10 rounds to 28x28 < 3136: beta=sqrt(3136/200)=3.9598; ceil(10*beta/28)=2 -> 56,
        # ceil(20*beta/28)=3 -> 84.
        (20, 10, (56, 84), 4 * 6),
        # Exactly on the grid: unchanged.
        (448, 448, (448, 448), 32 * 32),
    ],
)
def test_smart_resize_hand_computed(width, height, expected_hw, patches):
    assert smart_resize(height, width, QWEN) == expected_hw
    assert image_lengths(width, height, QWEN) == (patches, patches // 4)


@settings(max_examples=300, deadline=None)
@given(width=st.integers(1, 20000), height=st.integers(1, 20000))
def test_smart_resize_respects_budget_and_grid(width, height):
    if max(width, height) / min(width, height) > QWEN.max_aspect_ratio:
        with pytest.raises(CountError):
            smart_resize(height, width, QWEN)
        return
    h, w = smart_resize(height, width, QWEN)
    assert h % 28 == 0 and w % 28 == 0
    assert QWEN.min_pixels <= h * w <= QWEN.max_pixels
    enc, llm = image_lengths(width, height, QWEN)
    assert enc == (h // 14) * (w // 14) and llm * 4 == enc


def test_image_header_counts_and_config_changes_them():
    counter = Counter(CountingConfig())
    enc, llm, meta = counter.image(_png(1000, 800))
    assert (enc, llm) == (4176, 1044)
    assert (meta["width"], meta["height"], meta["format"]) == (1000, 800, "PNG")
    small_budget = Counter(CountingConfig(image=ImageConfig(max_pixels=28 * 28 * 64)))
    enc_small, llm_small, _ = small_budget.image(_png(1000, 800))
    assert llm_small <= 64 < llm


def test_audio_lengths_plain_and_padded():
    assert audio_lengths(10.0, AudioConfig()) == (500, 250)
    padded = AudioConfig(pad_window_s=30.0)
    assert audio_lengths(10.0, padded) == (1500, 250)  # encoder sees the whole 30 s window
    assert audio_lengths(45.0, padded) == (3000, 1125)  # two windows, LLM follows real length
    assert audio_lengths(0.01, AudioConfig()) == (1, 1)


def test_wav_header_duration_and_lying_header():
    data = _wav(2.5, rate=16000, channels=2)
    rate, channels, duration = wav_header(data)
    assert (rate, channels) == (16000, 2) and duration == pytest.approx(2.5)
    enc, llm, meta = Counter(CountingConfig()).audio(data)
    assert (enc, llm) == (125, 62) and meta["duration_s"] == pytest.approx(2.5)  # 125 // 2
    # Claim 10 hours of audio in the data chunk while carrying 2.5 s.
    pos = data.index(b"data")
    lying = data[: pos + 4] + struct.pack("<I", 16000 * 4 * 36000) + data[pos + 8 :]
    with pytest.raises(CountError, match="declares") as err:
        Counter(CountingConfig()).audio(lying)
    assert err.value.reason == "bad_audio"


@pytest.mark.parametrize("samples", [800, 8000, 16160, 20800, 35520, 124320, 160, 161, 479999])
def test_audio_lengths_are_whisper_and_qwen2_audio_s_own(samples):
    """Qwen2-Audio's processor gives a 16 kHz clip ceil(samples / 160) mel frames, (mel - 1) //
    2 + 1 encoder frames and (frames - 2) // 2 + 1 <|AUDIO|> tokens: counted as ceil(25 per
    second), every clip with an odd number of frames planned one token more than the model
    emits, and 2.22 s (2.22 * 50 = 111.00000000000001) one encoder frame more."""
    from pipeline.counting import AudioConfig, audio_lengths

    mel = -(-samples // 160)
    frames = (mel - 1) // 2 + 1
    tokens = (frames - 2) // 2 + 1
    assert audio_lengths(samples / 16000, AudioConfig()) == (frames, max(1, tokens))
    enc, llm, _ = Counter(CountingConfig()).audio(_wav_frames(samples, 16000))
    assert (enc, llm) == (frames, max(1, tokens))


def _wav_frames(frames: int, rate: int) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, np.zeros(frames, np.float32), rate, format="WAV", subtype="PCM_16")
    return out.getvalue()


def test_flac_duration_via_soundfile():
    out = io.BytesIO()
    soundfile.write(out, np.zeros(8000 * 7, np.float32), 8000, format="FLAC")
    enc, llm, meta = Counter(CountingConfig()).audio(out.getvalue())
    assert meta["duration_s"] == pytest.approx(7.0) and meta["sample_rate"] == 8000
    assert (enc, llm) == (350, 175)
    with pytest.raises(CountError) as err:
        Counter(CountingConfig()).audio(b"fLaC" + bytes(100))
    assert err.value.reason == "bad_audio"


def test_image_bomb_header_rejected_without_allocation():
    import tracemalloc

    bomb = _png_header(100000, 100000)
    tracemalloc.start()
    try:
        with pytest.raises(CountError) as err:
            Counter(CountingConfig()).image(bomb)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert err.value.reason == "image_too_large"
    assert peak < 1 << 20  # 1e10 pixels would be 30 GB


def _png_header(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height, with one tiny IDAT: valid header, no pixels."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0")) + chunk(b"IEND", b"")


def test_guard_below_pillow_limit_is_ours():
    cfg = CountingConfig(image=ImageConfig(max_header_pixels=5000 * 5000))
    with pytest.raises(CountError, match="max_header_pixels") as err:
        Counter(cfg).image(_png_header(6000, 6000))
    assert err.value.reason == "image_too_large"
    assert Counter(cfg).image(_png_header(4000, 4000))[0] > 0


def test_json_text_fields_and_conversations():
    counter = Counter(CountingConfig())
    turns = [{"from": "human", "value": "a" * 40}, {"role": "assistant", "content": "b" * 80}]
    conv = json.dumps({"conversations": turns}).encode()
    got = counter.text(conv, "json", "m")
    chat = "<|im_start|>user\n" + "a" * 40 + "<|im_end|>\n<|im_start|>assistant\n" + "b" * 80 + "<|im_end|>\n"
    assert ByteTokenizer.decode(got.ids) == chat and int(got.mask.sum()) == 80 + len("<|im_end|>\n")
    # The estimator (inspect --estimate-text only) charges each turn its overhead.
    assert counter.estimate_text(conv, "json", "m") == 10 + 20 + 2 * TextConfig().chat_turn_overhead
    assert counter.estimate_text(json.dumps({"caption": "c" * 41}).encode(), "json", "m") == 11
    got = counter.text(json.dumps({"caption": "c" * 41}).encode(), "json", "m")
    assert (ByteTokenizer.decode(got.ids), got.mask.tolist()) == ("c" * 41, [1] * 41)
    assert len(counter.text(b'{"url": "x"}', "json", "m")) == 0
    custom = Counter(CountingConfig(text=TextConfig(json_fields=("prompt",))))
    assert ByteTokenizer.decode(custom.text(b'{"prompt": "abcdefgh", "text": "zz"}', "json", "m").ids) == "abcdefgh"
    # A top-level list is a conversation's turns (the field-map kind `conversation`).
    turns = counter.text(b'[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]',
                         "json", "m")
    assert len(turns) > 4 and 0 < int(turns.mask.sum()) < len(turns)
    for bad in (b"{not json", b"[1, 2]", b"7", b'{"text": 5}', b'{"messages": [{"role": "user"}]}'):
        with pytest.raises(CountError) as err:
            counter.text(bad, "json", "m")
        assert err.value.reason == "bad_json"
    with pytest.raises(CountError) as err:
        counter.text(b"caf\xe9", "txt", "m")
    assert err.value.reason == "bad_text"


def test_gunzip_guard():
    import gzip

    data = gzip.compress(b"x" * 100_000)
    assert gunzip(data, 100_000) == b"x" * 100_000
    with pytest.raises(CountError, match="max_text_bytes"):
        gunzip(data, 99_999)
    with pytest.raises(CountError, match="truncated"):
        gunzip(data[: len(data) // 2], 1 << 20)


def _python_docs() -> list[str]:
    topics = pytest.importorskip("pydoc_data.topics").topics
    return [topics[k] for k in sorted(topics)]


def test_estimator_error_bound_against_trained_bpe():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    docs = _python_docs()
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=8000, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(docs[::2], trainer)
    texts = [p for d in docs[1::2] for p in d.split("\n\n") if len(p) >= 100]
    assert len(texts) > 100
    real = np.array([len(tok.encode(t).ids) for t in texts], dtype=np.float64)
    est = np.array([estimate_tokens(t, TextConfig()) for t in texts], dtype=np.float64)
    rel = np.abs(est - real) / real
    # The bounds documented in TextConfig's docstring.
    assert abs(est.sum() / real.sum() - 1) <= 0.15
    assert np.median(rel) <= 0.20
    assert np.percentile(rel, 95) <= 0.45


def test_tokenizer_path_counts_exactly(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(_python_docs()[:40], trainers.BpeTrainer(vocab_size=2000, show_progress=False))
    path = str(tmp_path / "tok.json")
    tok.save(path)
    text = "The quick brown fox jumps over the lazy dog, twice."
    counter = Counter(CountingConfig(text=TextConfig(tokenizer_path=path)))
    assert counter.text(text.encode(), "txt", "m").ids.tolist() == tok.encode(text).ids


def test_estimator_non_ascii():
    assert estimate_tokens("東京都" * 10, TextConfig()) == 30
    assert estimate_tokens("abcd" * 10, TextConfig()) == 10
    assert estimate_tokens("", TextConfig()) == 0


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP", "GIF"])
def test_every_image_extension_format(fmt):
    out = io.BytesIO()
    Image.new("RGB", (300, 170), (5, 5, 5)).save(out, fmt)
    enc, llm, meta = Counter(CountingConfig()).image(out.getvalue())
    assert (meta["width"], meta["height"], meta["format"]) == (300, 170, fmt)
    assert (enc, llm) == image_lengths(300, 170, QWEN)


@pytest.mark.parametrize("fmt", ["MP3", "OGG"])
def test_compressed_audio_via_soundfile(fmt):
    if fmt not in soundfile.available_formats():
        pytest.skip(f"libsndfile {soundfile.__libsndfile_version__} cannot read {fmt}")
    out = io.BytesIO()
    soundfile.write(out, np.zeros(16000 * 3, np.float32), 16000, format=fmt)
    enc, llm, meta = Counter(CountingConfig()).audio(out.getvalue())
    assert meta["duration_s"] == pytest.approx(3.0, abs=0.05)
    assert llm == pytest.approx(75, abs=2) and enc == pytest.approx(150, abs=3)


@settings(max_examples=60, deadline=None)
@given(
    width=st.integers(1, 3000),
    height=st.integers(1, 3000),
    fmt=st.sampled_from(["JPEG", "PNG"]),
    mode=st.sampled_from(["RGB", "L", "CMYK", "RGBA"]),
    progressive=st.booleans(),
)
def test_fast_header_parsers_agree_with_pillow(width, height, fmt, mode, progressive):
    from pipeline.headers import jpeg_size, png_size

    if fmt == "JPEG" and mode == "RGBA" or fmt == "PNG" and mode == "CMYK":
        mode = "RGB"
    out = io.BytesIO()
    extra = {"progressive": progressive, "exif": Image.Exif()} if fmt == "JPEG" else {}
    Image.new(mode, (width, height)).save(out, fmt, **extra)
    data = out.getvalue()
    fast = png_size(data) if fmt == "PNG" else jpeg_size(data)
    with Image.open(io.BytesIO(data)) as im:
        assert fast == im.size


def test_fast_header_parsers_decline_garbage():
    from pipeline.headers import jpeg_size, png_size

    good = io.BytesIO()
    Image.new("RGB", (64, 32)).save(good, "PNG")
    corrupt = bytearray(good.getvalue())
    corrupt[18] ^= 0xFF  # width byte: IHDR CRC no longer matches
    assert png_size(bytes(corrupt)) is None
    assert jpeg_size(b"\xff\xd8\xff\xda" + bytes(50)) is None
    assert jpeg_size(b"\xff\xd8 junk") is None and png_size(b"\x89PNG") is None
    with pytest.raises(CountError) as err:
        Counter(CountingConfig()).image(bytes(corrupt))
    assert err.value.reason == "bad_image"


@pytest.mark.parametrize(("rate", "channels", "frames"), [(8000, 1, 8000 * 7), (44100, 2, 12345), (16000, 1, 3)])
def test_flac_fast_header_agrees_with_soundfile(rate, channels, frames):
    from pipeline.headers import flac_header

    out = io.BytesIO()
    soundfile.write(out, np.zeros((frames, channels), np.float32), rate, format="FLAC")
    data = out.getvalue()
    info = soundfile.info(io.BytesIO(data))
    assert flac_header(data) == (info.samplerate, info.channels, pytest.approx(info.duration))
    assert flac_header(b"fLaC" + bytes(60)) is None  # no STREAMINFO: left to libsndfile


def _flac(frames: int, channels: int, rate: int, subtype: str, seed: int = 0) -> bytes:
    out = io.BytesIO()
    noise = np.random.default_rng(seed).uniform(-0.5, 0.5, (frames, channels)).astype(np.float32)
    soundfile.write(out, noise, rate, format="FLAC", subtype=subtype)
    return out.getvalue()


def _crc16_bitwise(data: bytes) -> int:
    crc = 0
    for b in data:
        crc ^= b << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x8005) & 0xFFFF if crc & 0x8000 else (crc << 1) & 0xFFFF
    return crc


def test_flac_crc16_matches_the_bitwise_definition():
    from pipeline.headers import flac_crc16

    rng = np.random.default_rng(3)
    for n in (0, 1, 2, 255, 256, 257, 511, 4099):
        data = rng.integers(0, 256, n, dtype=np.uint8).tobytes()
        assert flac_crc16(data) == _crc16_bitwise(data)
        assert flac_crc16(memoryview(data)) == flac_crc16(data)


@pytest.mark.parametrize(("frames", "channels", "rate", "subtype"), [
    (16000 * 3 + 17, 1, 16000, "PCM_16"), (4096 * 5, 2, 44100, "PCM_24"), (3, 1, 8000, "PCM_16"),
    (1152 * 7 + 1, 6, 48000, "PCM_S8"), (200_000, 1, 22050, "PCM_16")])
def test_a_whole_flacs_last_frame_is_vouched_and_no_cut_one_is(frames, channels, rate, subtype):
    """The CRC check vouches for every whole stream libsndfile writes, and for no stream cut
    anywhere in its last frames (those go to libsndfile, which reports them bad_audio)."""
    from pipeline.headers import flac_last_frame_whole

    data = _flac(frames, channels, rate, subtype)
    assert flac_last_frame_whole(data) and flac_last_frame_whole(memoryview(data))
    cuts = list(range(1, min(len(data) - 42, 3000))) + list(range(3000, len(data) - 42, 997))
    assert not [c for c in cuts if flac_last_frame_whole(data[:-c])]
    assert not flac_last_frame_whole(data + b"TAG" + bytes(125))  # trailing bytes: not vouched
    flipped = bytearray(data)
    flipped[-5] ^= 0x10  # a bit of the last frame's body: its CRC-16 fails
    assert not flac_last_frame_whole(bytes(flipped))
    counter = Counter(CountingConfig())
    assert counter.audio(data)[2]["duration_s"] == pytest.approx(frames / rate)
    assert counter.audio(data + b"TAG" + bytes(125))[2]["duration_s"] == pytest.approx(frames / rate)
    with pytest.raises(CountError) as err:
        counter.audio(data[:-7])
    assert err.value.reason == "bad_audio"


def test_a_header_pixel_limit_past_what_pillow_decodes_is_refused_naming_it():
    """--max-header-pixels could be raised past Pillow's decompression-bomb limit: images were
    counted that the trainer's decoder then refused (blank inputs)."""
    from pipeline.counting import pillow_pixel_limit
    from pipeline.reader import add_reader_arguments, reader_config_from_args

    limit = pillow_pixel_limit()
    assert limit == 2 * Image.MAX_IMAGE_PIXELS == 178956970  # Pillow's default
    assert ImageConfig(max_header_pixels=limit).max_header_pixels == limit
    with pytest.raises(ValueError, match=rf"max_header_pixels={limit + 1} is over {limit}, the most "
                                         r"pixels Pillow decodes \(2 x PIL.Image.MAX_IMAGE_PIXELS"):
        ImageConfig(max_header_pixels=limit + 1)
    parser = argparse.ArgumentParser()
    add_reader_arguments(parser)
    with pytest.raises(ValueError, match=rf"^--max-header-pixels {10**9} is over {limit}.*give at "
                                         rf"most {limit}$"):
        reader_config_from_args(parser.parse_args(["--max-header-pixels", str(10**9)]))
    # the largest image it lets through decodes (Pillow only warns between 1x and 2x its limit)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        Image._decompression_bomb_check((limit, 1))
    with pytest.raises(Image.DecompressionBombError):
        Image._decompression_bomb_check((limit + 1, 1))


def _id3v2(size: int, footer: bool = False) -> bytes:
    """An ID3v2.4 tag of `size` bytes of frames (syncsafe size), with its footer if flagged."""
    syncsafe = bytes((size >> s) & 0x7F for s in (21, 14, 7, 0))
    return (b"ID3\x04\x00" + bytes([0x10 if footer else 0]) + syncsafe + bytes(size)
            + (b"3DI\x04\x00\x10" + syncsafe if footer else b""))


def test_a_flac_behind_an_id3v2_tag_is_checked_like_a_plain_flac():
    """The FLAC checks ran only on files starting with fLaC: one behind an ID3v2 tag (libsndfile
    reads it), cut short, was counted at full length and failed the trainer's decoder."""
    flac = _flac(71040, 1, 16000, "PCM_16")
    tagged = _id3v2(2048) + flac
    counter = Counter(CountingConfig())
    assert counter.audio(tagged)[2]["duration_s"] == pytest.approx(71040 / 16000)
    assert len(soundfile.read(io.BytesIO(tagged))[0]) == 71040
    for cut in (len(flac) // 3, 7, 1):
        with pytest.raises(CountError, match="FLAC cannot be read to its last sample") as err:
            counter.audio(tagged[:-cut])
        assert err.value.reason == "bad_audio"
    with pytest.raises(CountError, match=r"flac declares 71040 samples .* holds only"):
        counter.audio(tagged[:2048 + 10 + 42 + 100])
    # a tag with a footer, or two tags: libsndfile reads neither, so neither is counted
    for unread in (_id3v2(500, footer=True) + flac, _id3v2(300) + _id3v2(200) + flac):
        with pytest.raises(soundfile.LibsndfileError):
            soundfile.read(io.BytesIO(unread))
        with pytest.raises(CountError, match=r"ID3v2 tags that libsndfile does not read .*strip") as err:
            counter.audio(unread)
        assert err.value.reason == "bad_audio"


def test_a_byte_order_mark_and_an_empty_first_field_do_not_lose_the_text():
    """A JSON member saved with a BOM was bad_json, and {"text": "", "caption": ...} an empty
    sample: the BOM is dropped (from plain text too) and the first field holding text counts."""
    counter = Counter(CountingConfig())
    bom = "\ufeff".encode()
    assert counter.member_text(bom + b'{"caption": "a cat"}', "json", "k.json") == "a cat"
    assert counter.member_text(bom + b"a cat", "txt", "k.txt") == "a cat"
    assert counter.member_text(b'{"text": "", "caption": "a cat"}', "json", "k.json") == "a cat"
    # No text, as for metadata JSON, but with the empty field named (the first one).
    assert counter.member_text(b'{"text": "", "caption": ""}', "json", "k.json") == EmptyField("text", '""')
    assert counter.member_text(b'{"url": ""}', "json", "k.json") is None


# ------------------------------------------------------- JPEG processes Pillow cannot decode
#: 8x8 grayscale JPEGs with arithmetic coding (jpegtran -arithmetic [-progressive]): SOF9, SOF10.
_ARITH_JPEG = bytes.fromhex(
    "ffd8ffe000104a46494600010100000100010000ffdb0043001b12141714111b1716171e1c1b2028422b2825252851"
    "3a3d3042605565645f555d5b6a7899816a7190735b5d85b586909ea3abadab6780bcc9baa6c799a8aba4ffc9000b08"
    "0008000801011100ffcc000600101005ffda0008010100003f00ddbb0a1ad0ffd9")
_ARITH_PROGRESSIVE_JPEG = bytes.fromhex(
    "ffd8ffe000104a46494600010100000100010000ffdb0043001b12141714111b1716171e1c1b2028422b2825252851"
    "3a3d3042605565645f555d5b6a7899816a7190735b5d85b586909ea3abadab6780bcc9baa6c799a8aba4ffca000b08"
    "0008000801011100ffcc00040010ffda0008010100000001e0ffcc00041005ffda00080101000105021244ffcc0004"
    "1005ffda0008010100063f02c0ffcc00041005ffda0008010100013f214c70ffda0008010100000010c0ffcc000410"
    "05ffda0008010100013f1020ffd9")


def _ljpeg(pix_fmt: str) -> bytes:
    """A lossless JPEG (SOF3) from FFmpeg's ljpeg encoder: bgr24 gives 9-bit samples (its RGB
    transform needs one more bit), yuvj420p 8-bit ones."""
    import fractions

    av = pytest.importorskip("av")
    try:
        cc = av.CodecContext.create("ljpeg", "w")
    except (av.error.FFmpegError, ValueError) as e:
        pytest.skip(f"no ljpeg encoder in this PyAV: {e}")
    cc.width, cc.height, cc.pix_fmt, cc.time_base = 64, 48, pix_fmt, fractions.Fraction(1, 25)
    rgb = np.random.default_rng(0).integers(0, 255, (48, 64, 3), np.uint8)
    frame = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format=pix_fmt)
    return b"".join(bytes(p) for p in [*cc.encode(frame), *cc.encode(None)])


def _ljpeg_gray(pixels: np.ndarray) -> bytes:
    """A grayscale 8-bit lossless JPEG (SOF3, predictor 1, one Huffman table giving each of the
    17 difference categories a 5-bit code), as `cjpeg -lossless 1 -grayscale` makes one: PyAV's
    ljpeg encoder writes colour only."""
    x = pixels.astype(np.int64)
    pred = np.empty_like(x)
    pred[0, 0] = 128
    pred[0, 1:], pred[1:, 0], pred[1:, 1:] = x[0, :-1], x[:-1, 0], x[1:, :-1]
    bits = []
    for d in (x - pred).ravel().tolist():
        ssss = abs(d).bit_length()
        bits.append(format(ssss, "05b"))
        if ssss:
            bits.append(format(d if d > 0 else d + (1 << ssss) - 1, f"0{ssss}b"))
    stream = "".join(bits)
    stream += "1" * (-len(stream) % 8)
    body = bytes(int(stream[i:i + 8], 2) for i in range(0, len(stream), 8)).replace(b"\xff", b"\xff\x00")

    def segment(marker: int, payload: bytes) -> bytes:
        return b"\xff" + bytes([marker]) + struct.pack(">H", len(payload) + 2) + payload

    h, w = pixels.shape
    dht = bytes([0x00, 0, 0, 0, 0, 17] + [0] * 11) + bytes(range(17))
    return (b"\xff\xd8" + segment(0xC3, struct.pack(">BHHB", 8, h, w, 1) + b"\x01\x11\x00")
            + segment(0xC4, dht) + segment(0xDA, b"\x01\x01\x00\x01\x00\x00") + body + b"\xff\xd9")


def _with_sof(data: bytes, *, marker: int | None = None, bits: int | None = None) -> bytes:
    """A Pillow JPEG whose start-of-frame marker declares another process or precision."""
    d = bytearray(data)
    pos = d.find(b"\xff\xc0")
    if marker is not None:
        d[pos + 1] = marker
    if bits is not None:
        d[pos + 4] = bits
    return bytes(d)


def _pillow_decodes(data: bytes) -> bool:
    try:
        with Image.open(io.BytesIO(data)) as im:
            im.load()
        return True
    except Exception:
        return False


@pytest.mark.parametrize(("make", "message"), [
    (lambda jpg: _ljpeg("bgr24"), r"lossless JPEG \(SOF3\) with 9-bit samples is not decodable by Pillow"),
    (lambda jpg: _with_sof(jpg, bits=12), r"baseline JPEG \(SOF0\) with 12-bit samples"),
    (lambda jpg: _with_sof(jpg, marker=0xC5), r"differential sequential JPEG \(SOF5\) is not decodable"),
])
def test_a_jpeg_whose_process_pillow_cannot_decode_is_refused_naming_it(make, message):
    """Any SOF marker's size was counted, and the trainer then stood a blank input in for an image
    Pillow refuses (FFmpeg's lossless RGB, 12-bit, hierarchical JPEG)."""
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(1).integers(0, 255, (48, 64, 3), np.uint8)).save(out, "JPEG")
    data = make(out.getvalue())
    assert not _pillow_decodes(data)  # the contract: refused exactly because the trainer cannot decode it
    with pytest.raises(CountError, match=message) as err:
        Counter(CountingConfig()).image(data)
    assert err.value.reason == "bad_image"


@pytest.mark.parametrize("which", ["arithmetic", "arithmetic progressive", "lossless grayscale"])
def test_jpeg_processes_pillow_decodes_are_counted_as_they_decode(which):
    from PIL import features

    from pipeline.preprocess import PreprocessConfig, decode_image, preprocess_item

    gray = np.random.default_rng(2).integers(0, 256, (48, 64), np.uint8)
    data = {"arithmetic": lambda: _ARITH_JPEG, "arithmetic progressive": lambda: _ARITH_PROGRESSIVE_JPEG,
            "lossless grayscale": lambda: _ljpeg_gray(gray)}[which]()
    turbo = int((features.version("libjpeg_turbo") or "0").split(".")[0])
    if which.startswith("lossless") and turbo < 3:  # libjpeg-turbo decodes lossless JPEG from 3.0 on
        assert not _pillow_decodes(data)
        with pytest.raises(CountError, match=r"lossless JPEG \(SOF3\) is not decodable"):
            Counter(CountingConfig()).image(data)
        return
    enc, _, meta = Counter(CountingConfig()).image(data)
    rows = preprocess_item("image", data, PreprocessConfig(), enc_len=enc, key="k", member="jpg")
    assert rows.shape[0] == enc and meta["format"] == "JPEG"
    if which.startswith("lossless"):  # lossless: exactly the pixels stored, grey in every channel
        assert np.array_equal(np.asarray(decode_image(data)), np.repeat(gray[..., None], 3, axis=2))


@pytest.mark.parametrize("pix_fmt", ["yuvj420p", "yuvj444p"])
def test_a_colour_lossless_jpeg_is_refused_for_its_wrong_colours(pix_fmt):
    """libjpeg-turbo (>= 3) decodes an 8-bit lossless JPEG of 3 components (FFmpeg's ljpeg from
    YUV) without converting its YCbCr planes, and Pillow labels them RGB: a red image reached the
    model blue-grey. It is refused, naming the reason and a conversion."""
    data = _ljpeg(pix_fmt)
    with pytest.raises(CountError, match=r"lossless JPEG \(SOF3\) with 3 components decodes to "
                                         r"wrong colours .*ffmpeg -i IN OUT.png") as err:
        Counter(CountingConfig()).image(data)
    assert err.value.reason == "bad_image"


@pytest.mark.parametrize(("fmt", "name"), [("BMP", "BMP"), ("TIFF", "TIFF"), ("ICO", "ICO"),
                                           ("AVIF", "AVIF"), ("JPEG2000", "JPEG 2000")])
def test_an_image_member_of_another_format_is_refused_naming_it(fmt, name):
    """A BMP or TIFF named .jpg was refused as "cannot identify image file", which said neither
    what it is nor what images may be."""
    out = io.BytesIO()
    try:
        Image.new("RGB", (64, 48), (9, 8, 7)).save(out, fmt)
    except (KeyError, OSError) as e:
        pytest.skip(f"this Pillow cannot write {fmt}: {e}")
    with pytest.raises(CountError, match=f"this is {name}, which image members may not be "
                                         r"\(they may be JPEG, PNG, WebP or GIF\)") as err:
        Counter(CountingConfig()).image(out.getvalue())
    assert err.value.reason == "bad_image"
    with pytest.raises(CountError, match="unreadable image header: cannot identify image file$"):
        Counter(CountingConfig()).image(b"\x00\x01 neither of them" * 4)


@pytest.mark.parametrize("window", [1500.0, 1e9, 0.001])
def test_an_audio_pad_window_outside_seconds_is_refused_naming_the_unit(window):
    """--audio-pad-window 1e9 planned 50,000,000,000 encoder frames a clip; 1500 (a cost file's
    window, in frames) 25 minutes a clip; 0.001 under one frame."""
    with pytest.raises(ValueError, match=r"must be seconds.*Whisper's window is 30"):
        AudioConfig(pad_window_s=window)
    assert AudioConfig(pad_window_s=30.0).pad_window_s == 30.0


def test_clips_past_the_length_limit_are_refused_naming_the_flag_that_raises_it():
    """Probe: a 5-hour recording was bad_audio "over max_duration_s=14400.0", a setting no
    command or settings file has; --max-clip-seconds sets it for audio and video alike."""
    from pipeline.reader import add_reader_arguments, reader_config_from_args

    short = Counter(CountingConfig(audio=AudioConfig(max_duration_s=1.5)))
    with pytest.raises(CountError, match=r"audio lasts 2 s, over the 1.5 s limit "
                                         r"\(--max-clip-seconds; raise it for longer recordings\)"):
        short.audio(_wav(2.0))
    assert Counter(CountingConfig(audio=AudioConfig(max_duration_s=3.0))).audio(_wav(2.0))[0] > 0
    parser = argparse.ArgumentParser()
    add_reader_arguments(parser)
    config = reader_config_from_args(parser.parse_args(["--max-clip-seconds", "36000"])).counting
    assert config.audio.max_duration_s == config.video.max_duration_s == 36000
    with pytest.raises(ValueError, match="--max-clip-seconds 0.0 must be > 0 seconds"):
        reader_config_from_args(parser.parse_args(["--max-clip-seconds", "0"]))
