"""Per-request sampling parameters and the batch sampler.

Order of operations for one row of masked logits (the grammar mask and the engine's bans are already -inf):
`logit_bias` → penalties (repetition, then frequency and presence) → greedy: argmax; sampled: temperature →
`min_p` → `top_k` → `top_p` → draw. A bias or penalty never revives a masked token (-inf stays -inf), and each
filter always keeps the most likely token. Rows share tensor operations; each row draws with one uniform
number (from its own generator when seeded).
The whole-vocabulary work is in server/engine/vocab_ops.py.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from corral.grammars.spec import JsonWhitespace
from corral.server.engine.logprobs import TokenLogprob
from corral.server.engine.vocab_ops import draw, filter_logits, row_argmax


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # vLLM: -1 or 0 = off
    min_p: float = 0.0
    presence_penalty: float = 0.0  # over output tokens: subtracted once from every token already generated
    frequency_penalty: float = 0.0  # over output tokens: subtracted once per occurrence
    repetition_penalty: float = 1.0  # over prompt + output tokens: positive logits divided, negative multiplied
    seed: int | None = None
    stop: tuple[str, ...] = ()
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: bool = False  # record each output token's logprob (see corral/server/engine/logprobs.py)
    top_logprobs: int = 0  # with `logprobs`: this many most likely alternatives per position
    ignore_eos: bool = False  # benchmark aid (vLLM's name): run to max_tokens; stall detection is off
    max_revisions: int | None = None  # None: the engine's default depth limit
    close_answers: bool | None = None  # None: the server's --close-answers (corral/structured/answer_closing.py)
    # None: the server's --json-leading-whitespace (corral/grammars/spec.py GrammarSpec.leading_whitespace)
    json_leading_whitespace: bool | None = None
    json_whitespace: JsonWhitespace | None = None  # None: the server's --json-whitespace (GrammarSpec.whitespace)
    drafts: bool = True  # False: never speculate for this request (corral/server/engine/speculation.py)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 1e-5

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def best_only(self) -> bool:
        """Only the highest logit's token matters: greedy, with no logprobs reported and nothing added to the
        logits (penalties, biases), so the head need not give every logit exactly
        (corral/kernels/head_screen.py)."""
        return self.greedy and not self.logprobs and not self.penalized and not self.logit_bias

    @property
    def filtered(self) -> bool:
        """A sampled row that needs the sorted-vocabulary filters."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0


@dataclass(frozen=True)
class Sampled:
    tokens: list[int]
    logprobs: list[TokenLogprob | None]  # None where the row did not ask for logprobs


def make_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    if params.seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(params.seed)
    return generator


def sample_rows(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None = None,
    candidates: Mapping[int, torch.Tensor] | None = None,
) -> Sampled:
    """One token per row of masked float logits [B, V], modified in place: afterwards each row holds the
    logits of the distribution its token was drawn from (what logprobs report). `histories` gives each row's
    (prompt ids, output ids); only penalised rows read it. `candidates` may name, for some rows, ascending
    ids outside which the row is all -inf (its grammar's allowed tokens): a greedy row then looks at those
    only (the same token, ties to the lowest id, as over the whole row)."""
    _add_biases(logits, params)
    penalized = [row for row, p in enumerate(params) if p.penalized]
    if penalized:
        if histories is None:
            raise ValueError("penalties need each row's prompt and output tokens")
        _apply_penalties(logits, [params[r] for r in penalized], [histories[r] for r in penalized], penalized)
    tokens = [0] * len(params)
    known = candidates or {}
    for row in [row for row, p in enumerate(params) if p.greedy and row in known]:
        ids = known[row]
        tokens[row] = int(ids[int(torch.argmax(logits[row].index_select(0, ids)))])
    greedy = [row for row, p in enumerate(params) if p.greedy and row not in known]
    if greedy:
        picked = row_argmax(logits if len(greedy) == len(params) else logits[greedy]).tolist()
        for row, token in zip(greedy, picked, strict=True):
            tokens[row] = int(token)
    sampled = [row for row, p in enumerate(params) if not p.greedy]
    if sampled:
        for row, token in zip(sampled, _draw(logits, params, generators, sampled), strict=True):
            tokens[row] = token
    wanted = [row for row, p in enumerate(params) if p.logprobs]
    entries: list[TokenLogprob | None] = [None] * len(params)
    if wanted:
        for row, entry in zip(wanted, _logprobs(logits, params, tokens, wanted), strict=True):
            entries[row] = entry
    return Sampled(tokens, entries)


