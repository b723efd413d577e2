"""Model inputs off the training loop: image patches and audio log-mels of exactly the planned
length (the counting rule), the prefetch pool, the model boundary check, datanode preprocessing."""

from __future__ import annotations

import os
import io
import struct
import threading
import time
import zlib

import numpy as np
import pytest
import soundfile
from PIL import Image

from dispatcher_server import protocol as P
from dispatcher_server.batching import Sample, build_batch, rank_message
from dispatcher_server.planner import PlannerConfig, Topology, plan_step
from pipeline.counting import AudioConfig, Counter, CountingConfig, ImageConfig, smart_resize
from pipeline.gendata import make_sample
from pipeline.preprocess import (
    IMAGE_MEAN, IMAGE_STD, N_MELS, PREPROCESSORS, TENSOR_META, PreprocessConfig, PreprocessError,
    array_from_payload, decode_image, hz_to_mel, log_mel, mel_filters, mel_to_hz, preprocess_item,
    preprocess_record, row_dim,
)
from pipeline.preprocess import _wide_gray_rgba
from pipeline.reader import ReaderConfig
from pipeline.records import Item, SampleRecord

pytestmark = pytest.mark.timeout(120)


def _png(width: int, height: int, seed: int = 0) -> bytes:
    rgb = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def _audio(seconds: float, rate: int, fmt: str = "WAV", channels: int = 1) -> bytes:
    n = int(round(seconds * rate))
    t = np.arange(n) / rate
    wave = 0.3 * np.sin(2 * np.pi * 440 * t)
    wave = np.stack([wave] * channels, axis=1) if channels > 1 else wave
    buf = io.BytesIO()
    soundfile.write(buf, wave.astype(np.float32), rate, format=fmt, subtype="PCM_16")
    return buf.getvalue()


# ----------------------------------------------------------------------------------- images
SIZES = [(1, 1), (3, 5), (27, 29), (56, 56), (64, 48), (640, 480), (1000, 7), (7, 1000), (2000, 11),
         (199 * 3, 3), (4000, 3000), (1280, 720), (333, 777)]


@pytest.mark.parametrize("cfg", [ImageConfig(), ImageConfig(max_pixels=448 * 448),
                                 ImageConfig(patch_size=16, merge_size=2, min_pixels=32 * 32, max_pixels=512 * 512)])
