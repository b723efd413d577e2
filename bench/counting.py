"""Benchmark: header-only counting versus full decoding versus bare webdataset reading, one core.

Generates shards into a temporary folder, warms the page cache, then times three passes over
the same samples: the reader with counting, the reader plus a full decode of every image
(Pillow load + RGB convert) and clip (soundfile.read), and webdataset's own tar iteration with
no counting. Each pass is repeated and the best time is kept (least disturbed by neighbours).
Targets: counting_vs_decode >= 25, counting_vs_raw >= 0.8.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import time

TARGETS = {"counting_vs_decode": 25.0, "counting_vs_raw": 0.8}


def _best_rate(fn, repeats: int) -> tuple[float, int]:
    best = float("inf")
    count = 0
    for _ in range(repeats):
        start = time.perf_counter()
        count = fn()
        best = min(best, time.perf_counter() - start)
    return count / best, count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.counting", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--decode-repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[0]})  # one core, as the target says

    import soundfile
    import webdataset as wds  # imports torch if installed: fine here, never in pipeline/
    from PIL import Image

    from pipeline.errors import ErrorStats
    from pipeline.gendata import generate
    from pipeline.reader import ReaderConfig, group_samples, iter_samples
    from pipeline.shards import open_shard
    from pipeline.tario import open_decompressed, tar_members

    with tempfile.TemporaryDirectory(prefix="mmdispatch-bench-") as tmp:
        urls = generate(tmp, num_samples=args.samples, num_shards=args.shards, seed=args.seed)
        config = ReaderConfig()

        def header() -> int:
            stats = ErrorStats()
            n = sum(1 for _ in iter_samples(urls, config, stats=stats))
            assert stats.num_errors == 0, stats.as_dict()
            return n

        def decode() -> int:
            n = 0
            for rec in iter_samples(urls, config):
                for item in rec.items:
                    data = rec.members[item.member]
                    if item.modality == "image":
                        with Image.open(io.BytesIO(data)) as im:
                            im.convert("RGB").load()
                    else:
                        soundfile.read(io.BytesIO(data), dtype="float32")
                n += 1
            return n

        def own_read() -> int:
            n = 0
            for url in urls:
                with open_shard(url) as stream:
                    n += sum(1 for _ in group_samples(tar_members(open_decompressed(stream, url)), print))
            return n

        def raw() -> int:
            src = [{"url": u} for u in urls]
            return sum(1 for _ in wds.tariterators.tarfile_samples(src))

        raw()  # warm the page cache and imports
        header()
        raw_rate, n_raw = _best_rate(raw, args.repeats)
        own_rate, n_own = _best_rate(own_read, args.repeats)
        header_rate, n_header = _best_rate(header, args.repeats)
        decode_rate, n_decode = _best_rate(decode, args.decode_repeats)
        if not n_raw == n_own == n_header == n_decode == args.samples:
            raise RuntimeError(f"passes saw different samples: {n_raw=} {n_own=} {n_header=} {n_decode=}")
        total_bytes = sum(os.path.getsize(u) for u in urls)

    result = {
        "num_samples": args.samples,
        "num_shards": args.shards,
        "shard_bytes": total_bytes,
        "header_samples_per_s": round(header_rate, 1),
        "decode_samples_per_s": round(decode_rate, 1),
        "raw_read_samples_per_s": round(raw_rate, 1),
        "counting_vs_decode": round(header_rate / decode_rate, 2),
        "counting_vs_raw": round(header_rate / raw_rate, 3),
        # Transparency: our own tar reader without counting, i.e. what counting itself costs.
        "own_read_samples_per_s": round(own_rate, 1),
        "counting_vs_own_read": round(header_rate / own_rate, 3),
    }
    result["targets_met"] = all(result[k] >= v for k, v in TARGETS.items())
    if args.json:
        print(json.dumps(result))
    else:
        width = max(map(len, result))
        for k, v in result.items():
            target = f"  (target >= {TARGETS[k]})" if k in TARGETS else ""
            print(f"{k:<{width}}  {v}{target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