def _add_biases(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    for row, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=logits.device)
            bias = torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
            logits[row, ids] += bias  # a bias never revives a masked token: -inf stays -inf


def _column(values: Sequence[float], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, device=like.device, dtype=like.dtype)[:, None]


def _counts(id_lists: Sequence[Sequence[int]], vocab: int, like: torch.Tensor) -> torch.Tensor:
    """[R, V] occurrence counts of each row's token ids (ids past the logits' width are ignored)."""
    counts = torch.zeros((len(id_lists), vocab + 1), device=like.device, dtype=like.dtype)
    width = max((len(ids) for ids in id_lists), default=0)
    if width:
        padded = torch.full((len(id_lists), width), vocab, device=like.device, dtype=torch.long)
        for row, ids in enumerate(id_lists):
            if ids:
                padded[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long).clamp_(max=vocab)
        counts.scatter_add_(1, padded, torch.ones_like(padded, dtype=like.dtype))
    return counts[:, :vocab]  # the last column collected the padding


def _apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]],
    rows: list[int],
) -> None:
    """vLLM's semantics: repetition over prompt + output tokens, presence and frequency over output tokens."""
    vocab = logits.shape[1]
    sub = logits[rows]
    output = _counts([out for _, out in histories], vocab, sub)
    if any(p.repetition_penalty != 1.0 for p in params):
        seen = (output > 0) | (_counts([prompt for prompt, _ in histories], vocab, sub) > 0)
        # At least float's smallest normal: a penalty that rounds to 0 would make -inf * 0 = NaN (unmasking).
        factor = _column([p.repetition_penalty for p in params], sub).clamp_min(torch.finfo(sub.dtype).tiny)
        # -inf * factor is still -inf (factor > 0), so masked tokens stay masked.
        sub = torch.where(seen, torch.where(sub > 0, sub / factor, sub * factor), sub)
    sub = sub - _column([p.frequency_penalty for p in params], sub) * output
    sub = sub - _column([p.presence_penalty for p in params], sub) * (output > 0).to(sub.dtype)
    logits[rows] = sub


def _draw(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    rows: list[int],
) -> list[int]:
    every = len(rows) == logits.shape[0]
    x = logits if every else logits[rows]  # all rows: work in place, no gather and scatter of [B, V]
    x.div_(_column([params[r].temperature for r in rows], logits))
    # A temperature (or repetition penalty) small enough to overflow gives +inf, and softmax then NaN, which
    # failed the whole batch's step; capped at the largest finite value the row is as good as greedy. -inf
    # stays -inf so masked tokens stay masked.
    x.nan_to_num_(nan=float("-inf"), posinf=torch.finfo(x.dtype).max, neginf=float("-inf"))
    filtered = [i for i, r in enumerate(rows) if params[r].filtered]
    if filtered:
        sub = x[filtered]
        chosen = [params[rows[i]] for i in filtered]
        filter_logits(sub, [p.min_p for p in chosen], [p.top_k for p in chosen], [p.top_p for p in chosen])
        x[filtered] = sub
    if not every:
        logits[rows] = x
    probs = torch.softmax(x, dim=-1)
    uniforms = torch.rand(len(rows), device=logits.device)  # unseeded rows: the global generator
    for i, r in enumerate(rows):
        generator = generators[r]
        if generator is not None:  # a seed makes a row reproducible whatever else is in the batch
            uniforms[i] = torch.rand(1, generator=generator, device=generator.device)[0]
    return [int(t) for t in draw(probs, uniforms).tolist()]


def _logprobs(
    logits: torch.Tensor, params: Sequence[SamplingParams], tokens: list[int], rows: list[int]
) -> list[TokenLogprob]:
    dist = torch.log_softmax(logits[rows], dim=-1)
    chosen = dist[torch.arange(len(rows)), torch.tensor([tokens[r] for r in rows])].tolist()
    k = min(max(params[r].top_logprobs for r in rows), dist.shape[1])
    top_values, top_ids = torch.topk(dist, k, dim=-1) if k else (dist[:, :0], dist[:, :0].long())
    entries = []
    for i, r in enumerate(rows):
        n = params[r].top_logprobs
        # Tokens of probability 0 (masked or filtered out) are never listed as alternatives.
        top = tuple(
            (int(t), float(v))
            for t, v in zip(top_ids[i, :n].tolist(), top_values[i, :n].tolist(), strict=True)
            if v != float("-inf")
        )
        entries.append(TokenLogprob(tokens[r], float(chosen[i]), top))
    return entries
