"""Free capacity that counts what other attempts already ask for (planning/capacity.py)."""

from __future__ import annotations

from finetune_operator.planning.capacity import Claim, with_claims
from finetune_operator.planning.pools import load_catalog


def _pool(name: str, free: list[int] | None):
    fields = {"name": name, "region": "eu-de-berlin", "gpuType": "H100-80GB", "gpusPerNode": 8, "maxNodes": 2}
    loaded = load_catalog([fields])[0]
    if free is None:
        return loaded
    return loaded.model_copy(update={"free_gpus": sum(free), "free_gpus_per_node": sorted(free, reverse=True)})


def test_claims_take_gpus_off_the_nodes_the_scheduler_would_use():
    # The default scheduler spreads (least allocated first): two 4-GPU replicas land on both nodes,
    # so an 8-GPU replica no longer fits anywhere; it waits, and what it asks is not free for others.
    (pool,) = with_claims([_pool("p", [8, 8])], [Claim("p", 1, 4), Claim("p", 1, 4)])
    assert pool.free_gpus_per_node == [4, 4] and not pool.fits_now(1, 8) and pool.fits_now(2, 4)
    (pool,) = with_claims([_pool("p", [8, 8])], [Claim("p", 1, 4), Claim("p", 1, 4), Claim("p", 1, 8)])
    assert pool.free_gpus == 4 and not pool.fits_now(1, 8)


def test_a_multi_node_claim_takes_one_node_per_replica():
    (pool,) = with_claims([_pool("p", [8, 8])], [Claim("p", 2, 4)])
    assert pool.free_gpus_per_node == [4, 4] and pool.fits_now(2, 4) and not pool.fits_now(1, 8)


def test_a_claim_that_does_not_fit_still_holds_what_it_asks_and_never_goes_negative():
    (pool,) = with_claims([_pool("p", [2, 1])], [Claim("p", 1, 8)])
    assert pool.free_gpus_per_node == [1, 0] and pool.free_gpus == 1


def test_other_pools_and_unknown_free_gpus_are_left_alone():
    unknown, other = with_claims([_pool("p", None), _pool("q", [8])], [Claim("p", 1, 8)])
    assert unknown.free_gpus is None and other.free_gpus == 8


def test_what_finds_no_free_gpus_is_the_pools_queue():
    (pool,) = with_claims([_pool("p", [8, 0])], [Claim("p", 1, 8), Claim("p", 1, 4), Claim("p", 2, 2)])
    # 8 fits; 4 and two 2-GPU replicas do not: 8 GPUs queued, and the pool has none free.
    assert pool.free_gpus == 0 and pool.queued_gpus == 8
    up = pool.model_copy(update={"nodes_now": 2})
    assert up.wait_share(1, 8) == (8 + 8) / 16 and _pool("q", [8]).model_copy(update={"nodes_now": 1}).wait_share(1, 8) == 0


def test_a_waiting_attempt_is_woken_only_for_a_pool_with_room_in_its_regions():
    from finetune_operator.planning.capacity import Waiting, movers

    berlin = _pool("berlin", [0, 0])
    paris = load_catalog([{"name": "paris", "region": "eu-fr-paris", "gpuType": "A100-40GB", "gpusPerNode": 8,
                           "maxNodes": 1}])[0].model_copy(update={"free_gpus": 3, "free_gpus_per_node": [3]})
    both = frozenset({"eu-de-berlin", "eu-fr-paris"})
    waiting = [
        Waiting("only-berlin", Claim("berlin", 1, 1), frozenset({"eu-de-berlin"}), 100.0),
        Waiting("young", Claim("berlin", 1, 1), both, 5.0),  # not past the bound yet
        Waiting("oldest", Claim("berlin", 1, 2), both, 90.0),
        Waiting("too-big", Claim("berlin", 1, 4), both, 80.0),  # 4 GPUs on one node: Paris has 3
        Waiting("next", Claim("berlin", 1, 1), both, 70.0),
        Waiting("no-room-left", Claim("berlin", 1, 1), both, 60.0),  # Paris's 3 GPUs are taken by then
        Waiting("already-there", Claim("paris", 1, 1), both, 95.0),
    ]
    assert movers([berlin, paris], waiting, min_wait_seconds=30) == ["oldest", "next"]
    assert movers([berlin, paris.model_copy(update={"free_gpus": 0, "free_gpus_per_node": [0]})], waiting,
                  min_wait_seconds=30) == []
