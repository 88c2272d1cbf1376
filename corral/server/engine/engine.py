"""corral's decode loop: add_request / step / abort over a continuously batched set of sequences.

A step reads schedule → masks → forward → judge → sample; the structured-output stage
(`corral/structured/stage.py`) owns the grammar masks, the output stage (`output_stage.py`) the text a
request is sent. The engine owns the sequences' life: accept, revise, trip, finish.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from corral.grammar_engines.protocol import TokenizerSpec
from corral.kernels.logit_refinement import BestAmong
from corral.server.engine.drafting import PromptText
from corral.server.engine.endings import Endings
from corral.server.engine.inbox import Inbox
from corral.server.engine.logprobs import TokenLogprob
from corral.server.engine.model_runner import ForwardRow, ModelRunner, StepLogits
from corral.server.engine.output_stage import OutputStage
from corral.server.engine.sampling import make_generator, sample_rows
from corral.server.engine.scheduler import Scheduler
from corral.server.engine.sequence import Sequence
from corral.server.engine.slot_attention import SHORT_ROW_MAX
from corral.server.engine.speculation import Speculation
from corral.server.engine.thread_tuner import ThreadTuner, TorchThreads, choose_threads, record_threads
from corral.server.models import LoadedModel
from corral.structured import (
    ClosingVocabulary,
    GrammarTokens,
    MaskFill,
    SettledMasks,
    StructuredOutput,
    Trip,
    WatchdogLimits,
    admit,
    observe,
    take_back,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16
    max_model_len: int = 4096
    jump_forward: bool = True
    revision_token_id: int | None = None  # None: revision by token is off (backtracking still works)
    max_revisions: int = 4
    limits: WatchdogLimits = field(default_factory=WatchdogLimits)
    prefix_cache: bool = True  # reuse KV of prompt prefixes already computed (corral/server/engine/prefix_cache.py)
    # Host memory for prompt blocks kept after their slot is reused (corral/server/engine/host_block_store.py).
    prefix_cache_ram_mb: int = 512
    # CPU thread counts a forward may run with, chosen per forward by measurement (thread_tuner.py), or the
    # one count every forward runs with; set on the engine thread itself. Empty: leave torch's setting alone.
    thread_choices: tuple[int, ...] = ()
    # Greedy rows in wide, costly grammar states skip their mask and are checked after the pick
    # (corral/structured/lazy_masks.py).
    lazy_masks: bool = True
    # Draft tokens a row may feed after its own (speculative decoding, corral/server/engine/speculation.py); 0: off.
    draft_tokens: int = 8


class Engine:
    """Single-threaded core: only the thread that calls `step()` touches the scheduler and the cache.
    Other threads talk to it through `add_request` / `abort`, which only enqueue."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.max_len = min(config.max_model_len, loaded.context_length)
        self.runner = ModelRunner(
            loaded, max_batch=config.max_batch, max_len=self.max_len, prefix_cache=config.prefix_cache,
            prefix_cache_ram_bytes=config.prefix_cache_ram_mb << 20,
        )
        # Admission places each prompt in a slot and starts it after its cached prefix.
        self.scheduler = Scheduler(config.max_batch, placer=self.runner.prefix)
        self.stop_ids = frozenset(loaded.stop_token_ids)
        self.revise_id = config.revision_token_id
        self._inbox = Inbox()
        stop_ids = torch.tensor(sorted(self.stop_ids), device=loaded.device)
        self.structured = StructuredOutput(
            config.max_batch, loaded.vocab_size, self.revise_id, stop_ids, lazy_masks=config.lazy_masks
        )
        self.output = OutputStage(loaded.tokenizer)
        spec = TokenizerSpec(loaded.tokenizer, loaded.vocab_size, tuple(loaded.stop_token_ids))
        self.grammar_tokens = GrammarTokens(ClosingVocabulary.of(spec), self.stop_ids, jump_forward=config.jump_forward)
        drafts = config.draft_tokens if self.runner.drafts else 0
        self.speculation = Speculation(
            drafts, self.stop_ids, self.revise_id, SHORT_ROW_MAX, self.max_len, loaded.vocab_size,
            jump_forward=config.jump_forward,
            text=PromptText(self.output.token_text, self.output.encode, self.output.decode),
        )
        self.threads = ThreadTuner(config.thread_choices) if config.thread_choices else None
        self._torch_threads = TorchThreads()
        self.endings = Endings(self.scheduler, self.output, self._inbox)
        self._trip, self._finish = self.endings.trip, self.endings.finish

    # -- API used from other threads ---------------------------------------------------------------
    def add_request(self, seq: Sequence) -> None:
        self._inbox.add(seq)

    def abort(self, request_id: str) -> None:
        self._inbox.abort(request_id)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    def fail_all(self, message: str, reason: str = "error") -> None:
        """End every live sequence with an error. Engine thread only (or once that thread has ended)."""
        self.endings.fail_all(message, reason)

    def abandon_all(self, message: str, reason: str) -> None:
        """From another thread while a step is stuck: every live sequence gets its final answer now."""
        self.endings.abandon_all(message, reason)

    @property
    def on_trip(self) -> Callable[[str], None]:
        """Called with a watchdog trip's kind when one ends a sequence (the server counts them)."""
        return self.endings.on_trip

    @on_trip.setter
    def on_trip(self, callback: Callable[[str], None]) -> None:
        self.endings.on_trip = callback

    # -- the loop ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        batch = self._schedule()
        if not batch:
            return
        t0 = time.perf_counter()
        self.speculation.prepare(batch)
        masks = self.structured.start(batch)
        logits, settled = self._forward(batch, masks)
        live, best_among = self._judge(batch, logits, settled)
        self._sample(batch, live, logits, settled, best_among)
        self.speculation.stepped((time.perf_counter() - t0) * 1000)  # what drafts cost is the whole step's time

    def _schedule(self) -> list[Sequence]:
        self._drain_inbox()
        self.endings.reap_answered()
        batch = self.scheduler.schedule()
        now = time.perf_counter()
        for seq in batch:
            seq.stats.scheduled = seq.stats.scheduled or now
        return batch

    def _forward(self, batch: list[Sequence], masks: Future[MaskFill] | None) -> tuple[StepLogits, SettledMasks]:
        """Run the model on the batch: the decoder, then the masks settle (filled while it ran), then the head,
        which computes sparse rows' allowed ids only (where the runner restricts its head)."""
        rows_in = forward_rows(batch, self.structured.unmasked)
        fed = sum(len(r.tokens) for r in rows_in)
        chosen = choose_threads(self.threads, self._torch_threads, masks is not None, fed)
        t0 = time.perf_counter()
        # Free text only, no drafts: every row wants every logit, which the decoder may compute with its step.
        dense = all(s.matcher is None and s.draft is None for s in batch)
        decoded = self.runner.decode(rows_in, dense)
        t_settle = time.perf_counter()
        settled = self.structured.settle(batch, masks, restrictable=self.runner.restricts_head)
        waited = time.perf_counter() - t_settle
        logits = self.runner.head(decoded, settled.restricted)
        elapsed = time.perf_counter() - t0
        forward_ms = (elapsed - waited) * 1000
        record_threads(self.threads, chosen, elapsed * 1000)
        self.speculation.fed(rows_in, logits.dense_rows)
        for seq in batch:
            seq.num_cached += len(seq.pending)
            seq.stats.forward_ms.append(forward_ms)
        return logits, settled

    def _judge(self, batch: list[Sequence], step: StepLogits, settled: SettledMasks) -> tuple[list[int], BestAmong]:
        """End or back off the rows the masks ruled out; mask the rest. Returns the rows to sample, and where each
        refined row's best logit lies (its exact candidates)."""
        for row, message in settled.failed.items():
            grammar_failed(batch[row], message)
            self._finish(batch[row], "error")
        for row in sorted(settled.overran | settled.dead_ends):
            self._judge_row(batch[row], overran=row in settled.overran)
        logits = step.rows
        live, stuck = self.structured.apply(logits, batch, settled)
        for row in stuck:
            self._revise(batch[row], Trip.DEAD_END)
        # Restricted rows' logits are exact; the others' best few (and alternatives they report) are made so now.
        rounded = [row for row in live if row not in settled.restricted]
        best_among = step.refine(logits, rounded, [1 + batch[row].params.top_logprobs for row in rounded])
        return live, best_among

    def _judge_row(self, seq: Sequence, *, overran: bool) -> None:
        """A row whose fills overran their budget too often ends; one whose grammar allows nothing backs off."""
        if overran:
            return self._trip(seq, Trip.MASK_TIMEOUT, "mask fills overran their budget too often")
        self._revise(seq, Trip.DEAD_END)

    def _sample(
        self, batch: list[Sequence], live: list[int], step: StepLogits, settled: SettledMasks, best_among: BestAmong
    ) -> None:
        logits, drafts = step.rows, self.speculation.rows_of(batch, step.drafts)
        rows = [batch[i] for i in live]
        histories = [(s.prompt_ids, s.output_ids) for s in rows]  # penalties read them
        # All rows live is the usual step: sample in place rather than copy [B, vocab] logits.
        picked = logits if len(live) == len(batch) else logits[live]
        # Rows whose head computed only their allowed ids: a greedy pick needs to look at those only.
        known = {i: settled.restricted[row] for i, row in enumerate(live) if row in settled.restricted}
        # And full rows whose best is among their refined candidates, where nothing is added to the logits after
        # (penalties, biases): a pick over those few, not over the whole vocabulary.
        known |= {i: best_among[row] for i, row in enumerate(live) if row in best_among and rows[i].params.best_only}
        sampled = sample_rows(picked, [s.params for s in rows], [s.generator for s in rows], histories, known)
        for i, (seq, token, logprob) in enumerate(zip(rows, sampled.tokens, sampled.logprobs, strict=True)):
            if live[i] in self.structured.unmasked:  # picked without its mask: the grammar checks the pick now
                checked = self.structured.recheck(seq, live[i], token, picked[i])
                if checked.token is None or checked.overran:
                    self._judge_row(seq, overran=checked.overran)
                    continue
                token = checked.token
            if token == self.revise_id:
                self._revise(seq, Trip.REVISION_DEPTH_EXCEEDED)
            else:
                self._advance(seq, token, settled.narrow.get(seq), logprob)
                if seq in drafts:  # the draft's guesses after this token, checked against this step's logits
                    self.speculation.verify(seq, drafts[seq], self._advance)
        for seq in drafts:
            self.speculation.settle_kv(seq)

    def _drain_inbox(self) -> None:
        for item in self._inbox.drain():
            if isinstance(item, Sequence):
                try:
                    self._admit(item)
                except Exception as exc:  # this request's fault (e.g. its seed); the batch goes on
                    log.exception("admitting request %s failed", item.request_id)
                    item.error = f"the request could not start: {type(exc).__name__}: {exc}"
                    self._finish(item, "error")
            else:
                seq = self.scheduler.find(item)
                if seq is not None:
                    self._finish(seq, "abort")

    def _admit(self, seq: Sequence) -> None:
        seq.generator = make_generator(seq.params, self.loaded.device)
        admit(seq, self.config.limits, self.config.max_revisions, self.output.is_whitespace)
        seq.closer = self.grammar_tokens.closer_for(seq, self._room(seq))
        self.scheduler.add(seq)

    # -- tokens ------------------------------------------------------------------------------------
    def _advance(
        self, seq: Sequence, token: int, narrow: list[int] | None = None, logprob: TokenLogprob | None = None
    ) -> None:
        """Take the sampled token: end on a stop token, else accept it, append forced tokens, check limits.
        `narrow`: the few tokens the row's mask allowed, if it allowed few (the stall check reads them)."""
        now = time.perf_counter()
        seq.stats.first_token = seq.stats.first_token or now
        seq.stats.last_token = now
        seq.stats.token_times.append(now)
        if token in self.stop_ids and (seq.matcher is not None or not seq.params.ignore_eos):
            seq.stats.stop_sampled = True
            self._finish(seq, "stop")
            return
        matcher = seq.matcher
        if matcher is not None and not matcher.accept_token(token):  # its mask allowed it: the engine failed
            grammar_failed(seq, refusal(seq, token, self.output.token_text(token)))
            self._finish(seq, "error")
            return
        appended = [token, *self.grammar_tokens.forced_after(seq)]
        if logprob is not None:  # forced tokens were the only ones allowed: probability 1
            seq.logprobs += [logprob, *(TokenLogprob.forced(t, seq.params.top_logprobs) for t in appended[1:])]
        seq.output_ids.extend(appended)
        seq.stats.sampled_tokens += 1
        seq.pending = appended
        chosen, stalled = observe(seq, appended, narrow, self.output.token_text)
        if self._close(seq, chosen, stalled):
            return
        if stalled:
            self._trip(seq, Trip.STALL, "the output repeated whitespace or a token cycle past the limit")
            return
        # Decoding every step is only needed to stream deltas or to look for stop strings.
        stop_string = bool(seq.streaming or seq.params.stop) and self.output.emit(seq)
        if stop_string or (matcher is not None and matcher.is_terminated()):
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_cached + len(seq.pending) >= self.max_len:
            self._finish(seq, "length")

    def _room(self, seq: Sequence) -> int:
        """Tokens the answer may still add: max_tokens or the context, whichever ends first."""
        return min(seq.params.max_tokens - len(seq.output_ids), self.max_len - seq.num_cached - len(seq.pending))

    def _close(self, seq: Sequence, chosen: list[bool], stalled: bool) -> bool:
        """Close a structured answer early (corral/structured/answer_closing.py): the budget is about to cut it,
        or the model runs away (`stalled`, or a runaway value)."""
        closed = self.grammar_tokens.close(seq, self._room(seq), self.output, chosen, stalled=stalled)
        if closed:
            self._finish(seq, "closed")
        return closed

    def _revise(self, seq: Sequence, trip_if_unable: Trip) -> None:
        """Take back the last step and ban its choice (a sampled revision token, or backing out of a dead end)."""
        tripped = take_back(seq, trip_if_unable, self.revise_id, self.structured.choice_probe(seq))
        if tripped is not None:
            self._trip(seq, *tripped)

    def shutdown(self) -> None:
        self.structured.shutdown()


