"""Speculative decoding inside the grammar: a row feeds a draft (corral/server/engine/drafting.py) after its real
tokens,
the forward gives logits at the draft's places, and the row keeps the draft's longest prefix the model agrees
with, plus the model's own pick where it first disagrees.

Only rows whose pick is the best logit (`SamplingParams.best_only`: greedy, no logprobs, penalties or biases)
draft, and each place is picked under the grammar's mask there, so an answer is token for token the one
without drafts. The forward's cost grows with the tokens it feeds (on 2 CPU cores a 1.5B model's step of 4
tokens costs 2.6 times one of 1), so each row drafts only as many tokens as its measured acceptance and the
measured step cost make worth it (`best_length`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from collections.abc import Sequence as Sequence_

import torch

from corral.grammar_engines.bitmask import allowed_counts, allowed_ids, apply_bitmask, sparse_limit
from corral.grammar_engines.protocol import Matcher, allocate_bitmask
from corral.server.engine.drafting import Draft, KindHistory, NgramIndex, PromptText, propose
from corral.server.engine.model_runner import ForwardRow
from corral.server.engine.sequence import Sequence
from corral.server.engine.step_cost import CostParts, StepCost, StepShape
from corral.structured import set_bit

# A draft's guesses are priced per guess from the drafted steps measured (step_cost.py), but a step's cost is not
# linear in its guesses: on Gemma 3 270M at one row the head of 2 rows costs 2.6 times one row's, of 5 rows 3.7
# times (docs/measured-choices.md#q8_0-products-of-few-rows), so 1-guess drafts priced every guess at 13.7 ms against
# a plain step's 11.3, and a reply copying its prompt (guesses kept 95 %) never fed a longer draft, which would have
# cost ~40 ms for 8 guesses. So a lone row whose guesses are kept at least EXPLORE_RATE, where drafted steps of its
# row count were measured (the per-guess price is theirs, not the prior's), feeds the longest draft it may,
# unpriced, until EXPLORE_STEPS steps of that shape are measured; their price then stands on its own shape.
EXPLORE_RATE = 0.85
EXPLORE_STEPS = 4


def best_length(rate: float, limit: int, step_ms: Callable[[int], float], made: float) -> int:
    """How many draft tokens maximise the step's expected tokens per ms: `made` tokens the step gives anyway,
    `step_ms(n)` its time with n draft tokens, the i-th adding `rate ** i` expected tokens."""
    best, best_rate = 0, made / max(step_ms(0), 1e-9)
    gain = 0.0
    for length in range(1, limit + 1):
        gain += rate**length
        value = (made + gain) / max(step_ms(length), 1e-9)
        if value > best_rate:
            best, best_rate = length, value
    return best


def _draft_ms(cost: CostParts, step: StepShape, dense_share: float, tokens: int) -> float:
    """The step's time with a draft of `tokens` more, `dense_share` of its places dense."""
    return cost.grown_ms(step, tokens, tokens * dense_share)


def expected_kept(draft: Draft, rate: float) -> float:
    """The draft tokens a row should keep: each guess kept with `rate` once the one before it was, the grammar's
    forced tokens with the guess before them."""
    kept, chance = 0.0, 1.0
    for forced in draft.forced:
        chance *= 1.0 if forced else rate
        kept += chance
    return kept


