"""Property tests: every method yields a valid plan on arbitrary small steps and topologies."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dispatcher_server.planner import (
    BASELINES, DEFAULT_LLM_CAPACITY_FACTOR, ENCODER_PHASES, EncoderItems, PlanError, PlannerConfig,
    StepInputs, StepPlan,
    Topology, plan_step, validate,
)
from dispatcher_server.planner.cost import phase_costs
from dispatcher_server.planner.types import LLM_PHASE

pytestmark = pytest.mark.timeout(120)


@st.composite
def steps(draw):
    ranks_per_node = draw(st.sampled_from([1, 2, 4]))
    num_nodes = draw(st.sampled_from([1, 2, 3]))
    topo = Topology(world_size=ranks_per_node * num_nodes, ranks_per_node=ranks_per_node)
    S = draw(st.integers(0, 40))
    text = np.array(draw(st.lists(st.integers(0, 3000), min_size=S, max_size=S)), dtype=np.int64)
    enc = {}
    for phase, hi in (("vision", 20000), ("audio", 40000)):
        n = draw(st.integers(0, 2 * S)) if S else 0
        owner = np.sort(np.array(draw(st.lists(st.integers(0, max(S - 1, 0)), min_size=n,
                                               max_size=n)), dtype=np.int64))
        e = np.array(draw(st.lists(st.integers(1, hi), min_size=n, max_size=n)), dtype=np.int64)
        if n and draw(st.booleans()):
            e[draw(st.integers(0, n - 1))] = hi * 8  # one giant item
        enc[phase] = EncoderItems(enc_len=e, llm_len=e // 4, sample=owner)
    llm = text.copy()
    for it in enc.values():
        llm += np.bincount(it.sample, weights=it.llm_len, minlength=S).astype(np.int64)
    inputs = StepInputs(text_len=text, llm_len=llm, encoders=enc)
    M = draw(st.integers(1, 3))
    cap = draw(st.sampled_from([None, 2000, 6000, 50000]))
    cfg = PlannerConfig(num_microbatches=M, llm_capacity=cap,
                        encoder_capacity={"vision": 40000} if cap else {},
                        oversize="isolate", seed=draw(st.integers(0, 3)))
    return inputs, topo, cfg


@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_serve_default_capacity_never_refuses_a_step(case):
    """serve's default capacity is derived from the step, so no step may be refused for it: it
    grows where the ranks cannot hold the step (few samples per micro-batch), and every
    (rank, micro-batch) holds at most the capacity the plan states (`validate`)."""
    inputs, topo, drawn = case
    cfg = PlannerConfig(num_microbatches=drawn.num_microbatches, seed=drawn.seed,
                        llm_capacity_factor=DEFAULT_LLM_CAPACITY_FACTOR)
    S = inputs.num_samples
    # and the same number of equal samples, where a slot's share is fractional (the corner)
    equal = StepInputs(text_len=np.full(S, 1000), llm_len=np.full(S, 1000), encoders={})
    for step in (inputs, equal):
        plan = plan_step(step, topo, cfg)
        validate(plan, step)
        assert plan.num_microbatches == drawn.num_microbatches
        if S:
            assert plan.llm_capacity >= cfg.llm_capacity_for(step, topo)
            assert plan.metrics["peak_tokens"]["llm"] <= plan.llm_capacity


# Derandomized: fitting capacities is a heuristic, and CI must not depend on what a run draws.
# Random runs found refusals of feasible steps (fixed: capacity split, repacking, more
# micro-batches under "isolate"); 16,000 random examples passed afterwards.
@settings(max_examples=150, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])
@given(steps())
def test_mmdispatch_plans_are_valid(case):
    inputs, topo, cfg = case
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            plan = plan_step(inputs, topo, cfg)
        except PlanError as e:
            # only a capacity that packing cannot meet may refuse, and it must say where; with
            # at most half the room used, first-fit-style repair always finds a place. A
            # sample's items all go to its micro-batch: there the room is one rank per rank,
            # so one heavy sample may fill it (seen: 79,549 vision tokens of one sample, two
            # ranks of 40,000).
            assert "capacity" in str(e)
            W, M = topo.world_size, cfg.num_microbatches
            vis = inputs.items("vision")
            per_sample = np.bincount(vis.sample, weights=vis.enc_len, minlength=len(inputs.llm_len))
            llm_cap, vis_cap = cfg.llm_capacity, cfg.encoder_capacity["vision"]
            assert (inputs.llm_len.sum() > 0.5 * W * M * llm_cap
                    or vis.enc_len.sum() > 0.5 * W * M * vis_cap
                    or per_sample.max(initial=0) > 0.5 * W * vis_cap)
            event("refused")
            return
    event(f"planned, isolated={len(plan.isolated_microbatches) > 0}")
    validate(plan, inputs)
    W, M = topo.world_size, plan.num_microbatches
    assert M >= cfg.num_microbatches
    assert plan.sample_ptr.shape == (W * M + 1,)  # every rank has exactly M micro-batches
    m = plan.metrics
    assert m["step_time"] >= m["lb_step_time"] * (1 - 1e-9) - 1e-6
    assert m["step_time"] >= m["split_free_lb_step_time"] * (1 - 1e-9) - 1e-6
    again = StepPlan.from_dict(plan.to_dict())
    validate(again, inputs)
    assert np.array_equal(again.sample_rank, plan.sample_rank)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps(), st.sampled_from(sorted(BASELINES)))
def test_baseline_plans_are_valid(case, name):
    inputs, topo, cfg = case
    plan = BASELINES[name](inputs, topo, cfg)
    validate(plan, inputs)
    for p in ENCODER_PHASES:
        for m in range(plan.num_microbatches):
            t = plan.exchange_table(m, p)
            assert t.tokens.sum() == inputs.items(p).llm_len[
                plan.sample_mb[inputs.items(p).sample] == m].sum()


@pytest.mark.parametrize("W,g", [(1, 1), (8, 8), (16, 4)])
def test_all_text_and_empty_steps(W, g):
    topo = Topology(world_size=W, ranks_per_node=g)
    cfg = PlannerConfig(num_microbatches=2)
    for S in (0, 1, 3 * W):
        text = np.arange(1, S + 1, dtype=np.int64) * 7
        inputs = StepInputs(text_len=text, llm_len=text.copy())
        plan = plan_step(inputs, topo, cfg)
        validate(plan, inputs)
        assert plan.metrics["bytes"] == {"same_rank": 0, "intra_node": 0, "inter_node": 0}
        for r in range(W):
            for m in range(2):
                rm = plan.rank_microbatch(r, m)
                assert all(len(ex.encode_items) == 0 for ex in rm.exchanges.values())


def test_capacity_repair_packs_a_tight_micro_batch_again():
    """All vision items of one sample (one micro-batch) filling two ranks of 40,000 to 99.4%:
    moving the smallest items off the fuller rank gets stuck at 40,001 (a PlanError, found by
    the property test); packing the micro-batch again, largest first, fits."""
    enc = np.array([1] * 18 + [453] * 3 + [18642, 19530, 20000, 20000], dtype=np.int64)
    vision = EncoderItems(enc_len=enc, llm_len=enc // 4, sample=np.zeros(len(enc), np.int64))
    none = EncoderItems(enc_len=np.zeros(0, np.int64), llm_len=np.zeros(0, np.int64),
                        sample=np.zeros(0, np.int64))
    llm = np.zeros(13, dtype=np.int64)
    llm[0] = vision.llm_len.sum()
    inputs = StepInputs(text_len=np.zeros(13, np.int64), llm_len=llm,
                        encoders={"vision": vision, "audio": none})
    cfg = PlannerConfig(num_microbatches=2, llm_capacity=50000, encoder_capacity={"vision": 40000},
                        oversize="isolate")
    plan = plan_step(inputs, Topology(world_size=2, ranks_per_node=1), cfg)
    validate(plan, inputs)
    per_rank = np.bincount(plan.item_rank["vision"], weights=enc, minlength=2)
    assert per_rank.max() <= 40000 and per_rank.sum() == enc.sum()


def _vision_step(enc: list[int], owner: list[int], num_samples: int) -> StepInputs:
    enc_a, owner_a = np.array(enc, np.int64), np.array(owner, np.int64)
    vision = EncoderItems(enc_len=enc_a, llm_len=enc_a // 4, sample=owner_a)
    none = EncoderItems(enc_len=np.zeros(0, np.int64), llm_len=np.zeros(0, np.int64),
                        sample=np.zeros(0, np.int64))
    llm = np.bincount(owner_a, weights=enc_a // 4, minlength=num_samples).astype(np.int64)
    return StepInputs(text_len=np.zeros(num_samples, np.int64), llm_len=llm,
                      encoders={"vision": vision, "audio": none})


def test_a_step_the_cost_split_crowds_is_split_by_capacity():
    """Three samples filling W=2 ranks x 2 micro-batches x 40,000 vision tokens to 49%: the
    step-time split puts all of them in one micro-batch (98% of its room; the repair then
    refused it, found by the property test); splitting by capacity shares fits both."""
    inputs = _vision_step([1, 1, 1, 1, 1, 1553, 3106, 3364, 16349, 17182, 1, 1, 17902, 18993],
                          [0] * 9 + [1] * 4 + [2], 7)
    cfg = PlannerConfig(num_microbatches=2, llm_capacity=50000, encoder_capacity={"vision": 40000},
                        oversize="error")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = plan_step(inputs, Topology(world_size=2, ranks_per_node=1), cfg)
    validate(plan, inputs)
    assert plan.num_microbatches == 2 and len(set(plan.sample_mb[:3].tolist())) == 2


@pytest.mark.parametrize("oversize", ["error", "isolate"])
def test_a_step_over_its_microbatches_room_gets_more_under_isolate(oversize):
    """90,000 vision tokens in samples of 30,000, one micro-batch of two 40,000 ranks: no
    packing exists; "isolate" runs the step in more micro-batches, "error" refuses it."""
    inputs = _vision_step([30000, 30000, 30000], [0, 1, 2], 3)
    cfg = PlannerConfig(num_microbatches=1, encoder_capacity={"vision": 40000}, oversize=oversize)
    topo = Topology(world_size=2, ranks_per_node=1)
    if oversize == "error":
        with pytest.raises(PlanError, match="capacity 40000"):
            plan_step(inputs, topo, cfg)
        return
    with pytest.warns(UserWarning, match="micro-batches instead of 1"):
        plan = plan_step(inputs, topo, cfg)
    validate(plan, inputs)
    assert plan.num_microbatches == 2 and plan.sample_ptr.shape == (2 * 2 + 1,)


def _near_equal_steps():
    """(W, M, G, spread, seed): equal and near-equal (within +-spread) LLM-only samples, at
    sample counts around the multiples of W and of W x M, where whole samples decide."""
    for W in (2, 3, 4, 8):
        for M in (1, 2, 3, 4):
            counts = {1, W - 1, W + 1, 2 * W + 1, 3 * W // 2, W * M - 1, W * M + 1,
                      W * M + W // 2, 2 * W * M - 1, 5 * W + 3, 5 * W * M // 2}
            for G in sorted(g for g in counts if g >= 1):
                for spread, seed in ((0.0, 0), (0.01, 1), (0.05, 2), (0.05, 3)):
                    yield W, M, G, spread, seed


def test_planner_is_never_slower_than_random_on_near_equal_samples():
    """Equal-length samples once planned 1.6x slower than the draw (W=4, M=4, 20 samples:
    an even 5-a-micro-batch split puts two on some rank in every micro-batch, 8 sample-times,
    where the draw's 8/4/4/4 takes 5): the split's bounds ignored that samples are whole.
    Over a grid of (W, M, G), equal and within 1% and 5%, capped (serve's default factor)
    and not, the plan's predicted step time is at most `plan_random`'s."""
    worse, not_optimal = [], []
    for W, M, G, spread, seed in _near_equal_steps():
        rng = np.random.default_rng(seed)
        lens = (4096 * (1 + rng.uniform(-spread, spread, G))).astype(np.int64)
        step = StepInputs(text_len=lens.copy(), llm_len=lens.copy(), encoders={})
        topo = Topology(world_size=W, ranks_per_node=W)
        for factor in (None, DEFAULT_LLM_CAPACITY_FACTOR):
            cfg = PlannerConfig(num_microbatches=M, llm_capacity_factor=factor)
            ours = plan_step(step, topo, cfg)
            drawn = BASELINES["random"](step, topo, cfg)
            if ours.metrics["step_time"] > drawn.metrics["step_time"] * (1 + 1e-9):
                worse.append((W, M, G, spread, factor,
                              round(ours.metrics["step_time"] / drawn.metrics["step_time"], 3)))
            one = phase_costs(step, cfg.cost)[LLM_PHASE][0]
            if spread == 0.0 and ours.metrics["step_time"] != pytest.approx(-(-G // W) * one):
                not_optimal.append((W, M, G, factor))  # optimal: ceil(G / W) sample-times
    assert not worse, f"{len(worse)} steps slower than the draw: {worse[:10]}"
    assert not not_optimal, f"equal samples planned above ceil(G/W) sample-times: {not_optimal}"
    # the bound over every split counts whole samples too (10 on 4 ranks: 3, not 2.5)
    step = StepInputs(text_len=np.full(10, 4096), llm_len=np.full(10, 4096), encoders={})
    plan = plan_step(step, Topology(world_size=4, ranks_per_node=4),
                     PlannerConfig(num_microbatches=2))
    assert plan.metrics["step_time_over_split_free_lb"] == pytest.approx(1.0)