def grammar_failed(seq: Sequence, message: str) -> None:
    """Mark a request its grammar engine failed (a fill raised, or it refused a token its own mask allowed), and log
    why: it ends with `error`, and `auto` may run it again on another engine (corral/server/serving.py)."""
    log.warning("request %s ended by a grammar engine error: %s", seq.request_id, message)
    seq.grammar_failed = True
    seq.error = message


def refusal(seq: Sequence, token: int, text: str) -> str:
    """What a matcher that refused the token its mask allowed says, in the engine's words."""
    engine = seq.backend.name if seq.backend is not None else "grammar"
    cause = (seq.matcher.error if seq.matcher is not None else None) or "no reason given"
    return f"the {engine} engine refused token {token} ({text!r}), which its mask allowed: {cause}"


def forward_rows(batch: list[Sequence], unmasked: list[int]) -> list[ForwardRow]:
    """The step's rows for the runner. A row needs only its best token's id where its sampling says so and it
    was not picked before its mask (`unmasked`: the recheck after a refused pick needs its exact logits)."""
    return [ForwardRow(s.slot, s.num_cached, [*s.pending, *(s.draft.tokens if s.draft else ())],
                       s.params.best_only and i not in unmasked, *draft_shape(s)) for i, s in enumerate(batch)]


def draft_shape(seq: Sequence) -> tuple[int, list[int], dict[int, torch.Tensor]] | tuple[()]:
    """A drafting row's draft length, the draft places it wants logits at and their sparse masks (ForwardRow's
    last three fields)."""
    return (len(seq.draft), seq.draft.outputs(), seq.draft.sparse) if seq.draft is not None else ()
