"""The integer screen in front of the fp16 head: its bounds hold, a screened greedy row picks what the fp16 head
picks (under any mask), and the engine's greedy answers are the same with and without it
(server/models/head_screen.py)."""

from __future__ import annotations

import pytest
import torch

from grammars.spec import GrammarSpec
from samplers.compilation import GrammarCache
from samplers.protocol import TokenizerSpec
from samplers.registry import BackendSet
from server.engine import Engine, EngineConfig, SamplingParams, Sequence
from server.models import head_screen, load_model
from server.models.head_screen import SWITCH_ENV, HeadScreen, screen_rows, settle_screened
from server.models.quantized_projection import fbgemm_available

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="the screen multiplies with fbgemm (x86 torch only)")

VOCAB, WIDTH, OUTLIERS = 3000, 64, torch.tensor([3, 17, 40])


class ExactHead:
    """The fp16 head's values, in float32: full rows and single outputs."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight.half().float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() @ self.weight.t()

    def select(self, x: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
        return (x.float()[rows] * self.weight[columns]).sum(-1)


def hidden_states(generator: torch.Generator, rows: int) -> torch.Tensor:
    """Inputs shaped like a decoder's final states: a few dimensions far larger than the rest."""
    x = torch.randn(rows, WIDTH, generator=generator)
    x[:, OUTLIERS] *= 40.0
    x[:, 9] *= 6.0  # a large dimension the screen was not told about
    return x


@pytest.fixture(scope="module")
def weight() -> torch.Tensor:
    return torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(0)) * 0.05


@pytest.fixture(scope="module")
def close_weight() -> torch.Tensor:
    """Rows so alike that many tokens' logits lie closer together than the integer product's error."""
    generator = torch.Generator().manual_seed(4)
    base = torch.randn(1, WIDTH, generator=generator) * 0.05
    return base + torch.randn(VOCAB, WIDTH, generator=generator) * 0.002


def test_every_screened_logit_is_within_its_bound(weight: torch.Tensor) -> None:
    screen = HeadScreen(weight, OUTLIERS)
    x = hidden_states(torch.Generator().manual_seed(1), 8)
    screened, input_norms, error_norms = screen.logits(x)
    exact = ExactHead(weight)(x)
    for row in range(len(x)):
        bounds = screen.bounds(float(input_norms[row]), float(error_norms[row]), float(x[row].abs().sum()))
        assert bool(((screened[row] - exact[row]).abs() <= bounds).all())
    # The screen alone is not exact (else it would prove nothing): its own picks differ somewhere.
    assert not torch.equal(screened.argmax(dim=1), exact.argmax(dim=1)) or (screened - exact).abs().max() > 1e-3


def _picks(screen: HeadScreen, head: ExactHead, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The screened rows' greedy picks under masks `allowed` [R, V]."""
    rows = list(range(len(x)))
    logits = torch.full((len(x), VOCAB), float("-inf"))
    screened = screen_rows(screen, x, rows, logits)
    logits.masked_fill_(~allowed, float("-inf"))
    settle_screened(screen, head, logits, x, screened, rows)
    return logits.argmax(dim=1)


@pytest.mark.parametrize("alike", [False, True])
def test_a_screened_row_picks_the_fp16_heads_best_allowed_token(
    weight: torch.Tensor, close_weight: torch.Tensor, alike: bool
) -> None:
    w = close_weight if alike else weight
    screen, head = HeadScreen(w, OUTLIERS), ExactHead(w)
    generator = torch.Generator().manual_seed(2)
    for _ in range(40):
        x = hidden_states(generator, 8)
        # Masks of every density, from a handful of tokens to all of them.
        allowed = torch.rand(8, VOCAB, generator=generator) < torch.rand(8, 1, generator=generator)
        allowed[:, 0] = True
        want = head(x).masked_fill(~allowed, float("-inf")).argmax(dim=1)
        assert torch.equal(_picks(screen, head, x, allowed), want)


def test_without_its_bounds_the_screen_picks_wrong_tokens(
    close_weight: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bounds are what makes the picks exact: with them zeroed the screen's own coarse picks come through."""
    monkeypatch.setattr(head_screen, "_SLACK_ABS", 0.0)
    screen, head = HeadScreen(close_weight, OUTLIERS), ExactHead(close_weight)
    screen.rounding_per_l1 = 0.0
    screen.error_norms.zero_()
    screen.rounded_norms.zero_()
    generator = torch.Generator().manual_seed(3)
    wrong = 0
    for _ in range(40):
        x = hidden_states(generator, 8)
        allowed = torch.ones(8, VOCAB, dtype=torch.bool)
        wrong += int((_picks(screen, head, x, allowed) != head(x).argmax(dim=1)).sum())
    assert wrong > 0


def _greedy_answers(monkeypatch: pytest.MonkeyPatch, screen: str) -> tuple[list[str], bool]:
    monkeypatch.setenv(SWITCH_ENV, screen)
    loaded = load_model("corral-tiny", device="cpu", quantization="fp16")
    model = loaded.model
    used = getattr(model, "screen", None) is not None
    cache = GrammarCache(BackendSet(TokenizerSpec(loaded.tokenizer, loaded.vocab_size, loaded.stop_token_ids)))
    engine = Engine(loaded, EngineConfig(max_batch=4, max_model_len=256))
    specs: list[GrammarSpec | None] = [None, GrammarSpec.regex(r"[a-z ]{10,30}"), None,
                                       GrammarSpec.json_schema({"type": "object", "required": ["a"],
                                                                "properties": {"a": {"type": "string"}}})]
    seqs = []
    for i, spec in enumerate(specs):
        prompt = loaded.tokenizer.encode(f"Item {i}:", add_special_tokens=True)
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=spec is None)
        matcher = backend = None
        if spec is not None:
            compiled = cache.compile(spec, "llguidance")
            backend = cache.backends.get(compiled.backend)
            matcher = backend.new_matcher(compiled.compiled)
        seq = Sequence(request_id=f"screen-{i}", prompt_ids=list(prompt), params=params, sink=lambda out: None,
                       matcher=matcher, backend=backend)
        engine.add_request(seq)
        seqs.append(seq)
    for _ in range(200):
        if all(s.is_finished for s in seqs):
            break
        engine.step()
    assert all(s.is_finished for s in seqs)
    return [s.text for s in seqs], used


def test_greedy_answers_are_the_same_with_and_without_the_screen(monkeypatch: pytest.MonkeyPatch) -> None:
    screened, used = _greedy_answers(monkeypatch, "on")
    plain, unused = _greedy_answers(monkeypatch, "off")
    assert used and not unused
    assert screened == plain