def test_image_rows_equal_the_count_for_many_sizes(cfg):
    counter = Counter(CountingConfig(image=cfg))
    config = PreprocessConfig(image=cfg)
    for w, h in SIZES:
        data = _png(w, h)
        enc, llm, meta = counter.image(data)
        out = preprocess_item("image", data, config, enc_len=enc, key=f"{w}x{h}", member="png")
        h_bar, w_bar = smart_resize(h, w, cfg)
        assert out.shape == (enc, 3 * 2 * cfg.patch_size**2) == (enc, row_dim("image", config)), (w, h)
        assert enc == (h_bar // cfg.patch_size) * (w_bar // cfg.patch_size) == llm * cfg.merge_size**2
        assert out.dtype == np.float16 and np.isfinite(out.astype(np.float32)).all()


def test_image_patches_match_qwen2_vl_processing():
    """The Qwen2-VL image processor's steps, written out as transformers does them (tile the
    frame to the temporal patch, then its 9-axis reshape and transpose)."""
    cfg = ImageConfig()
    data = _png(100, 60, seed=3)
    h_bar, w_bar = smart_resize(60, 100, cfg)
    img = Image.open(io.BytesIO(data)).convert("RGB").resize((w_bar, h_bar), Image.Resampling.BICUBIC)
    x = (np.asarray(img, dtype=np.float32) / 255 - np.array(IMAGE_MEAN)) / np.array(IMAGE_STD)
    patches = np.tile(x.transpose(2, 0, 1)[None], (2, 1, 1, 1))  # [T=2, C, H, W]
    p, m = 14, 2
    gh, gw = h_bar // p, w_bar // p
    flat = patches.reshape(1, 2, 3, gh // m, m, p, gw // m, m, p).transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    flat = flat.reshape(gh * gw, 3 * 2 * p * p)
    out = preprocess_item("image", data, PreprocessConfig(image=cfg), enc_len=gh * gw, key="k", member="png")
    np.testing.assert_allclose(out.astype(np.float32), flat, atol=2e-3)


def test_merge_groups_are_contiguous_rows():
    """Left half black, right half white, 112 x 56 pixels: a 2 x 4 grid of merged tokens, each
    the mean of 4 consecutive rows; the left two token columns are black, the right two white."""
    arr = np.zeros((56, 112, 3), dtype=np.uint8)
    arr[:, 56:] = 255
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    cfg = ImageConfig(min_pixels=28 * 28)
    out = preprocess_item("image", buf.getvalue(), PreprocessConfig(image=cfg), enc_len=32, key="k", member="png")
    tokens = out.astype(np.float32).reshape(8, 4 * out.shape[1]).mean(axis=1).reshape(2, 4)
    black = np.mean((0 - np.array(IMAGE_MEAN)) / np.array(IMAGE_STD))
    white = np.mean((1 - np.array(IMAGE_MEAN)) / np.array(IMAGE_STD))
    np.testing.assert_allclose(tokens[:, :2], black, atol=1e-2)
    np.testing.assert_allclose(tokens[:, 2:], white, atol=1e-2)
    # the two temporal copies of a patch are identical: row = (channel, temporal, py, px)
    row = out[0].reshape(3, 2, 14, 14)
    assert np.array_equal(row[:, 0], row[:, 1])


def test_transparent_pixels_become_white_and_grey_stays_grey():
    rgba = np.zeros((28, 28, 4), dtype=np.uint8)  # fully transparent black
    grey = np.full((28, 28), 128, dtype=np.uint8)
    config = PreprocessConfig(image=ImageConfig(min_pixels=28 * 28))
    for arr, level in ((rgba, 1.0), (grey, 128 / 255)):
        buf = io.BytesIO()
        Image.fromarray(arr).save(buf, format="PNG")
        out = preprocess_item("image", buf.getvalue(), config, enc_len=4, key="k", member="png")
        channels = out.astype(np.float32).reshape(4, 3, 2 * 14 * 14).mean(axis=(0, 2))
        np.testing.assert_allclose(channels, (level - np.array(IMAGE_MEAN)) / np.array(IMAGE_STD), atol=1e-2)


def _png16_gray(values: np.ndarray, transparent: int | None = None) -> bytes:
    """A 16-bit grayscale PNG (Pillow opens it as mode I;16), tRNS gray value optional."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    h, w = values.shape
    raw = b"".join(b"\0" + row.astype(">u2").tobytes() for row in values)
    trns = chunk(b"tRNS", struct.pack(">H", transparent)) if transparent is not None else b""
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 0, 0, 0, 0))
            + trns + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def test_16_bit_grayscale_is_scaled_to_8_bits_not_clipped_to_white():
    """Pillow's convert("RGBA") clips mode I;16 at 255: every 16-bit value above 255 became white."""
    levels = np.array([0, 256, 8192, 32768, 65535], dtype=np.uint16)
    data = _png16_gray(np.repeat(levels, 28)[None].repeat(28, axis=0))
    with Image.open(io.BytesIO(data)) as im:
        assert im.mode.startswith("I;16")
    rgb = np.asarray(decode_image(data))
    assert rgb[0, ::28, 0].tolist() == [0, 1, 32, 128, 255] and (rgb == rgb[..., :1]).all()
    assert np.asarray(decode_image(_png16_gray(np.full((4, 4), 65535), transparent=65535))).min() == 255
    for mode in ("I", "I;16"):  # mode I (older Pillow's 16-bit PNG) is read as 16-bit values too
        im = Image.fromarray(np.full((2, 2), 32768, np.int32)).convert(mode) if mode == "I" else \
            Image.frombytes("I;16", (2, 2), np.full(4, 32768, "<u2").tobytes())
        assert np.asarray(_wide_gray_rgba(im))[0, 0].tolist() == [128, 128, 128, 255], mode
    config = PreprocessConfig(image=ImageConfig(min_pixels=28 * 28))
    mid = _png16_gray(np.full((28, 28), 32768, np.uint16))
    enc, _, meta = Counter(CountingConfig(image=config.image)).image(mid)
    out = preprocess_item("image", mid, config, enc_len=enc, key="k", member="png", meta=meta)
    channels = out.astype(np.float32).reshape(enc, 3, -1).mean(axis=(0, 2))
    np.testing.assert_allclose(channels, (128 / 255 - np.array(IMAGE_MEAN)) / np.array(IMAGE_STD), atol=1e-2)


# ------------------------------------------------------------------------------------ audio
@pytest.mark.parametrize("fps,stride", [(50.0, 2), (25.0, 4), (5.0, 20)])
def test_audio_rows_equal_the_count_for_durations_and_rates(fps, stride):
    cfg = AudioConfig(encoder_frames_per_s=fps, llm_tokens_per_s=fps / 2)
    counter = Counter(CountingConfig(audio=cfg))
    config = PreprocessConfig(audio=cfg)
    for seconds in (0.013, 0.25, 1.0, 2.377, 7.0):
        for rate, fmt, ch in ((8000, "WAV", 1), (16000, "FLAC", 1), (22050, "WAV", 2), (44100, "FLAC", 1)):
            data = _audio(seconds, rate, fmt, ch)
            enc, _, _ = counter.audio(data)
            out = preprocess_item("audio", data, config, enc_len=enc, key="k", member=fmt.lower())
            assert out.shape == (enc, stride * N_MELS), (seconds, rate)
            # [enc_len, stride*128] is stride mel frames per encoder frame, time-major
            assert out.reshape(stride * enc, N_MELS).shape[0] == stride * enc


def test_padded_audio_windows_are_counted_and_produced_alike():
    cfg = AudioConfig(pad_window_s=2.0)
    data = _audio(3.1, 16000)
    enc, _, _ = Counter(CountingConfig(audio=cfg)).audio(data)
    out = preprocess_item("audio", data, PreprocessConfig(audio=cfg), enc_len=enc, key="k", member="wav")
    assert enc == 200 and out.shape == (200, 256)
    mel = out.astype(np.float32).reshape(400, N_MELS)
    assert mel[350:].std() < 1e-3 < mel[:300].std()  # zero padding after 3.1 s is flat


def test_an_encoder_rate_that_does_not_divide_100_is_refused():
    cfg = AudioConfig(encoder_frames_per_s=30.0)
    with pytest.raises(ValueError, match="encoder_frames_per_s=30 .*100/k"):
        preprocess_item("audio", _audio(1.0, 16000), PreprocessConfig(audio=cfg), enc_len=30, key="k", member="wav")


def test_slaney_mel_scale_and_filters():
    # Slaney: linear to 1 kHz (15 mels), log above; the inverse round-trips
    assert hz_to_mel(1000.0) == pytest.approx(15.0) and hz_to_mel(200.0) == pytest.approx(3.0)
    assert hz_to_mel(6400.0) == pytest.approx(15.0 + 27.0)
    hz = np.array([0.0, 100.0, 999.0, 1000.0, 4321.0, 8000.0])
    np.testing.assert_allclose(mel_to_hz(hz_to_mel(hz)), hz, rtol=1e-12, atol=1e-9)
    w = mel_filters()
    assert w.shape == (128, 201) and (w >= 0).all()
    # Slaney normalization: unit area in Hz for filters wide enough to be sampled well
    edges = mel_to_hz(np.linspace(0, hz_to_mel(8000.0), 130))
    wide = (edges[2:] - edges[:-2]) > 400
    area = w.sum(axis=1) * (16000 / 400)
    np.testing.assert_allclose(area[wide], 1.0, rtol=0.05)
    # a pure tone's energy lands in the filter centred nearest to it
    for tone in (440.0, 1500.0, 5000.0):
        t = np.arange(16000) / 16000
        mel = log_mel(np.sin(2 * np.pi * tone * t), 100)
        assert abs(edges[1:-1][int(mel[50].argmax())] - tone) < 0.1 * tone + 40


#: Non-zero weights of a few filters of `librosa.filters.mel(sr=16000, n_fft=400, n_mels=128)`
#: (librosa 0.11), the call Whisper's `mel_filters.npz` was made with.
LIBROSA_MEL = {
    0: ([1], [0.0123739867]),
    5: ([3, 4], [0.00564459199, 0.0067293942]),
    40: ([24], [0.0403763652]),
    90: ([79, 80, 81], [0.00618401915, 0.0129347313, 0.00629778765]),
    127: (list(range(191, 200)), [0.000475695095, 0.00161717169, 0.00275864848, 0.00390012516, 0.0050416016,
                                  0.00445712078, 0.00334284059, 0.00222856039, 0.0011142802]),
}


def test_mel_filters_match_librosa():
    w = mel_filters()
    for i, (bins, values) in LIBROSA_MEL.items():
        assert np.nonzero(w[i])[0].tolist() == bins, i
        np.testing.assert_allclose(w[i, bins], values, rtol=1e-6)


def test_log_mel_frames_and_whisper_scaling():
    t = np.arange(8000) / 16000
    mel = log_mel(np.sin(2 * np.pi * 440 * t), 60)  # 0.5 s, asked for 0.6 s: zero-padded
    assert mel.shape == (60, 128)
    assert mel.max() - mel.min() <= 2.0 + 1e-6  # clamped at max - 8 (log10), then / 4
    assert mel[55:].max() < mel[:45].max()  # the padded tail is quieter
    np.testing.assert_allclose(log_mel(np.zeros(5000), 50), (-10 + 4) / 4, atol=1e-6)  # log10 floor 1e-10


# --------------------------------------------------------------------------- plan mismatch
def test_a_length_mismatch_raises_naming_key_and_member():
    data = _png(640, 480)
    config = PreprocessConfig()
    enc, _, _ = Counter(CountingConfig()).image(data)
    with pytest.raises(ValueError, match=r"sample 'abc/0001' member '0\.jpg'.*enc_len=" + str(enc + 4)):
        preprocess_item("image", data, config, enc_len=enc + 4, key="abc/0001", member="0.jpg")
    # the data node counted with another pixel budget than the trainer uses
    small = PreprocessConfig(image=ImageConfig(max_pixels=112 * 112))
    with pytest.raises(PreprocessError, match="'k7'.*count by other rules"):
        preprocess_item("image", data, small, enc_len=enc, key="k7", member="png")
    with pytest.raises(PreprocessError, match="'k8' member 'wav': audio cannot be decoded"):
        preprocess_item("audio", b"RIFF....garbage", config, enc_len=3, key="k8", member="wav")
    with pytest.raises(PreprocessError, match="'k9'.*no preprocessor for modality 'smell'"):
        preprocess_item("smell", b"", config, enc_len=1, key="k9", member="x")
    assert set(PREPROCESSORS) >= {"image", "audio"}


def test_undecodable_messages_name_no_buffer_and_say_why():
    """Pillow's error named the in-memory buffer it was handed (`<_io.BytesIO object at 0x...>`);
    an audio clip decoding to no samples said only `empty`, though a cut file is the usual cause."""
    config = PreprocessConfig()
    with pytest.raises(PreprocessError) as err:
        preprocess_item("image", b"not an image at all", config, enc_len=4, key="k1", member="jpg")
    assert err.value.undecodable
    assert str(err.value) == "sample 'k1' member 'jpg': image cannot be decoded: cannot identify image file"
    empty = io.BytesIO()
    soundfile.write(empty, np.zeros(0, np.float32), 16000, format="WAV")
    with pytest.raises(PreprocessError, match="'k2' member 'wav': audio clip decodes to no samples: "
                                              "it is empty or truncated") as err:
        preprocess_item("audio", empty.getvalue(), config, enc_len=1, key="k2", member="wav")
    assert err.value.undecodable


# ------------------------------------------------------------------- steps, pool, datanode
DEMO = CountingConfig(image=ImageConfig(max_pixels=112 * 112),
                      audio=AudioConfig(encoder_frames_per_s=25.0, llm_tokens_per_s=12.5))
PRE = PreprocessConfig(image=DEMO.image, audio=DEMO.audio)


def _records(n: int, seed: int = 5) -> list[SampleRecord]:
    counter = Counter(DEMO)
    out = []
    for i in range(n):
        items, members = [], {}
        for name, data in make_sample(seed, i).items():
            ext = name.rsplit(".", 1)[-1]
            if ext in ("jpg", "png"):
                enc, llm, meta = counter.image(data)
                items.append(Item(modality="image", member=name, enc_len=enc, llm_len=llm, meta=meta))
            elif ext in ("wav", "flac"):
                enc, llm, meta = counter.audio(data)
                items.append(Item(modality="audio", member=name, enc_len=enc, llm_len=llm, meta=meta))
            else:
                continue
            members[name] = data
        items.sort(key=lambda it: it.modality != "image")
        out.append(SampleRecord(key=f"s{i:03d}", shard="mem", index=i, items=items, text_len=3,
                                llm_len=3 + sum(it.llm_len for it in items), members=members))
    return out


def _steps(records: list[SampleRecord], per_step: int = 6, world_size: int = 1, rank: int = 0):
    """Real decoded `Step`s of these records, as a trainer receives them (no sockets)."""
    from trainer_client.client import decode_step

    steps = []
    for s in range(0, len(records), per_step):
        samples = [Sample(key=r.key, pos=0, index=r.index, text_len=r.text_len, llm_len=r.llm_len,
                          tokens=P.blank_tokens(r.text_len),
                          items=[P.ItemHeader(it.modality, it.member, it.enc_len, it.llm_len,
                                                         dict(it.meta)) for it in r.items],
                          payloads=[memoryview(r.members[it.member]).cast("B") for it in r.items],
                          nbytes=sum(memoryview(r.members[it.member]).nbytes for it in r.items))
                   for r in records[s:s + per_step]]
        batch = build_batch(samples)
        plan = plan_step(batch.inputs, Topology(world_size=world_size, ranks_per_node=world_size),
                         PlannerConfig(num_microbatches=2))
        frames = [bytearray(memoryview(f)) for f in rank_message(batch, plan, step=s // per_step, epoch=0,
                                                             rank=rank, seq=1)]
        steps.append(decode_step(P.decode(frames)))
    return steps


def _inputs_by_item(steps) -> dict:
    out = {}
    for step in steps:
        for mb in step.microbatches:
            for phase, eb in mb.encoders.items():
                for k, i in enumerate(eb.item_ids.tolist()):
                    out[eb.sample_keys[k], eb.members[k]] = mb.inputs.item(phase, i)
    return out


@pytest.fixture(scope="module")
def records():
    recs = _records(24)
    assert sum(len(r.items) for r in recs) >= 12  # the mix has images and audio
    return recs


def test_pool_delivers_the_in_loop_tensors_in_order(records):
    torch = pytest.importorskip("torch")
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    reference = list(PrefetchPool(_steps(records), PrefetchConfig(workers=0, preprocess=PRE)))
    expected = _inputs_by_item(reference)
    for kind, workers in (("thread", 2), ("process", 2)):
        with PrefetchPool(_steps(records), PrefetchConfig(workers=workers, ahead=2, kind=kind,
                                                          preprocess=PRE)) as pool:
            got = list(pool)
        assert [s.step for s in got] == [s.step for s in reference] == list(range(4))
        assert [[mb.keys for mb in s.microbatches] for s in got] == \
            [[mb.keys for mb in s.microbatches] for s in reference]
        items = _inputs_by_item(got)
        assert list(items) == list(expected), kind
        for k, t in items.items():
            assert t.dtype == torch.float16 and torch.equal(t, expected[k]), (kind, k)
        assert pool.next_step == 4


def test_pool_prepares_only_so_far_ahead_and_reports_waits(records):
    pytest.importorskip("torch")
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    steps = _steps(records, per_step=3)  # 8 steps of 2 micro-batches
    pulled = []

    def source():
        for s in steps:
            pulled.append(s.step)
            yield s

    with PrefetchPool(source(), PrefetchConfig(workers=1, ahead=2, preprocess=PRE)) as pool:
        first = next(pool)
        deadline = time.monotonic() + 10
        while len(pulled) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # had the feeder taken more, it would show by now
        # the step held by the loop, one step of 2 micro-batches ahead, and one taken from the
        # source whose slots are not free yet
        assert first.step == 0 and len(pulled) == 3
        rest = list(pool)
    assert [s.step for s in rest] == list(range(1, 8)) and pool.wait_s > 0


@pytest.mark.timeout(30)
def test_next_on_a_closed_pool_says_so_instead_of_waiting_forever(records):
    """Its feeder is gone, so next() waited for a prepared step forever (and a feeder started
    again took a step from the source that nothing gave back)."""
    pytest.importorskip("torch")
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    pulled = []

    def source():
        for s in _steps(records):
            pulled.append(s.step)
            yield s

    for workers in (0, 1):
        pool = PrefetchPool(source(), PrefetchConfig(workers=workers, ahead=2, preprocess=PRE))
        assert next(pool).step == 0
        pool.close()
        taken = len(pulled)
        with pytest.raises(RuntimeError, match=r"next\(\) on a closed PrefetchPool: create a new one"):
            next(pool)
        assert len(pulled) == taken
        pulled.clear()


@pytest.mark.timeout(60)
def test_a_step_a_source_returns_after_the_pool_closed_goes_back_to_it(records):
    """A source that does not return within close()'s wait (5 s) kept the pool's feeder: the
    step it returned later was held by a feeder of a closed pool, and given back to nobody."""
    pytest.importorskip("torch")
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    class Slow:
        def __init__(self, steps):
            self.steps, self.back = iter(steps), []
            self.gate, self.waiting = threading.Event(), threading.Event()

        def __iter__(self):
            return self

        def __next__(self):
            step = next(self.steps)
            if step.step == 1:
                self.waiting.set()
                self.gate.wait(30)
            return step

        def unread(self, steps):
            self.back.extend(s.step for s in steps)

    source = Slow(_steps(records))
    pool = PrefetchPool(source, PrefetchConfig(workers=1, ahead=2, preprocess=PRE))
    assert next(pool).step == 0
    assert source.waiting.wait(10)
    pool.close()  # its feeder still waits in the source
    source.gate.set()
    deadline = time.monotonic() + 10
    while not source.back and time.monotonic() < deadline:
        time.sleep(0.05)
    assert source.back == [1]


def test_a_step_the_loop_let_go_of_frees_its_inputs_without_the_cyclic_collector(records):
    """A trainer's RSS grew by GBs over a long run: every trained step's input tensors stayed
    until a full garbage collection, which comes tens of steps apart there. With the collector
    off, the inputs of every step before the one the loop holds must already be freed."""
    pytest.importorskip("torch")
    import gc
    import weakref

    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    def source():  # hands each step over and keeps none (a client's queue does the same)
        steps = _steps(records, per_step=3)
        while steps:
            yield steps.pop(0)

    for kind, workers in (("thread", 0), ("thread", 2), ("process", 1)):
        gc.collect()
        gc.disable()
        try:
            inputs: list[list] = []  # weak references to each step's input tensors
            with PrefetchPool(source(), PrefetchConfig(workers=workers, ahead=2, kind=kind,
                                                       preprocess=PRE)) as pool:
                for step in pool:
                    held = sum(ref() is not None for refs in inputs for ref in refs)
                    assert held == 0, (kind, step.step, held)
                    refs = []
                    for mb in step.microbatches:  # as the training loop uses them
                        for phase, eb in mb.encoders.items():
                            for i in eb.item_ids.tolist():
                                refs.append(weakref.ref(mb.inputs.item(phase, i)))
                                assert mb.inputs.name(phase, i).startswith("sample 's")
                    inputs.append(refs)
                    del mb
            del step
            assert len(inputs) == 8 and sum(map(len, inputs)) >= 12, kind
            assert not any(ref() is not None for refs in inputs for ref in refs), kind
        finally:
            gc.enable()


def test_an_item_that_does_not_decode_gets_a_blank_input_or_raises_naming_its_key(caplog):
    """A header that counted over a body that does not decode is found only by the decoder,
    after the sample was planned into every rank's step: the loop died on it."""
    torch = pytest.importorskip("torch")
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    records = _records(12)
    reference = _inputs_by_item(PrefetchPool(_steps(records), PrefetchConfig(workers=0, preprocess=PRE)))
    bad = [r for r in records if any(it.modality == "image" for it in r.items)][0]
    item = next(it for it in bad.items if it.modality == "image")
    bad.members[item.member] = b"\x89PNG\r\n\x1a\n" + bytes(40)  # counted fine earlier, cannot decode
    for kind, workers in (("thread", 0), ("thread", 2), ("process", 2)):
        config = dict(workers=workers, kind=kind, preprocess=PRE)
        with PrefetchPool(_steps(records), PrefetchConfig(errors="raise", **config)) as pool:
            with pytest.raises(ValueError, match=f"sample '{bad.key}' member '{item.member}'"):
                list(pool)
        caplog.clear()
        with PrefetchPool(_steps(records), PrefetchConfig(**config)) as pool:
            got = _inputs_by_item(pool)
        assert pool.undecodable.count == 1, kind
        blank = got.pop((bad.key, item.member))
        assert blank.shape == (item.enc_len, reference[bad.key, item.member].shape[1])
        assert blank.dtype == torch.float16 and not blank.any()
        assert got.keys() == reference.keys() - {(bad.key, item.member)}
        assert all(torch.equal(t, reference[k]) for k, t in got.items()), kind
        assert any("event=undecodable_item" in r.message and bad.key in r.message
                   for r in caplog.records)
    for r in records:  # every image broken: a setup problem, not bad data
        for it in r.items:
            if it.modality == "image":
                r.members[it.member] = bad.members[item.member]
    with PrefetchPool(_steps(records), PrefetchConfig(workers=0, preprocess=PRE,
                                                      max_consecutive_errors=2)) as pool:
        with pytest.raises(ValueError, match="3 items in a row did not decode"):
            list(pool)


def _ogg_crc(page: bytes) -> int:
    """Ogg's page CRC-32 (polynomial 0x04C11DB7, MSB first, initial 0, no final XOR)."""
    crc = 0
    for b in page:
        crc ^= b << 24
        for _ in range(8):
            crc = ((crc << 1) ^ 0x04C11DB7) & 0xFFFFFFFF if crc & 0x80000000 else (crc << 1) & 0xFFFFFFFF
    return crc


def _ogg_whose_header_lies(seconds: float = 3.0, scale: float = 1.5) -> bytes:
    """An Ogg Vorbis clip whose last page's granule position claims `scale` times its length
    (CRC fixed up): libsndfile's header states seconds * scale, its decoder reads `seconds`."""
    buf = io.BytesIO()
    soundfile.write(buf, (0.2 * np.sin(np.arange(int(seconds * 44100)) * 0.05)).astype(np.float32),
                    44100, format="OGG", subtype="VORBIS")
    data, pos, last = bytearray(buf.getvalue()), 0, 0
    while pos < len(data):
        last, segments = pos, data[pos + 26]
        pos += 27 + segments + sum(data[pos + 27:pos + 27 + segments])
    (granule,) = struct.unpack_from("<q", data, last + 6)
    struct.pack_into("<q", data, last + 6, int(granule * scale))
    struct.pack_into("<I", data, last + 22, 0)
    struct.pack_into("<I", data, last + 22, _ogg_crc(bytes(data[last:pos])))
    return bytes(data)


def _liar_record(index: int) -> SampleRecord:
    data = _ogg_whose_header_lies()
    enc, llm, meta = Counter(DEMO).audio(data)  # counted from its header: 4.5 s
    return SampleRecord(key="liar", shard="mem", index=index, text_len=3, llm_len=3 + llm,
                        items=[Item(modality="audio", member="ogg", enc_len=enc, llm_len=llm, meta=meta)],
                        members={"ogg": data})


def test_a_file_whose_header_lies_is_told_from_other_rules_by_recounting_its_header():
    """Other rows than planned: the trainer recounts the item's header by its own rules. The
    planned count is a lying file (blank input); another is other rules (the loop stops)."""
    liar = _liar_record(0)
    item = liar.items[0]
    assert item.enc_len == 113  # 4.5 s at 25 frames/s; it decodes to 3.0 s
    with pytest.raises(PreprocessError, match=r"'liar' member 'ogg': preprocessed to 76 rows but "
                                              r"its header counts enc_len=113, here as in the plan: "
                                              r"its header states another length") as err:
        preprocess_item("audio", liar.members["ogg"], PRE, enc_len=113, key="liar", member="ogg")
    assert err.value.mismatch and err.value.header_lies is True
    other = PreprocessConfig(image=PRE.image, audio=AudioConfig(encoder_frames_per_s=50.0))
    with pytest.raises(PreprocessError, match=r"the plan counted enc_len=113 but the rules here "
                                              r"count its header as 225 .*count by other rules") as err:
        preprocess_item("audio", liar.members["ogg"], other, enc_len=113, key="liar", member="ogg")
    assert err.value.mismatch and err.value.header_lies is False
    short = PreprocessConfig(image=PRE.image, audio=AudioConfig(
        encoder_frames_per_s=25.0, llm_tokens_per_s=12.5, max_duration_s=4.0))
    with pytest.raises(PreprocessError, match="header states another length than it decodes to "
                                              r"\(then .*or data node and trainer count by other rules") as err:
        preprocess_item("audio", liar.members["ogg"], short, enc_len=113, key="liar", member="ogg")
    assert err.value.mismatch and err.value.header_lies is None  # these rules refuse its header


def test_a_data_node_skipping_a_lying_file_does_not_hint_at_the_flag_it_runs_with():
    """The hint to preprocess on the data node belongs to the trainer's message only."""
    liar = _liar_record(0)
    with pytest.raises(PreprocessError, match="header states another length") as err:
        preprocess_record(liar, PRE)
    assert err.value.header_lies is True and "--preprocess-on" not in str(err.value)
    short = PreprocessConfig(image=PRE.image, audio=AudioConfig(
        encoder_frames_per_s=25.0, llm_tokens_per_s=12.5, max_duration_s=4.0))
    with pytest.raises(PreprocessError, match="header states another length") as err:
        preprocess_record(_liar_record(0), short)
    assert err.value.header_lies is None and "--preprocess-on" not in str(err.value)
    with pytest.raises(PreprocessError, match="--preprocess-on datanode"):  # the trainer's
        preprocess_item("audio", liar.members["ogg"], PRE, enc_len=113, key="liar", member="ogg")


def _steps_with(liar: SampleRecord, records: list[SampleRecord], first: bool) -> list:
    """Steps of `records` and `liar`: first, in a step of its own before every other item."""
    if not first:
        return _steps(records + [liar])
    steps = _steps([liar], per_step=1)
    for s in _steps(records):
        s.step += 1
        steps.append(s)
    return steps


@pytest.mark.parametrize("first", [True, False], ids=["very first item", "among good ones"])
def test_a_lying_file_gets_a_blank_input_wherever_it_comes(first, caplog):
    """Whether one lying file stopped the job depended on whether an item of its modality had
    decoded as planned before it in this process (thread timing, restarts): as the very first
    item it was taken for other rules, and the loop stopped."""
    torch = pytest.importorskip("torch")
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    records = _records(12)
    liar = _liar_record(len(records))
    reference = _inputs_by_item(PrefetchPool(_steps(records), PrefetchConfig(workers=0, preprocess=PRE)))
    for kind, workers in (("thread", 0), ("thread", 2), ("process", 2)):
        caplog.clear()
        with PrefetchPool(_steps_with(liar, records, first),
                          PrefetchConfig(workers=workers, kind=kind, preprocess=PRE)) as pool:
            got = _inputs_by_item(pool)
        assert pool.undecodable.count == 1, kind
        blank = got.pop(("liar", "ogg"))
        assert blank.shape == (liar.items[0].enc_len, row_dim("audio", PRE)) and not blank.any(), kind
        assert got.keys() == reference.keys() and all(torch.equal(t, reference[k]) for k, t in got.items())
        assert any("event=undecodable_item" in r.getMessage() and "'liar'" in r.getMessage()
                   and "header states another length" in r.getMessage() for r in caplog.records), kind
    with PrefetchPool(_steps_with(liar, records, first),
                      PrefetchConfig(workers=0, errors="raise", preprocess=PRE)) as pool:
        with pytest.raises(PreprocessError, match="'liar'.*header states another length"):
            list(pool)


def test_an_item_whose_header_counts_otherwise_here_stops_the_loop_even_after_good_ones():
    """A file whose own header this trainer counts to another length than the plan: the rules
    differ, and the loop stops, however many items of its modality decoded as planned before."""
    pytest.importorskip("torch")
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    records = _records(12)
    with_images = [r for r in records if any(it.modality == "image" for it in r.items)]
    for swapped in (with_images[0], with_images[-1]):
        item = next(it for it in swapped.items if it.modality == "image")
        original = swapped.members[item.member]
        swapped.members[item.member] = _png(100, 60)  # the plan counted the original
        for workers in (0, 2):
            with PrefetchPool(_steps(records), PrefetchConfig(workers=workers, preprocess=PRE)) as pool:
                with pytest.raises(ValueError, match=f"sample '{swapped.key}'.*the rules here "
                                                     "count its header as .*count by other rules"):
                    list(pool)
        swapped.members[item.member] = original


def test_without_a_recount_a_mismatch_is_a_lying_file_only_after_good_items():
    """The heuristic kept for a mismatch whose header could not be recounted here."""
    pytest.importorskip("torch")
    from trainer_client.prefetch import PrefetchConfig, Undecodable

    undecodable = Undecodable(PrefetchConfig(preprocess=PRE))
    unknown = PreprocessError("sample 'k' member 'ogg': rows", "audio", mismatch=True)
    with pytest.raises(PreprocessError):
        undecodable.blank(unknown, "audio", 5)
    lies = PreprocessError("sample 'k' member 'ogg': rows", "audio", mismatch=True, header_lies=True)
    assert undecodable.blank(lies, "audio", 5).shape == (5, row_dim("audio", PRE))
    undecodable.decoded("audio")
    assert undecodable.blank(unknown, "audio", 5).shape == (5, row_dim("audio", PRE))
    differs = PreprocessError("sample 'k' member 'ogg': rows", "audio", mismatch=True, header_lies=False)
    with pytest.raises(PreprocessError):
        undecodable.blank(differs, "audio", 5)
    assert undecodable.count == 2


def test_items_counted_by_other_rules_stop_the_loop_whatever_the_error_mode(records):
    pytest.importorskip("torch")
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    other = PreprocessConfig(image=ImageConfig(max_pixels=56 * 56), audio=PRE.audio)
    with PrefetchPool(_steps(records), PrefetchConfig(workers=2, preprocess=other)) as pool:
        with pytest.raises(ValueError, match="count by other rules"):
            list(pool)
    with pytest.raises(ValueError, match="errors='skip' must be one of warn, raise"):
        PrefetchConfig(errors="skip")


def test_datanode_preprocessing_ships_the_same_tensors(records):
    pytest.importorskip("torch")
    import torch

    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    trainer_side = _inputs_by_item(PrefetchPool(_steps(records), PrefetchConfig(workers=0, preprocess=PRE)))
    shipped = _records(24)
    raw_bytes = sum(memoryview(v).nbytes for r in shipped for v in r.members.values())
    for r in shipped:
        preprocess_record(r, PRE)
    assert all(TENSOR_META in it.meta for r in shipped for it in r.items)
    tensor_bytes = sum(memoryview(v).nbytes for r in shipped for v in r.members.values())
    assert tensor_bytes != raw_bytes
    # the trainer pool only wraps them, here with no counting rules at all
    with PrefetchPool(_steps(shipped), PrefetchConfig(workers=1, preprocess=PreprocessConfig())) as pool:
        datanode_side = _inputs_by_item(pool)
    assert list(datanode_side) == list(trainer_side)
    for k, t in trainer_side.items():
        assert torch.equal(t, datanode_side[k]), k


def test_a_shipped_tensor_is_checked_against_the_plan():
    arr = np.zeros((6, 4), dtype=np.float16)
    meta = {TENSOR_META: {"shape": [6, 4], "dtype": "<f2"}}
    assert array_from_payload(arr.tobytes(), meta).shape == (6, 4)
    with pytest.raises(ValueError, match="does not hold shape"):
        array_from_payload(arr.tobytes()[:-2], meta)
    pytest.importorskip("torch")
    from trainer_client.prefetch import prepare_item

    with pytest.raises(ValueError, match="sample 'q' member 'jpg'.*6 rows.*enc_len=8") as err:
        prepare_item("image", arr.tobytes(), meta, PreprocessConfig(), enc_len=8, key="q", member="jpg")
    assert "--preprocess-on" not in str(err.value)  # a data node preprocessed it: the flag is in use


def test_the_model_boundary_names_the_sample_key(records):
    torch = pytest.importorskip("torch")
    from trainer_client.model import check_item_lengths
    from trainer_client.prefetch import PrefetchConfig, PrefetchPool

    step = next(PrefetchPool(_steps(records[:6]), PrefetchConfig(workers=0, preprocess=PRE)))
    mb = next(m for m in step.microbatches if m.encoders and len(m.encoders["vision"].payloads))
    eb = mb.encoders["vision"]
    items = [mb.inputs.item("vision", int(i)) for i in eb.item_ids]
    check_item_lengths("vision", items, eb.item_ids, eb.enc_len, mb.inputs.name)  # planned lengths pass
    items[0] = items[0][:-4]
    with pytest.raises(ValueError, match=f"sample '{eb.sample_keys[0]}' member '{eb.members[0]}': vision "
                                         f"input has shape .* enc_len={int(eb.enc_len[0])}"):
        check_item_lengths("vision", items, eb.item_ids, eb.enc_len, mb.inputs.name)
    with pytest.raises(ValueError, match="vision item"):
        check_item_lengths("vision", [torch.zeros(3, 2)], [7], [4])


def test_dataset_refuses_dataloader_workers_and_prepares_inputs_in_its_pool(tmp_path):
    torch = pytest.importorskip("torch")
    from pipeline.gendata import generate
    from pipeline.reader import ReaderConfig
    from tests.test_service import client_config, dispatcher, make_config, readers
    from trainer_client.client import DispatcherDataset
    from trainer_client.prefetch import PrefetchConfig

    shards = generate(str(tmp_path), num_samples=24, num_shards=2, seed=4)
    reader = ReaderConfig(counting=DEMO)
    got = {}
    for where in ("trainer", "datanode"):
        with dispatcher(make_config(shards, world_size=1, max_steps=3)) as srv, \
                readers(srv.reader_endpoint, 1, reader=reader, preprocess_on=where):
            ds = DispatcherDataset(srv.trainer_endpoint, rank=0, world_size=1, local_world_size=1,
                                   config=client_config(), preprocess=PrefetchConfig(preprocess=PRE),
                                   tokenizer=None)
            try:
                steps = list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0))
            finally:
                ds.client.close()
                ds.pool.close()
        got[where] = _inputs_by_item(steps)
        assert [s.step for s in steps] == [0, 1, 2]
    assert got["trainer"] and list(got["trainer"]) == list(got["datanode"])
    for k, t in got["trainer"].items():
        assert torch.equal(t, got["datanode"][k]), k
    ds = DispatcherDataset("tcp://127.0.0.1:1", rank=0, world_size=1, local_world_size=1)
    with pytest.raises(ValueError, match="runs in the main process"):
        list(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=1))
    ds.close()  # closed, it says so, and what to make: not "create a new" client of its own
    for call in (lambda: iter(ds), lambda: ds.load_state_dict({})):
        with pytest.raises(RuntimeError, match="on a closed DispatcherDataset: create a new one"):
            call()


