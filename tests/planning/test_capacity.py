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
