"""spec.dataset.paddingFree and spec.dataset.microBatchTokens (issue 28) through the API, the planner
and the trainer config: the planner sizes micro-batches by the declared tokens (a padding-free row of
the real tokens under flash), evaluation is sized without them (they describe the training stream),
and the trainer gets both fields (tests/rendering/test_render_attempt.py). The sizing terms: tests/sizing/test_padding_free.py."""

from __future__ import annotations

from finetune_operator.planning import Infeasible, plan_job
from finetune_operator.planning.search.estimate import Estimates
from finetune_operator.planning.search.ask import ask_from_spec
from finetune_operator.sizing import estimate_memory

from .test_search import POLICY, pool, spec

# A chat dataset at sequenceLength 8192 whose longest example is 8192 tokens but whose 16 consecutive
# samples never hold more than 30000 (what dataset_stats prints for such data).
TOKENS = [8192, 9800, 11000, 12100] + [12100 + 1500 * i for i in range(1, 13)]


def job(**changes):
    base = {"model.architecture": {"preset": "llama-3.1-8b"}, "training.sequenceLength": 8192,
            "training.globalBatchSize": 16, "training.attention": "flash", "resources.gpus": 1}
    base.update(changes)
    return spec(**base)


def test_the_planner_sizes_a_padding_free_micro_batch_by_the_declared_tokens():
    pools = [pool("h100")]
    padded = plan_job(job(), pools, POLICY)
    free = plan_job(job(**{"dataset.paddingFree": True, "dataset.microBatchTokens": TOKENS}), pools, POLICY)
    assert not isinstance(padded, Infeasible) and not isinstance(free, Infeasible)
    # The padded plan sizes every micro-batch at b x 8192 tokens; the padding-free one at the declared
    # real tokens, so it fits a larger micro-batch (or drops checkpointing) and costs less per step.
    assert (free.micro_batch_size, not free.gradient_checkpointing) > (padded.micro_batch_size,
                                                                       not padded.gradient_checkpointing)
    assert free.cost_per_step < padded.cost_per_step
    # Without a declaration padding-free changes nothing the planner can count on.
    undeclared = plan_job(job(**{"dataset.paddingFree": True}), pools, POLICY)
    assert undeclared.micro_batch_size <= padded.micro_batch_size


def test_evaluation_is_sized_without_the_training_streams_tokens():
    declared = job(**{"dataset.paddingFree": True, "dataset.microBatchTokens": TOKENS[:2],
                      "evaluation": {"heldOutFraction": 0.05, "microBatchSize": 4}})
    estimates = Estimates(ask_from_spec(declared, POLICY, None), estimate_memory)
    train = estimates.setup(1, "ddp", "none", True, 2)
    evaluation = estimates.setup(1, "ddp", "none", True, 4, declared=False)
    assert train.row_length == TOKENS[1] and evaluation.row_length == 4 * 8192


def test_the_step_time_counts_the_tokens_the_rows_can_hold():
    """The step-time model prices what a step computes on: padded rows at most the longest example
    long, a padding-free step at most the tokens its samples hold (upper bounds, as the memory's)."""
    from finetune_operator.planning.search.estimate import work_of
    from finetune_operator.planning.throughput import accumulation_steps

    undeclared = work_of(ask_from_spec(job(), POLICY, None))
    shorter = [6000] + TOKENS[1:]  # the longest example 6000 tokens
    padded = work_of(ask_from_spec(job(**{"dataset.microBatchTokens": shorter}), POLICY, None))
    free = work_of(ask_from_spec(job(**{"dataset.paddingFree": True, "dataset.microBatchTokens": shorter}), POLICY, None))
    assert undeclared.tokens_per_step == 16 * 8192 and undeclared.sequence_length == 8192
    assert padded.tokens_per_step == 16 * 6000 and padded.sequence_length == 6000
    assert free.tokens_per_step == TOKENS[15] < padded.tokens_per_step
    for work in (undeclared, padded, free):
        assert accumulation_steps(work, 2, 4) == 2  # samples per step are the job's, whatever their tokens
    pools = [pool("h100")]
    plans = [plan_job(spec, pools, POLICY) for spec in (
        job(**{"resources.gpus": 1, "training.microBatchSize": 4}),
        job(**{"resources.gpus": 1, "training.microBatchSize": 4, "dataset.paddingFree": True,
               "dataset.microBatchTokens": TOKENS}))]
    assert plans[1].seconds_per_step < plans[0].seconds_per_step