class Speculation:
    """Drafts for a step's rows before the forward, and their verification after it."""

    def __init__(
        self,
        max_draft: int,
        stop_ids: frozenset[int],
        revise_id: int | None,
        row_max: int,
        max_len: int,
        vocab_size: int,
        *,
        jump_forward: bool = True,
        text: PromptText | None = None,
    ) -> None:
        """row_max: tokens a row may feed and stay on the decode path (slot_attention.SHORT_ROW_MAX); text: the
        tokenizer's side of the lookups (informative tokens, copies that start inside a prompt token)."""
        self.max_draft = max_draft
        self.text = text
        self.jump_forward = jump_forward
        self.stop_ids = stop_ids
        self.revise_id = revise_id
        self.row_max = row_max
        self.max_len = max_len
        self.vocab_size = vocab_size
        self.cost = StepCost()
        # Recent drafting outcomes per kind (under a grammar or not), where a new row starts.
        self.history = {True: KindHistory(), False: KindHistory()}
        self._shape: StepShape | None = None  # the running step's, until `stepped`
        self._bitmask = allocate_bitmask(row_max, vocab_size)

    # -- before the forward ------------------------------------------------------------------------
    def prepare(self, batch: list[Sequence]) -> None:
        """Give each row that may draft its draft for this step (`seq.draft`), sized by `best_length`."""
        cost = self.cost.parts()
        # This step without drafts: its fed tokens, and a logit row per row (dense or not, the head costs it); each
        # row's draft adds to it.
        step = StepShape(sum(len(s.pending) for s in batch), len(batch), 0, len(batch))
        made = float(len(batch))
        for seq in batch:
            seq.draft = None
            limit = self._limit(seq)
            if limit <= 0:
                continue
            if seq.ngrams is None:  # the row's first chance to draft
                self.history[seq.matcher is not None].seed(seq.drafting)
                seq.ngrams = NgramIndex()
                if self.text is not None:
                    seq.ngrams.prompt_text = self.text.decode(seq.prompt_ids)
            context = [*seq.prompt_ids, *seq.output_ids]
            seq.ngrams.sync(context)
            self._score_shadow(seq)
            rate, share = seq.drafting.rate, seq.drafting.dense_share
            length = best_length(rate, limit, functools.partial(_draft_ms, cost, step, share), made)
            explore = (length < limit and rate >= EXPLORE_RATE and len(batch) == 1 and step.rows in cost.per_guess
                       and self.cost.drafted_steps(step.rows, step.tokens + limit) < EXPLORE_STEPS)
            if explore:  # a long draft whose price is a guess from shorter ones: measured a few times (below)
                length = limit
            # The room jump-forward has after each guess (none where it is off: the draft forces nothing either).
            forced_room = seq.params.max_tokens - len(seq.output_ids) if self.jump_forward else 0
            if length == 0:  # not worth a draft now: a shadow of the longest one, so the rate is still measured
                seq.drafting.idle()
                if seq.shadow is None:
                    self._shade(seq, propose(seq.ngrams, context, limit, seq.matcher, self.stop_ids, forced_room,
                                             self.text, len(seq.output_ids)))
                continue
            draft = propose(seq.ngrams, context, length, seq.matcher, self.stop_ids, forced_room, self.text,
                            len(seq.output_ids))
            if draft.proposed == 0:
                continue
            # The lookup may find fewer tokens than were worth feeding: a draft that does not pay as it is, is not fed
            # (it is the row's shadow instead).
            gain = expected_kept(draft, rate)
            places = len(draft.outputs())
            drafted_ms = cost.step_ms(step.grown(len(draft), places * share))
            explored = explore and len(draft) == limit
            if not explored and (made + gain) / max(drafted_ms, 1e-9) <= made / max(cost.step_ms(step), 1e-9):
                if seq.shadow is None:
                    self._shade(seq, draft)
                continue
            self._score_shadow(seq, final=True)  # the fed draft covers the places the shadow guessed
            draft.start, draft.cached = len(seq.output_ids), seq.num_cached + len(seq.pending)
            if seq.matcher is not None:
                self._mask(seq, seq.matcher, draft)
                seq.drafting.saw_places(len(draft.outputs()), len(draft.sparse))
            seq.draft = draft
            step = StepShape(step.tokens + len(draft), step.dense_rows + places - len(draft.sparse),
                             step.draft_places + places, step.rows)  # the draft as fed: its places, its sparse ones
            made += gain

    @staticmethod
    def _shade(seq: Sequence, draft: Draft) -> None:
        """Keep a looked-up draft that is not fed as the row's shadow (its first guess is for the next token)."""
        if draft.proposed:
            draft.start = len(seq.output_ids)
            seq.shadow = draft

    def _score_shadow(self, seq: Sequence, *, final: bool = False) -> None:
        """Count the row's shadow's guesses the answer has kept since the last count, and a refusal once the
        answer has left it; the shadow ends there, past its end, or with `final` (a fed draft covers its places
        now). The answer is the one the row's verification would have made: only greedy rows draft, and every
        place is picked under its mask."""
        shadow = seq.shadow
        if shadow is None:
            return
        if len(seq.output_ids) < shadow.start:  # revised back past it
            seq.shadow = None
            return
        produced = seq.output_ids[shadow.start :]
        kept = kept_prefix(produced, shadow.tokens)
        accepted = shadow.forced[:kept].count(False)
        left = kept < len(produced)
        done = left or kept == len(shadow.tokens) or final
        if accepted > shadow.observed or done:
            seq.drafting.observe(accepted - shadow.observed, refused=left, first=shadow.observed == 0)
            shadow.observed = accepted
        if done:
            seq.drafting.shadows += 1
            self.history[seq.matcher is not None].record(shadow.proposed if left else accepted, accepted)
            seq.shadow = None

    def _limit(self, seq: Sequence) -> int:
        """Draft tokens this row may feed: none while it prefills or where its pick is not the best logit."""
        if self.max_draft <= 0 or not seq.params.best_only or not seq.params.drafts or not seq.output_ids:
            return 0
        room = min(
            seq.params.max_tokens - len(seq.output_ids) - 1, self.max_len - seq.num_cached - len(seq.pending) - 1
        )
        return max(0, min(self.max_draft, self.row_max - len(seq.pending), room))

    def _mask(self, seq: Sequence, matcher: Matcher, draft: Draft) -> None:
        """The grammar's mask at each place verification reads, so a pick there is the masked pick (the one a
        step without the draft makes); a sparse place's head computes its allowed ids alone. Where the row may
        still revise, the revision token is allowed too, as a step's mask allows it (a pick of it ends the
        walk: the next step makes it, under the engine's rules)."""
        places = draft.outputs()
        for j, token in enumerate(draft.tokens):
            accepted = matcher.accept_token(token)
            assert accepted, "the draft was built in this matcher's grammar"
            if j in places:
                matcher.fill_bitmask(self._bitmask, places.index(j))
        matcher.rollback(len(draft.tokens))
        masks = self._bitmask[: len(places)].clone()
        counts = allowed_counts(masks, list(range(len(places))))
        words = masks.numpy()
        limit = sparse_limit(self.vocab_size)
        draft.masks = masks
        draft.sparse = {
            i: torch.from_numpy(allowed_ids(words[i], self.vocab_size)) for i, n in enumerate(counts) if n <= limit
        }
        if self.revise_id is not None and seq.revision.remaining > 0 and self.revise_id < self.vocab_size:
            for i, count in enumerate(counts):
                if count:  # a place that allows nothing is a dead end, which the next step backs off from
                    set_bit(masks, i, self.revise_id)
                    if i in draft.sparse:
                        draft.sparse[i] = torch.unique(torch.cat([draft.sparse[i], torch.tensor([self.revise_id])]))

    # -- after the forward -------------------------------------------------------------------------
    def fed(self, rows: Sequence_[ForwardRow], dense_rows: int) -> None:
        """A forward ran, computing `dense_rows` logit rows over the whole vocabulary. A decode step (no prompt
        row) is a sample of the step cost once `stepped` gives its time."""
        decode = all(len(r.tokens) <= self.row_max for r in rows)
        places = sum(len(r.draft_outputs) for r in rows)
        self._shape = StepShape(sum(len(r.tokens) for r in rows), dense_rows, places, len(rows)) if decode else None

    def stepped(self, ms: float) -> None:
        """The step's wall time, drafting and verification included."""
        if self._shape is not None:
            self.cost.record(self._shape, ms)
        self._shape = None

    @staticmethod
    def rows_of(batch: list[Sequence], drafts: torch.Tensor) -> dict[Sequence, torch.Tensor]:
        """Each drafting row's draft logits (its rows of the step's `drafts`, in batch order)."""
        out: dict[Sequence, torch.Tensor] = {}
        offset = 0
        for seq in batch:
            if seq.draft is not None:
                wanted = len(seq.draft.outputs())
                out[seq] = drafts[offset : offset + wanted]
                offset += wanted
        return out

    def verify(self, seq: Sequence, logits: torch.Tensor, advance: Callable[[Sequence, int], None]) -> None:
        """After the row's main pick was taken: walk the draft while the model's pick at each place (`logits`:
        its rows of the step's draft logits, one per `Draft.outputs` place) is the guess there, taking each
        through `advance`; where it differs, or after the draft's last token, take the model's pick too."""
        draft = seq.draft
        assert draft is not None
        place = {j: row for row, j in enumerate(draft.outputs())}
        while not seq.is_finished:
            produced = seq.output_ids[draft.start :]
            i = len(produced)
            if i == 0 or i > len(draft) or produced != draft.tokens[:i] or i - 1 not in place:
                break  # the answer left the draft: the later logits are for other text
            pick = self._pick(seq, draft, logits, place[i - 1])
            if pick is None or pick in seq.revision.banned_at(len(seq.output_ids)):
                break  # the pick here is not the one a step would make: the next step makes it
            advance(seq, pick)
            if i == len(draft) or pick != draft.tokens[i]:
                break  # the model's own token where the draft ended or went wrong: the step's last
        kept = kept_prefix(seq.output_ids[draft.start :], draft.tokens)
        accepted = draft.forced[:kept].count(False)
        seq.drafting.record(draft.proposed, accepted)
        self.history[seq.matcher is not None].record(draft.proposed, accepted)

    def _pick(self, seq: Sequence, draft: Draft, logits: torch.Tensor, row: int) -> int | None:
        """The greedy pick at a draft place, as a step makes it there: under the grammar's mask (a sparse place
        came out of the head masked), never a stop token where the request ignores them. None: nothing allowed."""
        line = logits[row]
        if draft.masks is not None and row not in draft.sparse:
            masked = line.clone()[None]
            apply_bitmask(masked, draft.masks[row : row + 1])
            line = masked[0]
        pick = int(torch.argmax(line))
        if bool(torch.isinf(line[pick])) or pick == self.revise_id:
            return None
        if seq.matcher is None and seq.params.ignore_eos and pick in self.stop_ids:
            return None
        return pick

    @staticmethod
    def settle_kv(seq: Sequence) -> None:
        """Keep the KV of the draft tokens the answer kept; the rest of the draft's places are rewritten later.
        Where every fed token was kept, the last one is fed again: the logits after it need this step's mask."""
        draft, seq.draft = seq.draft, None
        if draft is None or seq.is_finished or len(seq.output_ids) < draft.start:
            return  # ended, or revised (the revision set the row's cache and pending tokens itself)
        tokens = [*seq.prompt_ids, *seq.output_ids]
        valid = min(draft.cached + kept_prefix(seq.output_ids[draft.start :], draft.tokens), len(tokens) - 1)
        seq.num_cached = valid
        seq.pending = tokens[valid:]


def kept_prefix(produced: list[int], drafted: list[int]) -> int:
    """How many leading draft tokens the answer kept."""
    kept = 0
    for made, guessed in zip(produced, drafted, strict=False):
        if made != guessed:
            break
        kept += 1
    return kept
