"""sample_rows: each filter and penalty changes the distribution as documented, masked tokens stay masked, and
logprobs describe the distribution a token was actually drawn from."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from corral.server.engine.sampling import SamplingParams, sample_rows

NEG = float("-inf")
# Probabilities 0.5, 0.3, 0.15, 0.05 over tokens 0..3; token 4 is masked by the grammar.
PROBS = [0.5, 0.3, 0.15, 0.05]


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def base_row() -> list[float]:
    return [math.log(p) for p in PROBS] + [NEG]


def params(**kwargs: Any) -> SamplingParams:
    return SamplingParams(**{"temperature": 1.0, **kwargs})


def support(p: SamplingParams, draws: int = 400) -> set[int]:
    """The tokens a seeded row draws over many steps."""
    generator = torch.Generator().manual_seed(0)
    seen = set()
    for _ in range(draws):
        seen |= set(sample_rows(logits(base_row()), [p], [generator]).tokens)
    return seen


def final_distribution(p: SamplingParams, row: list[float] | None = None) -> list[float]:
    """Probabilities of the distribution the row was drawn from (sample_rows leaves its logits in place)."""
    x = logits(row or base_row())
    sample_rows(x, [p], [torch.Generator().manual_seed(0)])
    return torch.softmax(x[0], dim=-1).tolist()


def test_greedy_rows_take_the_argmax_and_report_the_masked_distribution_at_temperature_1() -> None:
    x = logits(base_row(), [0.0, 3.0, 1.0, NEG, 2.0])
    out = sample_rows(x, [params(temperature=0.0, logprobs=True, top_logprobs=2)] * 2, [None, None])
    assert out.tokens == [0, 1]
    first = out.logprobs[0]
    assert first is not None and first.logprob == pytest.approx(math.log(0.5), abs=1e-5)
    assert [t for t, _ in first.top] == [0, 1]
    second = out.logprobs[1]
    assert second is not None
    assert math.exp(second.logprob) == pytest.approx(math.exp(3) / (1 + math.exp(3) + math.e + math.exp(2)), rel=1e-5)


def test_plain_sampling_draws_from_every_unmasked_token_and_never_the_masked_one() -> None:
    assert support(params()) == {0, 1, 2, 3}


def test_top_k_keeps_the_k_most_likely() -> None:
    assert support(params(top_k=2)) == {0, 1}
    probs = final_distribution(params(top_k=2))
    assert probs[:2] == pytest.approx([0.5 / 0.8, 0.3 / 0.8], rel=1e-5) and probs[2:] == [0.0, 0.0, 0.0]
    assert support(params(top_k=0)) == {0, 1, 2, 3}  # vLLM: 0 and -1 are off


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass() -> None:
    assert support(params(top_p=0.75)) == {0, 1}  # 0.5 < 0.75 <= 0.5 + 0.3
    assert support(params(top_p=0.45)) == {0}
    assert support(params(top_p=0.9)) == {0, 1, 2}


def test_min_p_drops_tokens_below_a_fraction_of_the_most_likely() -> None:
    assert support(params(min_p=0.35)) == {0, 1}  # threshold 0.175: 0.15 and 0.05 go
    assert support(params(min_p=0.2)) == {0, 1, 2}  # threshold 0.1


def test_filters_compose_and_always_keep_the_most_likely_token() -> None:
    assert support(params(top_k=3, top_p=0.6)) == {0, 1}
    assert support(params(min_p=1.0, top_p=0.01, top_k=1)) == {0}


def test_temperature_sharpens_or_flattens() -> None:
    cold = final_distribution(params(temperature=0.5))
    hot = final_distribution(params(temperature=2.0))
    assert cold[0] > 0.5 > hot[0]
    assert cold[0] == pytest.approx(0.25 / sum(p * p for p in PROBS), rel=1e-5)


def penalised(p: SamplingParams, prompt: list[int], output: list[int], row: list[float]) -> list[float]:
    x = logits(row)
    sample_rows(x, [p], [None], [(prompt, output)])
    return x[0].tolist()


def test_repetition_penalty_covers_prompt_and_output_dividing_positive_and_multiplying_negative() -> None:
    row = [2.0, -2.0, 2.0, -2.0, 1.0, NEG]
    out = penalised(params(temperature=0.0, repetition_penalty=2.0), [0, 1], [2, 5], row)
    assert out == [1.0, -4.0, 1.0, -2.0, 1.0, NEG]


def test_frequency_and_presence_penalties_count_output_tokens_only() -> None:
    row = [1.0, 1.0, 1.0, 1.0, NEG]
    out = penalised(params(temperature=0.0, frequency_penalty=0.5), [3, 3], [0, 0, 0, 1], row)
    assert out == pytest.approx([-0.5, 0.5, 1.0, 1.0, NEG])
    out = penalised(params(temperature=0.0, presence_penalty=0.5), [3, 3], [0, 0, 0, 1], row)
    assert out == pytest.approx([0.5, 0.5, 1.0, 1.0, NEG])
    out = penalised(params(temperature=0.0, presence_penalty=-1.0, frequency_penalty=-1.0), [], [2, 2], row)
    assert out == pytest.approx([1.0, 1.0, 4.0, 1.0, NEG])  # negative values encourage repeats


def test_no_bias_or_penalty_revives_a_masked_token() -> None:
    masked = 4
    p = params(
        temperature=0.7,
        logit_bias={masked: 100.0},
        presence_penalty=-2.0,
        frequency_penalty=-2.0,
        repetition_penalty=0.1,
        logprobs=True,
        top_logprobs=5,
    )
    generator = torch.Generator().manual_seed(1)
    for _ in range(50):
        x = logits(base_row())
        out = sample_rows(x, [p], [generator], [([masked], [masked, masked])])
        assert out.tokens[0] != masked and x[0, masked].item() == NEG
        entry = out.logprobs[0]
        assert entry is not None and masked not in {t for t, _ in entry.top}


def test_logprobs_describe_the_filtered_distribution_and_list_no_impossible_token() -> None:
    p = params(top_k=2, logprobs=True, top_logprobs=5)
    out = sample_rows(logits(base_row()), [p], [torch.Generator().manual_seed(3)])
    entry = out.logprobs[0]
    assert entry is not None
    assert [t for t, _ in entry.top] == [0, 1]  # only two tokens can be drawn: fewer than 5 listed
    assert sum(math.exp(lp) for _, lp in entry.top) == pytest.approx(1.0, abs=1e-5)
    assert entry.logprob == dict(entry.top)[entry.token]


def test_logprobs_are_only_computed_for_rows_that_ask() -> None:
    out = sample_rows(
        logits(base_row(), base_row()), [params(logprobs=True), params()], [None, None], [([], []), ([], [])]
    )
    assert out.logprobs[0] is not None and out.logprobs[0].top == () and out.logprobs[1] is None


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch() -> None:
    def draws(batch: int) -> list[int]:
        generator = torch.Generator().manual_seed(42)
        tokens = []
        for _ in range(20):
            rows = [base_row()] * batch
            ps = [params(top_p=0.95)] + [params(temperature=0.0), params(min_p=0.1)] * ((batch - 1) // 2)
            tokens.append(sample_rows(logits(*rows), ps, [generator] + [None] * (batch - 1)).tokens[0])
        return tokens

    assert draws(1) == draws(3) == draws(5)


def test_greedy_rows_with_candidate_ids_pick_as_over_the_whole_row() -> None:
    generator = torch.Generator().manual_seed(0)
    width = 5000
    rows = torch.full((3, width), NEG)
    allowed = [torch.tensor([3, 70, 1200, 4999]), torch.tensor([10, 11, 4000]), torch.tensor([7, 8])]
    values = [[0.5, 2.0, 2.0, 1.0], [0.1, 0.2, 0.3], [1.0, 0.0]]  # row 0 ties: the lower id wins
    for row, (ids, vals) in enumerate(zip(allowed, values, strict=True)):
        rows[row, ids] = torch.tensor(vals)
    greedy = SamplingParams(temperature=0.0)
    biased = SamplingParams(temperature=0.0, logit_bias={7: -5.0})  # the bias still applies
    plist = [greedy, greedy, biased]
    dense = sample_rows(rows.clone(), plist, [None] * 3).tokens
    sparse = sample_rows(rows.clone(), plist, [None] * 3, candidates=dict(enumerate(allowed))).tokens
    assert sparse == dense == [70, 4000, 8]
    # A sampled row ignores candidates (it needs the whole distribution) and still draws an allowed token.
    drawn = sample_rows(rows.clone(), [params()] * 3, [generator] * 3, candidates=dict(enumerate(allowed))).tokens
    assert all(token in ids.tolist() for token, ids in zip(drawn, allowed, strict=True))
