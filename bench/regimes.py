"""Step generators for the planner benchmark's regimes: shapes of real multimodal training data.

Every regime is a list of variants (parameter settings) and every step draws one at random, so a
planner tuned to one setting is still judged on its neighbours. Counts follow the project's
counting rules (DESIGN.md): images resized into a pixel budget with sides rounded to 28 pixels
(14-pixel patches, 2x2 merge), audio at 50 encoder frames and 25 LLM tokens per second, video
frames sampled at 2 fps with temporal patch 2 and the image rule per frame.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dispatcher_server.planner import EncoderItems, StepInputs

PATCH = 14
MERGE = 2
SIDE = PATCH * MERGE  # sides round to multiples of 28 pixels
MIN_PIXELS = 56 * 56
MAX_PIXELS = 28 * 28 * 1280  # Qwen2-VL's default cap: 5120 patches, 1280 LLM tokens
FRAMES_PER_SECOND = 50  # Whisper encoder frames
AUDIO_FRAMES_PER_TOKEN = 2  # 25 LLM tokens per second


def image_patches(h: np.ndarray, w: np.ndarray, min_pixels: float = MIN_PIXELS,
                  max_pixels: float = MAX_PIXELS) -> np.ndarray:
    """Encoder length (14x14 patches) of images of h x w pixels after Qwen2-VL's smart_resize."""
    h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
    scale = np.ones_like(h)
    big, small = h * w > max_pixels, h * w < min_pixels
    scale[big] = np.sqrt(max_pixels / (h[big] * w[big]))
    scale[small] = np.sqrt(min_pixels / (h[small] * w[small]))
    hr = np.maximum(SIDE, np.round(h * scale / SIDE) * SIDE)
    wr = np.maximum(SIDE, np.round(w * scale / SIDE) * SIDE)
    over = hr * wr > max_pixels  # rounding up may cross the cap: floor instead
    hr[over] = np.maximum(SIDE, np.floor(h[over] * scale[over] / SIDE) * SIDE)
    wr[over] = np.maximum(SIDE, np.floor(w[over] * scale[over] / SIDE) * SIDE)
    return ((hr / PATCH) * (wr / PATCH)).astype(np.int64)


def _photos(rng: np.random.Generator, n: int, median_mp: float, sigma: float) -> np.ndarray:
    """Patches of n photos/screenshots: lognormal megapixels, aspect ratios 1:3 to 3:1."""
    pixels = rng.lognormal(np.log(median_mp * 1e6), sigma, n)
    aspect = np.exp(rng.uniform(np.log(1 / 3), np.log(3), n))
    h = np.sqrt(pixels / aspect)
    return image_patches(h, h * aspect)


def assemble(text_len: np.ndarray, vis_sample: np.ndarray, vis_enc: np.ndarray,
             aud_sample: np.ndarray, aud_frames: np.ndarray) -> StepInputs:
    """StepInputs from per-item arrays (items sorted by sample, as readers deliver them)."""
    S = len(text_len)
    vo = np.argsort(vis_sample, kind="stable")
    ao = np.argsort(aud_sample, kind="stable")
    vis_enc = np.asarray(vis_enc, np.int64)[vo]
    aud_frames = np.asarray(aud_frames, np.int64)[ao]
    vis = EncoderItems(enc_len=vis_enc, llm_len=vis_enc // (MERGE * MERGE),
                       sample=np.asarray(vis_sample, np.int64)[vo])
    aud = EncoderItems(enc_len=aud_frames, llm_len=aud_frames // AUDIO_FRAMES_PER_TOKEN,
                       sample=np.asarray(aud_sample, np.int64)[ao])
    text = np.asarray(text_len, np.int64)
    llm = text + np.bincount(vis.sample, weights=vis.llm_len, minlength=S).astype(np.int64) \
        + np.bincount(aud.sample, weights=aud.llm_len, minlength=S).astype(np.int64)
    return StepInputs(text_len=text, llm_len=llm, encoders={"vision": vis, "audio": aud})


