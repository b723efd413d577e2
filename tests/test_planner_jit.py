"""The planner's compiled kernels: loaded only by processes that plan, warmed before serving."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from dispatcher_server.planner import PlannerConfig, Topology, balance, jit, plan_step
from dispatcher_server.planner.jit import _Kernel
from dispatcher_server.planner.types import StepInputs
from dispatcher_server.planner.warm import synthetic_step, warm_up

pytestmark = pytest.mark.timeout(120)


def _fresh_process(code: str) -> str:
    """What `code` prints, run in a new interpreter (nothing compiled or imported yet)."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_importing_the_planner_does_not_load_numba():
    """Trainers import the planner's types and never plan: no LLVM in their memory."""
    assert _fresh_process("import sys, dispatcher_server.planner, dispatcher_server.server; "
                          "print('numba' in sys.modules)") == "False"


def test_warming_everything_reaches_every_kernel():
    """What `make install` runs: in a fresh process, every kernel must be reached, or the first
    step that needs the missing one would compile it (seconds) while trainers wait."""
    assert _fresh_process("from dispatcher_server.planner.warm import warm_everything; "
                          "print(warm_everything())") == "[]"


def test_warm_up_compiles_the_kernels_a_plan_uses():
    topo = Topology(world_size=16, ranks_per_node=8)
    warm_up(topo, PlannerConfig(num_microbatches=2))
    assert not isinstance(balance._pair_step, _Kernel)  # the module now calls compiled code


def _signatures() -> dict[str, int]:
    return {k.__name__: len(k._compiled.signatures) for k in jit._KERNELS
            if k._compiled is not None}


@pytest.mark.parametrize("lens", [[3000], [3000, 50], [50, 60, 70]])
def test_after_warm_up_a_step_of_a_few_samples_compiles_nothing(lens):
    """A step of one sample (a token budget cut it short, an epoch's last) once handed the
    kernels arrays of another memory layout than the warm-up's: numba compiled new variants
    (seconds) inside the dispatcher loop, while readers timed out."""
    topo, cfg = Topology(world_size=4, ranks_per_node=2), PlannerConfig(num_microbatches=2)
    warm_up(topo, cfg)
    before = _signatures()
    step = StepInputs(text_len=np.array(lens), llm_len=np.array(lens), encoders={})
    plan_step(step, topo, cfg)
    assert _signatures() == before


def test_a_synthetic_step_is_a_valid_multimodal_step():
    step = synthetic_step(200)
    assert len(step.text_len) == 200
    assert set(step.encoders) == {"vision", "audio"}
    llm = step.text_len.copy()
    for e in step.encoders.values():
        assert np.all(np.diff(e.sample) >= 0)
        np.add.at(llm, e.sample, e.llm_len)
    assert np.array_equal(llm, step.llm_len)
    plan_step(step, Topology(world_size=8, ranks_per_node=8), PlannerConfig(num_microbatches=2))


def test_warm_up_under_capacities_the_synthetic_step_exceeds_does_not_fail():
    warm_up(Topology(world_size=8, ranks_per_node=8),
            PlannerConfig(num_microbatches=2, llm_capacity=16))


@pytest.mark.timeout(120)
def test_a_services_warm_up_reaches_every_kernel_whatever_its_topology():
    """warm_up planned synthetic steps at the job's own topology only: a one-node job never
    reached the multi-node kernels, nor any job the capacity repair's, so a fresh machine
    compiled them on a later step (375 ms to seconds after READY)."""
    import subprocess
    import sys

    code = ("from dispatcher_server.planner import jit, PlannerConfig, Topology\n"
            "from dispatcher_server.planner.warm import warm_up\n"
            "warm_up(Topology(world_size=2, ranks_per_node=2), PlannerConfig(num_microbatches=1))\n"
            "print(jit.not_run())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
