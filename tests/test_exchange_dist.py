"""RankContext from torchrun's environment, and the local launcher's failure path."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from trainer_client.dist import INTER_NODE, INTRA_NODE, SAME_RANK, RankContext, run_local_group  # noqa: E402


def test_from_env_reads_torchrun_variables():
    ctx = RankContext.from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"})
    assert (ctx.rank, ctx.world_size, ctx.local_rank, ctx.local_world_size, ctx.node) == (5, 8, 1, 4, 1)
    assert ctx.num_nodes == 2
    assert [ctx.locality(p) for p in (5, 4, 7, 0, 3)] == [SAME_RANK, INTRA_NODE, INTRA_NODE, INTER_NODE, INTER_NODE]


def test_from_env_defaults_and_overrides():
    single = RankContext.from_env({})
    assert (single.rank, single.world_size, single.local_world_size, single.node) == (0, 1, 1, 0)
    one_node = RankContext.from_env({"RANK": "2", "WORLD_SIZE": "4"})
    assert one_node.local_world_size == 4 and one_node.node == 0
    over = RankContext.from_env({"RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}, local_world_size=2)
    assert (over.node, over.local_rank) == (1, 0)


@pytest.mark.parametrize(
    ("env", "match"),
    [
        ({"RANK": "4", "WORLD_SIZE": "4"}, "rank=4"),
        ({"RANK": "0", "WORLD_SIZE": "6", "LOCAL_WORLD_SIZE": "4"}, "local_world_size=4 must divide"),
        ({"RANK": "x", "WORLD_SIZE": "4"}, "RANK='x'"),
        ({"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=0"),
    ],
)
def test_from_env_rejects_inconsistent_layouts(env, match):
    with pytest.raises(ValueError, match=match):
        RankContext.from_env(env)


def _fail_on_rank_one(ctx):
    if ctx.rank == 1:
        raise ValueError("boom from rank one")
    return ctx.rank


def test_local_group_reports_a_failing_rank_with_its_traceback():
    with pytest.raises(RuntimeError, match="(?s)rank 1 failed.*boom from rank one"):
        run_local_group(_fail_on_rank_one, world_size=2, local_world_size=1, timeout_s=60)