def _text(rng, n, median, sigma, lo=4, hi=32768) -> np.ndarray:
    return np.clip(rng.lognormal(np.log(median), sigma, n), lo, hi).astype(np.int64)


def _none() -> tuple[np.ndarray, np.ndarray]:
    return np.zeros(0, np.int64), np.zeros(0, np.int64)


def interleaved(rng: np.random.Generator, S: int, v: dict) -> StepInputs:
    """Multi-image interleaved documents (OBELICS/MMC4-like): 0-16 images per sample."""
    if v["count"] == "uniform":
        k = rng.integers(0, 17, S)
    else:  # geometric-like: many documents with few images, a tail up to 16
        k = np.minimum(16, rng.geometric(1.0 / v["mean_images"], S) - 1)
    vs = np.repeat(np.arange(S), k)
    patches = _photos(rng, len(vs), v["median_mp"], v["sigma"])
    text = _text(rng, S, v["text"], 0.7)
    return assemble(text, vs, patches, *_none())


def speech(rng: np.random.Generator, S: int, v: dict) -> StepInputs:
    """Speech-heavy (ASR/AST-like): most samples one or more 1-35 s clips, short text."""
    has = rng.random(S) < v["audio_share"]
    k = np.where(has, rng.integers(1, v["max_clips"] + 1, S), 0)
    a_s = np.repeat(np.arange(S), k)
    if v["durations"] == "uniform":
        dur = rng.uniform(1.0, 35.0, len(a_s))
    else:
        dur = np.clip(rng.lognormal(np.log(v["median_s"]), 0.7, len(a_s)), 1.0, 35.0)
    frames = np.maximum(2, (dur * FRAMES_PER_SECOND).astype(np.int64))
    text = np.where(has, _text(rng, S, v["text"], 0.6), _text(rng, S, 400, 1.0))
    return assemble(text, *_none(), a_s, frames)


def doc_pages(rng: np.random.Generator, S: int, v: dict) -> StepInputs:
    """Document pages (DocVQA/OCR-like) at the pixel cap, with long answers."""
    k = rng.integers(v["min_pages"], v["max_pages"] + 1, S)
    vs = np.repeat(np.arange(S), k)
    h = rng.uniform(1600, 3500, len(vs))  # A4/letter scans: far above the cap
    patches = image_patches(h, h * rng.uniform(0.68, 0.80, len(vs)), max_pixels=v["max_pixels"])
    text = _text(rng, S, v["answer"], 0.8, lo=32, hi=16384)
    return assemble(text, vs, patches, *_none())


def long_context(rng: np.random.Generator, S: int, v: dict) -> StepInputs:
    """Long-context text with a tail to 32k tokens and rare media."""
    text = _text(rng, S, v["median"], v["sigma"], hi=32768)
    tail = rng.random(S) < v["tail_share"]
    text[tail] = rng.integers(8192, 32769, tail.sum())
    img = rng.random(S) < v["media_share"]
    vs = np.flatnonzero(img)
    aud = rng.random(S) < v["media_share"] / 4
    a_s = np.flatnonzero(aud)
    frames = (rng.uniform(1, 30, len(a_s)) * FRAMES_PER_SECOND).astype(np.int64)
    return assemble(text, vs, _photos(rng, len(vs), 0.8, 0.8), a_s, frames)


VIDEO_MAX_PATCHES = 65536  # per clip (16384 LLM tokens): fewer frames beyond it


