"""corral's decode loop: add_request / step / abort over a continuously batched set of sequences."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from samplers.bitmask import apply_bitmask, sparse_limit, unpack_rows
from samplers.protocol import Matcher, SamplerBackend, allocate_bitmask
from samplers.revision import ChoiceProbe, RevisionTracker
from samplers.watchdog import FEW_ALLOWED, MaskBudget, StallDetector, Trip, WatchdogLimits, dictated
from server.engine.logprobs import TokenLogprob, tokens_reaching, tokens_within
from server.engine.model_runner import ForwardRow, ModelRunner
from server.engine.sampling import make_generator, sample_rows
from server.engine.scheduler import Scheduler
from server.engine.sequence import SeqOutput, Sequence
from server.models import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16
    max_model_len: int = 4096
    jump_forward: bool = True
    revision_token_id: int | None = None  # None: revision by token is off (backtracking still works)
    max_revisions: int = 4
    limits: WatchdogLimits = field(default_factory=WatchdogLimits)
    prefix_cache: bool = True  # reuse KV of prompt prefixes already computed (server/engine/prefix_cache.py)


class Engine:
    """Single-threaded core: only the thread that calls `step()` touches the scheduler and the cache.
    Other threads talk to it through `add_request` / `abort`, which only enqueue."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.max_len = min(config.max_model_len, loaded.context_length)
        self.runner = ModelRunner(
            loaded, max_batch=config.max_batch, max_len=self.max_len, prefix_cache=config.prefix_cache
        )
        # Admission places each prompt in a slot and starts it after its cached prefix.
        self.scheduler = Scheduler(config.max_batch, placer=self.runner.prefix)
        self.tokenizer = loaded.tokenizer
        self.stop_ids = frozenset(loaded.stop_token_ids)
        self.revise_id = config.revision_token_id
        self._inbox: queue.SimpleQueue[tuple[str, Sequence | str]] = queue.SimpleQueue()
        self._vocab = loaded.vocab_size
        self._bitmask = allocate_bitmask(config.max_batch, loaded.vocab_size)
        self._probe = allocate_bitmask(1, loaded.vocab_size)  # revisions ask the grammar on this row
        # Masks are filled on this worker while the forward runs on the engine thread; both the
        # engines' fill calls and torch's kernels release the GIL, so the two really overlap.
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-mask")
        self._ban_stop = torch.tensor(sorted(self.stop_ids), device=loaded.device)
        self._whitespace: dict[int, bool] = {}
        self._texts: dict[int, str] = {}
        # Per step: the tokens a row's mask allowed when they were few (the stall check asks whether the
        # sampled token was the model's choice or the grammar's).
        self._narrow: dict[Sequence, list[int]] = {}
        self.on_trip: Callable[[str], None] = lambda kind: None
        # Held while a sequence's final answer is given: the engine thread and the hung-step watchdog
        # (another thread) may both end the same sequence; the first one answers.
        self._answer_lock = threading.Lock()

    # -- API used from other threads ---------------------------------------------------------------
    def add_request(self, seq: Sequence) -> None:
        self._inbox.put(("add", seq))

    def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    # -- the loop ----------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        self._drain_inbox()
        self._reap_answered()
        batch = self.scheduler.schedule()
        if not batch:
            return
        now = time.perf_counter()
        for seq in batch:
            seq.stats.scheduled = seq.stats.scheduled or now
        masks = self._start_masks(batch)
        settled: _SettledMasks | None = None
        waited = 0.0

        def restrict() -> dict[int, torch.Tensor]:
            """Between the decoder and its head: settle the masks, name the rows whose head can be cut."""
            nonlocal settled, waited
            t_wait = time.perf_counter()
            settled = self._settle_masks(batch, masks, restrictable=True)
            waited = time.perf_counter() - t_wait
            return settled.restricted

        t0 = time.perf_counter()
        rows_in = [ForwardRow(s.slot, s.num_cached, s.pending) for s in batch]
        logits = self.runner.forward(rows_in, restrict if masks is not None else None)
        forward_ms = (time.perf_counter() - t0 - waited) * 1000
        for seq in batch:
            seq.num_cached += len(seq.pending)
            seq.stats.forward_ms.append(forward_ms)
        if settled is None:  # the runner did not ask: every masked row gets the full logits, masked after
            settled = self._settle_masks(batch, masks, restrictable=False)
        self._act_on_masks(batch, settled)
        live = self._apply_masks(logits, batch, settled)
        rows = [batch[i] for i in live]
        histories = [(s.prompt_ids, s.output_ids) for s in rows]  # penalties read them
        # All rows live is the usual step: sample in place rather than copy [B, vocab] logits.
        picked = logits if len(live) == len(batch) else logits[live]
        # Rows whose head computed only their allowed ids: a greedy pick needs to look at those only.
        known = {i: settled.restricted[row] for i, row in enumerate(live) if row in settled.restricted}
        sampled = sample_rows(picked, [s.params for s in rows], [s.generator for s in rows], histories, known)
        for seq, token, logprob in zip(rows, sampled.tokens, sampled.logprobs, strict=True):
            if token == self.revise_id:
                self._revise(seq, Trip.REVISION_DEPTH_EXCEEDED)
            else:
                self._advance(seq, token, logprob)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and isinstance(item, Sequence):
                try:
                    self._admit(item)
                except Exception as exc:  # this request's fault (e.g. its seed); the batch goes on
                    log.exception("admitting request %s failed", item.request_id)
                    item.error = f"the request could not start: {type(exc).__name__}: {exc}"
                    self._finish(item, "error")
            elif kind == "abort" and isinstance(item, str):
                seq = self.scheduler.find(item)
                if seq is not None:
                    self._finish(seq, "abort")

    def _admit(self, seq: Sequence) -> None:
        p = seq.params
        seq.generator = make_generator(p, self.loaded.device)
        depth = self.config.max_revisions if p.max_revisions is None else p.max_revisions
        seq.revision = RevisionTracker(depth)
        seq.mask_budget = MaskBudget(self.config.limits)
        # ignore_eos asks to run to max_tokens (benchmarks): loops are the point there, not a fault.
        seq.stall = None if p.ignore_eos else StallDetector(self.config.limits, self._is_whitespace)
        self.scheduler.add(seq)

    # -- masks ---------------------------------------------------------------------------------------
    def _reap_answered(self) -> None:
        """Drop sequences the hung-step watchdog already answered (it never touches the scheduler itself)."""
        for seq in [s for s in (*self.scheduler.running, *self.scheduler.waiting) if s.answered]:
            self.scheduler.finish(seq)

    def _start_masks(self, batch: list[Sequence]) -> Future[MaskFill] | None:
        groups: dict[int, tuple[SamplerBackend, list[Matcher], list[int]]] = {}
        for row, seq in enumerate(batch):
            if seq.matcher is not None and seq.backend is not None:
                entry = groups.setdefault(id(seq.backend), (seq.backend, [], []))
                entry[1].append(seq.matcher)
                entry[2].append(row)
        if not groups:
            return None
        return self._mask_pool.submit(self._fill_masks, list(groups.values()))

    def _fill_masks(self, groups: list[tuple[SamplerBackend, list[Matcher], list[int]]]) -> MaskFill:
        """Fill each backend's rows in one batched call; returns µs per row (the group's time / rows).
        A batched call that raises is retried row by row, so only the rows that fail on their own fail."""
        per_row: dict[int, float] = {}
        failed: dict[int, str] = {}
        for backend, matchers, rows in groups:
            t0 = time.perf_counter()
            try:
                backend.fill_bitmasks(matchers, self._bitmask, rows)
            except Exception:
                log.exception("%s failed to fill a batch of %d masks; filling them one by one", backend.name, len(rows))
                for matcher, row in zip(matchers, rows, strict=True):
                    try:
                        matcher.fill_bitmask(self._bitmask, row)
                    except Exception as exc:
                        failed[row] = f"the {backend.name} grammar engine failed: {type(exc).__name__}: {exc}"
            each = (time.perf_counter() - t0) * 1e6 / len(rows)
            per_row.update({row: each for row in rows if row not in failed})
        return MaskFill(per_row, failed)

    def _settle_masks(
        self, batch: list[Sequence], masks: Future[MaskFill] | None, *, restrictable: bool
    ) -> _SettledMasks:
        """Wait for the step's masks and judge them: failed fills, budget overruns, dead ends, the revision
        token's bit. It may run mid-forward (between the decoder and its head), so it changes no sequence:
        `_act_on_masks` ends or backs off rows after the forward. When `restrictable` (the runner asked,
        between decoder and head), it also names the allowed ids of each surviving row whose mask allows
        few tokens: the head computes only those."""
        self._narrow = {}
        if masks is None:
            return _SettledMasks([], {}, set(), set(), {})
        per_row, failed = masks.result()
        rows = sorted(per_row)
        # One popcount over the step's rows; only rows that allow few tokens are unpacked (those the watchdog
        # checks for a dictated choice, and, when the head can be cut, those it cuts).
        most = max(sparse_limit(self._vocab), FEW_ALLOWED) if restrictable else FEW_ALLOWED
        counts, unpacked = unpack_rows(self._bitmask, rows, self._vocab, most)
        self._narrow = {
            batch[row]: ids.tolist()
            for row, ids in unpacked.items()
            if len(ids) <= FEW_ALLOWED and batch[row].stall is not None
        }
        overran: set[int] = set()
        dead_ends: set[int] = set()
        revisable: set[int] = set()
        for row in rows:
            seq = batch[row]
            seq.stats.mask_us.append(per_row[row])
            assert seq.mask_budget is not None
            if seq.mask_budget.record(per_row[row]):
                overran.add(row)
            elif counts[row] == 0:
                dead_ends.add(row)  # backtrack: the grammar allows nothing here
            elif self.revise_id is not None and seq.revision.can_revise():
                _set_bit(self._bitmask, row, self.revise_id)  # revision stays possible under any grammar
                revisable.add(row)
        settled = _SettledMasks(rows, failed, overran, dead_ends, {})
        if restrictable:
            # A row that ends here needs no logits at all; a sparse one only its allowed ids.
            dead = settled.dead
            settled.restricted.update({row: _NO_TOKENS for row in dead})
            for row, ids in unpacked.items():
                if row in dead:
                    continue
                if row in revisable and self.revise_id is not None and self.revise_id < self._vocab:
                    at = int(np.searchsorted(ids, self.revise_id))  # kept ascending: greedy ties go low
                    if at == len(ids) or ids[at] != self.revise_id:
                        ids = np.insert(ids, at, self.revise_id)
                settled.restricted[row] = torch.from_numpy(ids)
        return settled

    def _act_on_masks(self, batch: list[Sequence], settled: _SettledMasks) -> None:
        for row, message in settled.failed.items():
            batch[row].error = message
            self._finish(batch[row], "error")
        for row in sorted(settled.overran):
            self._trip(batch[row], Trip.MASK_TIMEOUT, "mask fills overran their budget too often")
        for row in sorted(settled.dead_ends):
            self._revise(batch[row], Trip.DEAD_END)

    def _apply_masks(self, logits: torch.Tensor, batch: list[Sequence], settled: _SettledMasks) -> list[int]:
        """Mask every row; returns the rows that go on to sampling (watchdog trips and dead ends don't)."""
        free_rows = [i for i, s in enumerate(batch) if s.matcher is None and s.params.ignore_eos]
        if free_rows:
            logits[torch.tensor(free_rows)[:, None], self._ban_stop[None, :]] = float("-inf")
        # Restricted rows came out of the head already masked.
        unmasked = [row for row in settled.rows if row not in settled.restricted]
        if unmasked:
            apply_bitmask(logits, self._bitmask[: len(batch)], unmasked)
        dead = settled.dead
        live = [i for i in range(len(batch)) if i not in dead]
        for row in live:
            seq = batch[row]
            banned = seq.revision.banned_at(len(seq.output_ids))
            if banned:
                logits[row, list(banned)] = float("-inf")
            if self.revise_id is not None and not seq.revision.units:
                logits[row, self.revise_id] = float("-inf")  # nothing to take back yet
        # A ban can remove the last allowed token: that is a dead end too.
        stuck = [i for i in live if batch[i].revision.bans and bool(torch.isinf(logits[i]).all())]
        for row in stuck:
            self._revise(batch[row], Trip.DEAD_END)
        return [i for i in live if i not in stuck]

    # -- tokens ------------------------------------------------------------------------------------
    def _advance(self, seq: Sequence, token: int, logprob: TokenLogprob | None = None) -> None:
        """Take the sampled token: end on a stop token, else accept it, append forced tokens, check limits."""
        now = time.perf_counter()
        seq.stats.first_token = seq.stats.first_token or now
        seq.stats.last_token = now
        seq.stats.token_times.append(now)
        if token in self.stop_ids and (seq.matcher is not None or not seq.params.ignore_eos):
            self._finish(seq, "stop")
            return
        matcher = seq.matcher
        if matcher is not None and not matcher.accept_token(token):
            seq.error = matcher.error or f"the grammar rejected token {token}"
            self._finish(seq, "error")
            return
        appended = [token]
        if matcher is not None and self.config.jump_forward and not matcher.is_terminated():
            room = seq.params.max_tokens - len(seq.output_ids) - 1
            for forced in matcher.forced_tokens()[:room]:
                if forced in self.stop_ids or not matcher.accept_token(forced):
                    break
                appended.append(forced)
            seq.stats.forced_tokens += len(appended) - 1
        if logprob is not None:  # forced tokens were the only ones allowed: probability 1
            seq.logprobs += [logprob, *(TokenLogprob.forced(t, seq.params.top_logprobs) for t in appended[1:])]
        seq.output_ids.extend(appended)
        seq.stats.sampled_tokens += 1
        seq.pending = appended
        seq.revision.record(len(appended))
        # Only the model's own choices can make a loop: jump-forward tokens, and a sampled token every
        # allowed alternative agreed with, were the grammar's.
        chosen = [not dictated(token, self._narrow.get(seq), self._token_text), *([False] * (len(appended) - 1))]
        if seq.stall is not None and seq.stall.observe(appended, chosen):
            self._trip(seq, Trip.STALL, "the output repeated whitespace or a token cycle past the limit")
            return
        # Decoding every step is only needed to stream deltas or to look for stop strings.
        if (seq.streaming or seq.params.stop) and self._emit_text(seq):
            return
        if matcher is not None and matcher.is_terminated():
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_cached + len(seq.pending) >= self.max_len:
            self._finish(seq, "length")

    def _revise(self, seq: Sequence, trip_if_unable: Trip) -> None:
        """Take back the last step (matcher, output, KV) and ban its choice at that position.
        Used for a sampled revision token and for backtracking out of a dead end."""
        if not seq.revision.can_revise():
            if trip_if_unable is Trip.DEAD_END:
                message = "the grammar allows no token here and no revision could recover"
            else:
                message = f"more than {seq.revision.max_revisions} revisions"
            self._trip(seq, trip_if_unable, message)
            return
        if seq.revision.revise(seq.output_ids, seq.matcher, self._choice_probe(seq)) is None:
            if trip_if_unable is Trip.DEAD_END:
                self._trip(seq, Trip.DEAD_END, "the grammar allows no token here and no revision could recover")
                return
            # The model asked to revise, but the grammar dictated every token so far: nothing could go
            # differently. Refuse it at this position and run the step again.
            assert self.revise_id is not None
            seq.revision.ban(len(seq.output_ids), self.revise_id)
        del seq.logprobs[len(seq.output_ids) :]  # the retracted tokens' entries go with them
        # Re-feed the last kept token: its KV position is rewritten with identical values and its
        # logits are exactly those a fresh prefill of the kept tokens would give.
        kept_last = seq.output_ids[-1] if seq.output_ids else seq.prompt_ids[-1]
        seq.num_cached = len(seq.prompt_ids) + len(seq.output_ids) - 1
        seq.pending = [kept_last]
        if seq.stall is not None:
            seq.stall.reset()

    def _choice_probe(self, seq: Sequence) -> ChoiceProbe | None:
        """Whether the grammar, where `seq`'s matcher now stands, allows a token outside `taken` (the
        revision token aside). Runs only when a revision happens, on a bitmask row of its own."""
        matcher = seq.matcher
        if matcher is None:
            return None  # unconstrained: the whole vocabulary is a choice

        def has_choice(taken: set[int]) -> bool:
            matcher.fill_bitmask(self._probe, 0)
            for token in taken | ({self.revise_id} if self.revise_id is not None else set()):
                _set_bit(self._probe, 0, token, on=False)
            return bool(self._probe.any())

        return has_choice

    def _is_whitespace(self, token: int) -> bool:
        cached = self._whitespace.get(token)
        if cached is None:
            text = self._token_text(token)
            cached = self._whitespace[token] = bool(text) and not text.strip()
        return cached

    def _token_text(self, token: int) -> str:
        cached = self._texts.get(token)
        if cached is None:
            cached = self._texts[token] = str(self.tokenizer.decode([token]))
        return cached

    def _emit_text(self, seq: Sequence) -> bool:
        """Decode, cut at a stop string if one appeared, and hand new, no-longer-retractable text to the
        sink. Returns True when a stop string finished the sequence."""
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        stopped = False
        for stop in seq.params.stop:
            found = text.find(stop, max(0, seq.emitted - len(stop)))
            if found != -1:
                text, stopped = text[:found], True
        seq.text = text
        if stopped:
            seq.text_cut = True
            self._finish(seq, "stop")
            return True
        stable = seq.revision.stable_tokens(len(seq.output_ids))
        if stable < len(seq.output_ids):
            safe = len(self.tokenizer.decode(seq.output_ids[:stable], skip_special_tokens=True).rstrip("\ufffd"))
        else:
            safe = len(text.rstrip("\ufffd"))
        safe = min(safe, len(text))
        # Hold back a possible stop-string prefix at the end.
        for stop in seq.params.stop:
            for k in range(min(len(stop) - 1, safe), 0, -1):
                if text[safe - k : safe] == stop[:k]:
                    safe -= k
                    break
        if safe > seq.emitted:
            delta, seq.emitted = text[seq.emitted : safe], safe
            seq.sink(SeqOutput(seq.request_id, delta, False, None, seq, self._logprobs_out(seq, final=False)))
        return False

    def _trip(self, seq: Sequence, kind: Trip, message: str) -> None:
        seq.trip = str(kind)
        seq.error = message
        self.on_trip(str(kind))
        self._finish(seq, str(kind))

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        self.scheduler.finish(seq)
        with self._answer_lock:
            if seq.answered:
                return  # the hung-step watchdog answered it while this step ran
            seq.answered = True
            seq.finish_reason = reason
            seq.stats.finished = time.perf_counter()
            if reason != "abort" and not seq.text_cut:
                seq.text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
            delta = seq.text[seq.emitted :] if reason != "abort" else ""
            seq.emitted = len(seq.text)
            seq.sink(SeqOutput(seq.request_id, delta, True, reason, seq, self._logprobs_out(seq, final=True)))

    def _logprobs_out(self, seq: Sequence, *, final: bool) -> list[TokenLogprob]:
        """The entries not yet sent whose tokens' text is now out in full, and that no revision can take back.
        At the end: all the rest, less those past a stop-string cut (dropped from `seq.logprobs` too)."""
        if not seq.params.logprobs:
            return []
        ids, sent = seq.output_ids, seq.logprobs_sent
        if not final:
            end = tokens_within(self._decode, ids, sent, seq.revision.stable_tokens(len(ids)), seq.emitted)
        elif seq.text_cut:
            end = tokens_reaching(self._decode, ids, sent, len(seq.text))
            del seq.logprobs[end:]
        else:
            end = len(ids)
        seq.logprobs_sent = max(sent, end)
        return seq.logprobs[sent:end]

    def _decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def fail_all(self, message: str, reason: str = "error") -> None:
        """End every live sequence with an error (the loop hit an exception, or it stopped). Engine thread only
        (or once that thread has ended)."""
        for seq in [*self.scheduler.running, *self.scheduler.waiting, *self._take_inbox()]:
            seq.error = message
            self._finish(seq, reason)

    def abandon_all(self, message: str, reason: str) -> None:
        """From another thread while the engine thread is stuck in a step: give every live sequence its final
        answer now, touching no scheduler or cache state (the stuck step may still use them). If the step
        ever returns, the engine drops these sequences (`_reap_answered`) and answers them no second time."""
        for seq in [*_snapshot(lambda: [*self.scheduler.running, *self.scheduler.waiting]), *self._take_inbox()]:
            if not self._answer_lock.acquire(timeout=5):
                log.error("the engine holds its answer lock; %s gets no final answer", seq.request_id)
                continue
            try:
                if seq.answered:
                    continue
                seq.answered = True
                seq.error, seq.finish_reason = message, reason
                seq.stats.finished = time.perf_counter()
                seq.sink(SeqOutput(seq.request_id, "", True, reason, seq))
            finally:
                self._answer_lock.release()

    def _take_inbox(self) -> list[Sequence]:
        """Sequences submitted but never admitted (their aborts are moot once they are answered)."""
        taken: list[Sequence] = []
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return taken
            if kind == "add" and isinstance(item, Sequence):
                taken.append(item)

    def shutdown(self) -> None:
        self._mask_pool.shutdown(wait=False, cancel_futures=True)


