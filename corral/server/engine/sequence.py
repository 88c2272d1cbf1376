"""A Sequence is plain state: one request's tokens, grammar matcher, sampling parameters and timings."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

import torch

from corral.grammar_engines.protocol import CompiledGrammar, Matcher, SamplerBackend
from corral.server.engine.drafting import Draft, DraftCounts, NgramIndex
from corral.server.engine.logprobs import TokenLogprob
from corral.server.engine.sampling import SamplingParams
from corral.structured import AnswerCloser, LazyMaskState, MaskBudget, RevisionTracker, StallDetector


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SeqStats:
    arrival: float = field(default_factory=time.perf_counter)
    scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per step that produced tokens
    mask_us: list[float] = field(default_factory=list)
    forward_ms: list[float] = field(default_factory=list)
    forced_tokens: int = 0
    closing_tokens: int = 0  # the grammar's completion that closed the answer early, if it was
    sampled_tokens: int = 0
    stop_sampled: bool = False  # the answer ended on a sampled stop token (a step that added no output token)


@dataclass
class SeqOutput:
    """What the engine tells the request's owner after a step: new text, and the end if it came."""

    request_id: str
    delta: str
    finished: bool
    finish_reason: str | None
    seq: Sequence
    logprobs: list[TokenLogprob] = field(default_factory=list)  # entries of the tokens `delta` completes


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[SeqOutput], None]
    matcher: Matcher | None = None
    backend: SamplerBackend | None = None
    # The compiled grammar `matcher` came from (shared by every request of that grammar): what the engine keys
    # per-grammar results on. None: unconstrained, or a caller that built the matcher itself.
    grammar: CompiledGrammar | None = None
    output_ids: list[int] = field(default_factory=list)
    # Tokens to feed at the next forward: the prompt first, then each sampled token plus forced ones.
    pending: list[int] = field(default_factory=list)
    num_cached: int = 0  # positions already written to this sequence's KV slot
    slot: int = -1
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None
    generator: torch.Generator | None = None
    streaming: bool = True  # False: only the final output is needed, so text is decoded once, at the end
    text: str = ""  # decoded output so far (after stop-string truncation)
    text_cut: bool = False  # a stop string truncated `text`; it must not be re-decoded
    emitted: int = 0  # characters of `text` already handed to the sink
    # With params.logprobs: one entry per output token (revisions drop theirs; a stop string cut drops those
    # past the cut at the end); `logprobs_sent` of them have gone to the sink.
    logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs_sent: int = 0
    stats: SeqStats = field(default_factory=SeqStats)
    # Set by the engine when the sequence is admitted (they depend on engine-wide settings).
    revision: RevisionTracker = field(default_factory=lambda: RevisionTracker(0))
    stall: StallDetector | None = None
    mask_budget: MaskBudget | None = None
    lazy_mask: LazyMaskState = field(default_factory=LazyMaskState)  # whether its step may skip the mask fill
    trip: str | None = None  # the watchdog kind that ended this sequence, if any
    # Its grammar engine failed it (`error`: a mask fill raised, or a token its mask allowed was refused).
    grammar_failed: bool = False
    closable: bool = False  # a structured answer the engine may close early (corral/structured/answer_closing.py)
    required_keys: frozenset[str] = frozenset()  # property names its schema requires (closing writes those)
    pattern_examples: tuple[str, ...] = ()  # texts its schema's patterns match (closing writes those in strings)
    closer: AnswerCloser | None = None  # set at admission for a closable sequence
    # Speculative decoding (corral/server/engine/speculation.py): this step's draft, the draft it looked up but did
    # not feed (its shadow, scored against the answer as the answer follows or leaves it), the n-grams it is looked
    # up in, and how its drafts fared.
    draft: Draft | None = None
    shadow: Draft | None = None
    ngrams: NgramIndex | None = None
    drafting: DraftCounts = field(default_factory=DraftCounts)
    # The final output went to the sink (set under Engine's answer lock: the engine thread and the hung-step
    # watchdog may both try to end it; only the first answers).
    answered: bool = False

    def __post_init__(self) -> None:
        if not self.pending:
            self.pending = list(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
