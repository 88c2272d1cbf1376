"""corral's decode loop: add_request / step / abort over a continuously batched set of sequences."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence as Seq
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from samplers.protocol import Matcher, SamplerBackend, allocate_bitmask, apply_bitmask
from server.engine.model_runner import ForwardRow, ModelRunner
from server.engine.sampling import make_generator, sample_rows
from server.engine.scheduler import Scheduler
from server.engine.sequence import SeqOutput, SeqStatus, Sequence
from server.models import LoadedModel

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    max_batch: int = 16
    max_model_len: int = 4096
    jump_forward: bool = True


class Engine:
    """Single-threaded core: only the thread that calls `step()` touches the scheduler and the cache.
    Other threads talk to it through `add_request` / `abort`, which only enqueue."""

    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.loaded = loaded
        self.config = config
        self.max_len = min(config.max_model_len, loaded.context_length)
        self.runner = ModelRunner(loaded, max_batch=config.max_batch, max_len=self.max_len)
        self.scheduler = Scheduler(config.max_batch)
        self.tokenizer = loaded.tokenizer
        self.stop_ids = frozenset(loaded.stop_token_ids)
        self._inbox: queue.SimpleQueue[tuple[str, Sequence | str]] = queue.SimpleQueue()
        self._bitmask = allocate_bitmask(config.max_batch, loaded.vocab_size)
        # Masks are filled on this worker while the forward runs on the engine thread; both the
        # engines' fill calls and torch's kernels release the GIL, so the two really overlap.
        self._mask_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="corral-mask")
        self._ban_stop = torch.tensor(sorted(self.stop_ids), device=loaded.device)

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
        batch = self.scheduler.schedule()
        if not batch:
            return
        now = time.perf_counter()
        for seq in batch:
            seq.stats.scheduled = seq.stats.scheduled or now
        masks = self._start_masks(batch)
        t0 = time.perf_counter()
        logits = self.runner.forward([ForwardRow(s.slot, s.num_cached, s.pending) for s in batch])
        forward_ms = (time.perf_counter() - t0) * 1000
        for seq in batch:
            seq.num_cached += len(seq.pending)
            seq.stats.forward_ms.append(forward_ms)
        self._apply_masks(logits, batch, masks)
        tokens = sample_rows(logits, [s.params for s in batch], [s.generator for s in batch])
        for seq, token in zip(batch, tokens, strict=True):
            self._advance(seq, token)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "add" and isinstance(item, Sequence):
                item.generator = make_generator(item.params, self.loaded.device)
                self.scheduler.add(item)
            elif kind == "abort" and isinstance(item, str):
                seq = self.scheduler.find(item)
                if seq is not None:
                    self._finish(seq, "abort")

    def _start_masks(self, batch: list[Sequence]) -> Future[dict[int, float]] | None:
        groups: dict[int, tuple[SamplerBackend, list[Matcher], list[int]]] = {}
        for row, seq in enumerate(batch):
            if seq.matcher is not None and seq.backend is not None:
                entry = groups.setdefault(id(seq.backend), (seq.backend, [], []))
                entry[1].append(seq.matcher)
                entry[2].append(row)
        if not groups:
            return None
        return self._mask_pool.submit(self._fill_masks, list(groups.values()))

    def _fill_masks(self, groups: list[tuple[SamplerBackend, list[Matcher], list[int]]]) -> dict[int, float]:
        """Fill each backend's rows in one batched call; returns µs per row (the group's time / rows)."""
        per_row: dict[int, float] = {}
        for backend, matchers, rows in groups:
            t0 = time.perf_counter()
            backend.fill_bitmasks(matchers, self._bitmask, rows)
            each = (time.perf_counter() - t0) * 1e6 / len(rows)
            per_row.update(dict.fromkeys(rows, each))
        return per_row

    def _apply_masks(self, logits: torch.Tensor, batch: list[Sequence], masks: Future[dict[int, float]] | None) -> None:
        free_rows = [i for i, s in enumerate(batch) if s.matcher is None and s.params.ignore_eos]
        if free_rows:
            logits[torch.tensor(free_rows)[:, None], self._ban_stop[None, :]] = float("-inf")
        if masks is None:
            return
        per_row = masks.result()
        rows = sorted(per_row)
        apply_bitmask(logits, self._bitmask[: len(batch)], rows)
        for row in rows:
            batch[row].stats.mask_us.append(per_row[row])

    def _advance(self, seq: Sequence, token: int) -> None:
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
        seq.output_ids.append(token)
        seq.stats.sampled_tokens += 1
        seq.pending = [token]
        if matcher is not None and self.config.jump_forward and not matcher.is_terminated():
            room = seq.params.max_tokens - len(seq.output_ids)
            forced = [t for t in matcher.forced_tokens()[:room] if t not in self.stop_ids]
            accepted = 0
            for t in forced:
                if not matcher.accept_token(t):
                    break
                accepted += 1
            seq.output_ids.extend(forced[:accepted])
            seq.pending.extend(forced[:accepted])
            seq.stats.forced_tokens += accepted
        if self._emit_text(seq):
            return
        if matcher is not None and matcher.is_terminated():
            self._finish(seq, "stop")
        elif len(seq.output_ids) >= seq.params.max_tokens or seq.num_cached + len(seq.pending) >= self.max_len:
            self._finish(seq, "length")

    def _emit_text(self, seq: Sequence) -> bool:
        """Decode, cut at a stop string if one appeared, and hand new text to the sink.
        Returns True when a stop string finished the sequence."""
        text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        stopped = False
        for stop in seq.params.stop:
            # Only the fresh tail can hold a new match; earlier text was already checked.
            found = text.find(stop, max(0, seq.emitted - len(stop)))
            if found != -1:
                text, stopped = text[:found], True
        seq.text = text
        if stopped:
            self._finish(seq, "stop")
            return True
        # Hold back a trailing partial UTF-8 character and a possible stop-string prefix.
        safe = len(text.rstrip("\ufffd"))
        for stop in seq.params.stop:
            for k in range(min(len(stop) - 1, safe), 0, -1):
                if text[safe - k : safe] == stop[:k]:
                    safe -= k
                    break
        if safe > seq.emitted:
            delta, seq.emitted = text[seq.emitted : safe], safe
            seq.sink(SeqOutput(seq.request_id, delta, False, None, seq))
        return False

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.is_finished:
            return
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        seq.stats.finished = time.perf_counter()
        delta = seq.text[seq.emitted :] if reason != "abort" else ""
        seq.emitted = len(seq.text)
        seq.sink(SeqOutput(seq.request_id, delta, True, reason, seq))

    def fail_all(self, message: str) -> None:
        """End every live sequence with an error (the loop hit an unexpected exception)."""
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            seq.error = message
            self._finish(seq, "error")

    def shutdown(self) -> None:
        self._mask_pool.shutdown(wait=False, cancel_futures=True)


class EngineLoop:
    """Runs `Engine.step()` on a dedicated thread until stopped; sleeps when there is no work."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="corral-engine", daemon=True)
        self.last_step_started: float | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        self._wake.set()
        self._thread.join(timeout=10)
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
            self.last_step_started = time.monotonic()
            try:
                self.engine.step()
            except Exception as exc:  # the loop must survive anything one batch does
                log.exception("engine step failed")
                self.engine.fail_all(f"internal engine error: {type(exc).__name__}: {exc}")
            finally:
                self.last_step_started = None


def running_sequences(engine: Engine) -> Seq[Sequence]:
    return [s for s in engine.scheduler.running if s.status is SeqStatus.RUNNING]