class MaskFill(NamedTuple):
    per_row_us: dict[int, float]  # rows filled, each with its share of the fill time
    failed: dict[int, str]  # rows whose grammar engine raised, with the message their request ends with


class _SettledMasks(NamedTuple):
    rows: list[int]  # rows that carry a grammar mask this step
    failed: dict[int, str]  # rows whose fill raised, with their request's error
    overran: set[int]  # rows whose fills overran their time budget too often
    dead_ends: set[int]  # rows whose grammar allows nothing: they back off (revision)
    restricted: dict[int, torch.Tensor]  # rows whose head computes only these token ids

    @property
    def dead(self) -> set[int]:
        """Rows not sampled this step."""
        return set(self.failed) | self.overran | self.dead_ends


_NO_TOKENS = torch.zeros(0, dtype=torch.int64)


def _snapshot(read: Callable[[], list[Sequence]]) -> list[Sequence]:
    """Copy collections another thread may be changing (a deque raises if mutated while copied)."""
    for _ in range(100):
        try:
            return read()
        except RuntimeError:
            time.sleep(0.001)
    return []


def _set_bit(bitmask: torch.Tensor, row: int, token: int, on: bool = True) -> None:
    word, bit = divmod(token, 32)
    current = int(bitmask[row, word].item()) & 0xFFFFFFFF
    value = current | (1 << bit) if on else current & ~(1 << bit)
    bitmask[row, word] = value - (1 << 32) if value >= 1 << 31 else value  # keep it a valid int32


class EngineLoop:
    """Runs `Engine.step()` on a dedicated thread until stopped; sleeps when there is no work."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="corral-engine", daemon=True)
        self.step_started: float | None = None  # monotonic time the current step began, or None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop; every request still in flight gets a final answer (an error), never silence."""
        self._stopped.set()
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        message = "the server stopped before this request finished"
        if self._thread.is_alive():  # stuck in a step: answer without touching its state
            self.engine.abandon_all(message, "error")
        else:
            self.engine.fail_all(message)
        self.engine.shutdown()

    def submit(self, seq: Sequence) -> None:
        self.engine.add_request(seq)
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._wake.set()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopped.is_set():
            if not self.engine.has_work():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            self.step_started = time.monotonic()
            try:
                self.engine.step()
            except Exception as exc:  # the loop must survive anything one batch does
                log.exception("engine step failed")
                self.engine.fail_all(f"internal engine error: {type(exc).__name__}: {exc}")
            finally:
                self.step_started = None