def test_datanode_readers_refuse_reference_payloads_and_bad_rates(tmp_path):
    import argparse

    from pipeline.gendata import generate
    from pipeline.service import FatalReaderError, ReaderServiceConfig, ReaderWorker, add_arguments, config_from_args
    from tests.test_service import dispatcher, make_config

    shards = generate(str(tmp_path), num_samples=4, num_shards=1, seed=1)
    with dispatcher(make_config(shards, world_size=1, payloads="reference")) as srv:
        worker = ReaderWorker(ReaderServiceConfig(dispatcher=srv.reader_endpoint, timeout_s=1.5,
                                                  connect_timeout_s=10, preprocess_on="datanode"))
        with pytest.raises(FatalReaderError, match="--payloads reference.*--preprocess-on datanode"):
            worker.run()
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--dispatcher", "tcp://127.0.0.1:9", "--preprocess-on", "datanode",
                              "--audio-frames-per-s", "30"])
    with pytest.raises(ValueError, match="--audio-frames-per-s 30 does not divide"):
        config_from_args(args)


@pytest.mark.timeout(180)
def test_a_dataset_checkpoints_the_loops_position_not_its_pools(tmp_path):
    """With a prefetch pool the client has handed out steps the loop has not seen: the dataset's
    state is the loop's position, and a fresh dataset loading it (before iterating) resumes
    right there, no step lost."""
    torch = pytest.importorskip("torch")
    from pipeline.gendata import generate
    from pipeline.reader import ReaderConfig
    from tests.test_service import client_config, dispatcher, make_config, readers
    from trainer_client.client import DispatcherDataset
    from trainer_client.prefetch import PrefetchConfig

    shards = generate(str(tmp_path), num_samples=64, num_shards=2, seed=4)

    def dataset(srv):
        return DispatcherDataset(srv.trainer_endpoint, rank=0, world_size=1, local_world_size=1,
                                 config=client_config(),
                                 preprocess=PrefetchConfig(preprocess=PRE, ahead=4), tokenizer=None)

    with dispatcher(make_config(shards, world_size=1, max_epochs=1)) as srv, \
            readers(srv.reader_endpoint, 1, reader=ReaderConfig(counting=DEMO)):
        ds = dataset(srv)
        try:
            loop = iter(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0))
            first = [next(loop).step for _ in range(3)]
            deadline = time.monotonic() + 20
            while ds.client.state_dict()["next_step"] <= 3 and time.monotonic() < deadline:
                time.sleep(0.02)  # the pool takes steps ahead of the loop
            assert ds.client.state_dict()["next_step"] > 3
            state = ds.state_dict()
        finally:
            ds.close()
        assert state["next_step"] == 3
        again = dataset(srv)
        again.load_state_dict(state)
        assert again.state_dict() == state
        try:
            rest = [s.step for s in torch.utils.data.DataLoader(again, batch_size=None, num_workers=0)]
        finally:
            again.close()
    assert first + rest == list(range(64 // 8))


@pytest.mark.timeout(120)
def test_log_mel_does_not_depend_on_the_blas_thread_count():
    """A data node (every core) and a trainer (torchrun: OMP_NUM_THREADS=1) must give the same
    model inputs: a BLAS matmul's summation order follows its thread count, and the mel
    projection through one made log-mels differ in the last bit."""
    import subprocess
    import sys

    code = ("import hashlib, numpy as np; from pipeline.preprocess import log_mel; "
            "w = np.random.default_rng(0).normal(0, 0.3, 16000 * 200).astype(np.float32); "
            "print(hashlib.sha256(log_mel(w, 20000).tobytes()).hexdigest())")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digests = set()
    for threads in ("1", "2"):
        env = {**os.environ, "OPENBLAS_NUM_THREADS": threads, "OMP_NUM_THREADS": threads,
               "MKL_NUM_THREADS": threads, "PYTHONPATH": root}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env, timeout=100, check=True)
        digests.add(out.stdout.strip())
    assert len(digests) == 1


def test_preprocessed_inputs_have_the_size_readers_predict_from_counted_rows(records):
    """The size a datanode reader checks before decoding is the size decoding makes."""
    from pipeline.preprocess import PREPROCESS_DTYPE, preprocess_record, row_dim

    for rec in records[:8]:
        rec = SampleRecord(key=rec.key, shard=rec.shard, index=rec.index,
                           items=[Item(modality=it.modality, member=it.member, enc_len=it.enc_len,
                                       llm_len=it.llm_len, meta=dict(it.meta)) for it in rec.items],
                           text_len=rec.text_len, llm_len=rec.llm_len, members=dict(rec.members))
        preprocess_record(rec, PRE)
        for it in rec.items:
            assert rec.members[it.member].nbytes == \
                it.enc_len * row_dim(it.modality, PRE) * PREPROCESS_DTYPE.itemsize


def test_a_datanode_reader_skips_an_item_too_large_for_a_frame_before_decoding_it(monkeypatch):
    """A 420 s clip was decoded (seconds), then refused as too large for a message frame."""
    import pipeline.preprocess as pre
    from pipeline.errors import ErrorStats
    from pipeline.service import ReaderServiceConfig, ReaderWorker

    big, small = _records(2)
    big.items[0].enc_len = P.DEFAULT_LIMITS.max_frame_bytes  # rows: far over a frame
    decoded: list[str] = []
    real = pre.preprocess_record
    monkeypatch.setattr(pre, "preprocess_record",
                        lambda rec, config: (decoded.append(rec.key), real(rec, config)))
    worker = ReaderWorker(ReaderServiceConfig(dispatcher="tcp://127.0.0.1:1", name="r",
                                              preprocess_on="datanode",
                                              reader=ReaderConfig(counting=DEMO)))
    skipped, said = [], []
    out = list(worker._preprocessed(lambda e, i: (skipped.append((e.reason, e.key, i)),
                                                  said.append(str(e))),
                                    ErrorStats(), iter([big, small])))
    assert [r.key for r in out] == decoded == [small.key]
    assert skipped == [("member_too_large", big.key, big.index)]
    # the member by its file name in the shard, not its suffix alone
    assert f"member '{big.key}.{big.items[0].member}' is " in said[0], said


@pytest.mark.timeout(120)
def test_a_datanode_reader_keeps_its_heartbeats_while_an_item_decodes_for_long(tmp_path, monkeypatch,
                                                                                caplog):
    """Decoding ran in the session thread: a clip that took longer than the dispatcher's timeout
    got the reader dropped (three times, then the sample before it was abandoned)."""
    import logging

    import pipeline.preprocess as pre
    from pipeline.gendata import generate
    from tests.test_service import all_keys, consume, dispatcher, flat_keys, make_config, readers

    shards = generate(str(tmp_path), num_samples=16, num_shards=1, seed=4)
    real = pre.preprocess_record
    slow = {all_keys(shards)[5]}

    def preprocess_record(rec, config):
        if rec.key in slow:
            slow.discard(rec.key)
            time.sleep(3.0)  # twice the dispatcher's 1.5 s timeout
        real(rec, config)

    monkeypatch.setattr(pre, "preprocess_record", preprocess_record)
    caplog.set_level(logging.INFO)
    with dispatcher(make_config(shards, world_size=1, global_batch=4)) as srv, \
            readers(srv.reader_endpoint, 1, reader=ReaderConfig(counting=DEMO), preprocess_on="datanode"):
        got = consume(srv.trainer_endpoint, 1)
    assert not slow  # the slow item was decoded
    assert sorted(flat_keys(got)) == sorted(all_keys(shards))
    assert "reader_left name=r0 why=timeout" not in caplog.text


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_float_clip_holding_nan_or_inf_is_undecodable_not_a_nan_input(bad):
    """One NaN sample in a float WAV made every value of the clip's log-mel NaN (it spreads
    through the STFT to the clip's maximum, which every value is clamped against): training
    went NaN for good, with no message. It is an undecodable item now (a blank input, warned;
    skipped on the data node with --preprocess-on datanode)."""
    wave = (0.1 * np.sin(np.arange(32000) * 0.05)).astype(np.float32)
    wave[1000] = bad
    out = io.BytesIO()
    soundfile.write(out, wave, 16000, format="WAV", subtype="FLOAT")
    cfg = PreprocessConfig()
    enc, _, meta = Counter(CountingConfig()).audio(out.getvalue())
    with pytest.raises(PreprocessError, match="NaN or infinite samples \\(the first at sample 1000"):
        preprocess_item("audio", out.getvalue(), cfg, enc_len=enc, key="k", member="wav", meta=meta)


def test_a_float_clip_far_past_full_scale_gives_a_finite_input():
    """A float sample of 3e38 overflowed float32's powers to inf, and the clamp to the clip's
    maximum made the whole input inf: the powers are taken in float64 then."""
    wave = (0.1 * np.sin(np.arange(32000) * 0.05)).astype(np.float32)
    cfg = PreprocessConfig()
    rows = {}
    for name, peak in (("clean", None), ("huge", 3e38)):
        if peak is not None:
            wave[1000] = peak
        out = io.BytesIO()
        soundfile.write(out, wave, 16000, format="WAV", subtype="FLOAT")
        enc, _, meta = Counter(CountingConfig()).audio(out.getvalue())
        rows[name] = preprocess_item("audio", out.getvalue(), cfg, enc_len=enc, key="k",
                                     member="wav", meta=meta).astype(np.float32)
        assert np.isfinite(rows[name]).all(), name
    assert rows["huge"].max() > rows["clean"].max()
