"""bench.feed --quick: the documented flat JSON, from real serve/read/train processes, and what
the bench refuses."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from bench import feed

pytestmark = pytest.mark.timeout(240)


def _fraction(x) -> bool:
    return isinstance(x, float) and 0.0 <= x <= 1.0


def test_quick_run_prints_one_flat_json_object():
    proc = subprocess.run([sys.executable, "-m", "bench.feed", "--quick", "--json"],
                          capture_output=True, text=True, timeout=220)
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(proc.stdout)
    for key in ("data_wait_fraction", "data_wait_fraction_inloop", "data_wait_fraction_datanode"):
        assert _fraction(res[key]), (key, res[key])
    # preprocessing inside the loop is time the loop does not train: it must show as waiting
    assert res["data_wait_fraction_inloop"] > 0.01
    sizes = res["bytes_per_sample"]
    assert set(sizes) == {"trainer", "datanode"}
    # float16 patches of a 448x448-capped image outweigh its JPEG/PNG bytes by far
    assert sizes["datanode"] > 5 * sizes["trainer"] > 0
    for kind in ("inloop", "thread", "process"):
        v = res[f"pool_items_per_s_{kind}"]
        assert isinstance(v, float) and math.isfinite(v) and v > 0
    assert res["items"] > 0 and isinstance(res["targets"]["data_wait_fraction<=0.05"], bool)
    # the blend's shares over windows of consecutive served samples follow the weights
    assert 0.0 <= res["mixture_max_abs_err"] < 0.005 and res["targets"]["mixture_max_abs_err<=0.02"]
    # flat: a later field is one more key (bytes_per_sample and targets are the documented objects)
    assert {k for k, v in res.items() if isinstance(v, dict)} == {"bytes_per_sample", "targets"}


def test_refuses_bad_values_in_one_line(capsys):
    for argv, match in ((["--steps", "0"], "--steps"), (["--steps", "3", "--warmup-steps", "3"], "--warmup-steps")):
        with pytest.raises(SystemExit) as e:
            feed.bench_args(argv)
        assert e.value.code == 2
        assert match in capsys.readouterr().err.strip().splitlines()[-1]