def video_frames_patches(rng, n: int, fps: float, max_frames: int, frame_pixels: float,
                         duration: np.ndarray) -> np.ndarray:
    """Encoder length of n clips: frames at `fps` (even, capped), temporal patch 2, each
    frame resized into `frame_pixels`, at most VIDEO_MAX_PATCHES per clip."""
    frames = np.clip(np.round(duration * fps / 2) * 2, 2, max_frames)
    aspect = rng.choice([16 / 9, 4 / 3, 9 / 16, 1.0], n, p=[0.6, 0.2, 0.15, 0.05])
    h = np.sqrt(rng.choice([640 * 360, 1280 * 720, 1920 * 1080], n) / aspect)
    per_frame = image_patches(h, h * aspect, max_pixels=frame_pixels)
    steps = np.minimum(frames // 2, VIDEO_MAX_PATCHES // per_frame)
    return (steps * per_frame).astype(np.int64)


def video(rng: np.random.Generator, S: int, v: dict) -> StepInputs:
    """Video-heavy (clips as vision items): 2 fps, temporal patch 2, per-frame pixel budget."""
    has = rng.random(S) < v["video_share"]
    k = np.where(has, rng.integers(1, v["max_clips"] + 1, S), 0)
    vs = np.repeat(np.arange(S), k)
    dur = np.clip(rng.lognormal(np.log(v["median_s"]), 0.9, len(vs)), 1.0, 600.0)
    patches = video_frames_patches(rng, len(vs), 2.0, v["max_frames"], v["frame_pixels"], dur)
    # the rest: single images and text
    img = ~has & (rng.random(S) < 0.4)
    iv = np.flatnonzero(img)
    ip = _photos(rng, len(iv), 0.6, 0.9)
    text = _text(rng, S, v["text"], 0.8)
    return assemble(text, np.concatenate([vs, iv]), np.concatenate([patches, ip]), *_none())


def mixture(rng: np.random.Generator, S: int, v: dict) -> StepInputs:
    """The project's long-tailed mixture (bench.planner.synthetic_step) at a given cap."""
    from bench.planner import synthetic_step

    return synthetic_step(rng, S, v["max_patches"])


#: regime -> (generator, variants). Each step draws one variant.
REGIMES: dict[str, tuple[Callable, list[dict]]] = {
    "mixture": (mixture, [{"max_patches": 16384}]),
    "capped_images": (mixture, [{"max_patches": 2048}]),
    "interleaved": (interleaved, [
        {"count": "uniform", "median_mp": 0.5, "sigma": 0.8, "text": 600},
        {"count": "geometric", "mean_images": 4, "median_mp": 0.8, "sigma": 1.0, "text": 400},
        {"count": "geometric", "mean_images": 8, "median_mp": 0.3, "sigma": 0.6, "text": 900},
    ]),
    "speech": (speech, [
        {"audio_share": 0.8, "max_clips": 1, "durations": "uniform", "text": 60},
        {"audio_share": 0.8, "max_clips": 3, "durations": "lognormal", "median_s": 8, "text": 40},
        {"audio_share": 0.9, "max_clips": 1, "durations": "lognormal", "median_s": 20,
         "text": 120},
    ]),
    "doc_pages": (doc_pages, [
        {"min_pages": 1, "max_pages": 1, "max_pixels": MAX_PIXELS, "answer": 1500},
        {"min_pages": 1, "max_pages": 4, "max_pixels": MAX_PIXELS, "answer": 800},
        {"min_pages": 1, "max_pages": 2, "max_pixels": 28 * 28 * 4096, "answer": 2500},
    ]),
    "long_context": (long_context, [
        {"median": 2000, "sigma": 1.2, "tail_share": 0.02, "media_share": 0.05},
        {"median": 6000, "sigma": 0.8, "tail_share": 0.05, "media_share": 0.02},
        {"median": 1000, "sigma": 1.5, "tail_share": 0.01, "media_share": 0.1},
    ]),
    "video": (video, [
        {"video_share": 0.5, "max_clips": 1, "median_s": 20, "max_frames": 256,
         "frame_pixels": 360 * 640, "text": 200},
        {"video_share": 0.7, "max_clips": 2, "median_s": 8, "max_frames": 128,
         "frame_pixels": 224 * 224 * 2, "text": 100},
        {"video_share": 0.3, "max_clips": 1, "median_s": 60, "max_frames": 768,
         "frame_pixels": 28 * 28 * 128, "text": 400},
    ]),
}


def regime_step(name: str, rng: np.random.Generator, num_samples: int) -> StepInputs:
    """One step of `name` with a variant drawn from `rng`."""
    gen, variants = REGIMES[name]
    return gen(rng, num_samples, variants[int(rng.integers(len(variants)))])
