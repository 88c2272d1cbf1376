"""The integer screens in front of the fp16 head (fbgemm's for several rows, ggml's blocks for one): their bounds
hold, a screened greedy row picks what the fp16 head picks (under any mask), and the engine's greedy answers are
the same with and without them (corral/kernels/head_screen.py, block_screen.py, screens.py)."""

from __future__ import annotations

import pytest
import torch
from conftest import run_until_done

from corral.grammar_engines.compilation import GrammarCache
from corral.grammar_engines.protocol import TokenizerSpec
from corral.grammar_engines.registry import BackendSet
from corral.grammars.spec import GrammarSpec
from corral.kernels import head_screen
from corral.kernels.block_screen import BlockScreen, block_screen_available, q8_0_blocks
from corral.kernels.head_screen import HeadScreen, Screen, exact_product, screen_rows, settle_screened
from corral.kernels.quantized_projection import fbgemm_available
from corral.server.engine import Engine, EngineConfig, SamplingParams, Sequence
from corral.server.models import load_model

pytestmark = pytest.mark.skipif(not fbgemm_available(), reason="the screens run beside fbgemm (x86 torch only)")

VOCAB, WIDTH, OUTLIERS = 3000, 64, torch.tensor([3, 17, 40])
SCREENS = [
    pytest.param("several", marks=pytest.mark.skipif(
        not fbgemm_available() or not exact_product(WIDTH),
        reason="fbgemm's 8-bit integer sums are not exact on this CPU (AVX2): no screen for several rows here")),
    pytest.param("one", marks=pytest.mark.skipif(
        not block_screen_available(WIDTH), reason="the one-row screen multiplies with ggml (the `ggml` extra)")),
]


def make_screen(kind: str, weight: torch.Tensor) -> Screen:
    return HeadScreen(weight, OUTLIERS) if kind == "several" else BlockScreen(weight)


def batches(kind: str, x: torch.Tensor) -> list[torch.Tensor]:
    """x as the screen takes it: all rows at once, or one at a time."""
    return [x] if kind == "several" else [x[i : i + 1] for i in range(len(x))]


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


@pytest.mark.parametrize("kind", SCREENS)
def test_every_screened_logit_is_within_its_bound(weight: torch.Tensor, kind: str) -> None:
    screen = make_screen(kind, weight)
    x = hidden_states(torch.Generator().manual_seed(1), 8)
    parts = [screen.logits(part) for part in batches(kind, x)]
    screened, input_norms, error_norms = (torch.cat([p[i] for p in parts]) for i in range(3))
    exact = ExactHead(weight)(x)
    for row in range(len(x)):
        bounds = (screen.error_norms * input_norms[row] + screen.rounded_norms * error_norms[row]
                  + screen.slack(x[row].abs().sum()))
        assert bool(((screened[row] - exact[row]).abs() <= bounds).all())
    # The screen alone is not exact (else it would prove nothing): its own picks differ somewhere.
    assert not torch.equal(screened.argmax(dim=1), exact.argmax(dim=1)) or (screened - exact).abs().max() > 1e-3


def test_the_one_row_screens_blocks_are_ggmls_q8_0() -> None:
    """The bytes handed to ggml dequantize, by the gguf package's own reader, to the values the bounds assume."""
    gguf = pytest.importorskip("gguf")
    values = hidden_states(torch.Generator().manual_seed(5), 4)
    values[0, :32] = 0.0  # a block of zeros: step 0
    values[1, :32] *= 1e-7  # a step fp16 cannot hold
    raw, rounded = q8_0_blocks(values)
    read = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(torch.from_numpy(read).float().reshape(values.shape), rounded)
    assert float((values - rounded).abs().max()) <= float(values.abs().max()) / 127


def _picks(kind: str, screen: Screen, head: ExactHead, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """The screened rows' greedy picks under masks `allowed` [R, V]."""
    picks = []
    for part, mask in zip(batches(kind, x), batches(kind, allowed), strict=True):
        rows = list(range(len(part)))
        logits = torch.full((len(part), VOCAB), float("-inf"))
        screened = screen_rows(screen, part, rows, logits)
        logits.masked_fill_(~mask, float("-inf"))
        settle_screened(head, logits, part, screened, rows)
        picks.append(logits.argmax(dim=1))
    return torch.cat(picks)


@pytest.mark.parametrize("kind", SCREENS)
@pytest.mark.parametrize("alike", [False, True])
def test_a_screened_row_picks_the_fp16_heads_best_allowed_token(
    weight: torch.Tensor, close_weight: torch.Tensor, alike: bool, kind: str
) -> None:
    w = close_weight if alike else weight
    screen, head = make_screen(kind, w), ExactHead(w)
    generator = torch.Generator().manual_seed(2)
    for _ in range(40):
        x = hidden_states(generator, 8)
        # Masks of every density, from a handful of tokens to all of them.
        allowed = torch.rand(8, VOCAB, generator=generator) < torch.rand(8, 1, generator=generator)
        allowed[:, 0] = True
        want = head(x).masked_fill(~allowed, float("-inf")).argmax(dim=1)
        assert torch.equal(_picks(kind, screen, head, x, allowed), want)


@pytest.mark.parametrize("kind", SCREENS)
def test_without_its_bounds_the_screen_picks_wrong_tokens(
    close_weight: torch.Tensor, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The bounds are what makes the picks exact: with them zeroed the screen's own coarse picks come through."""
    monkeypatch.setattr(head_screen, "_SLACK_ABS", 0.0)
    screen, head = make_screen(kind, close_weight), ExactHead(close_weight)
    screen.rounding_per_l1 = 0.0
    screen.error_norms.zero_()
    screen.rounded_norms.zero_()
    generator = torch.Generator().manual_seed(3)
    wrong = 0
    for _ in range(40):
        x = hidden_states(generator, 8)
        allowed = torch.ones(8, VOCAB, dtype=torch.bool)
        wrong += int((_picks(kind, screen, head, x, allowed) != head(x).argmax(dim=1)).sum())
    assert wrong > 0


def _greedy_answers(screen: str, together: bool) -> tuple[list[str], bool]:
    """Four requests' greedy answers, run together (steps of several rows) or one after another (of one)."""
    loaded = load_model("corral-tiny", device="cpu", quantization="fp16", head_screen=screen != "off")
    model = loaded.model
    screens = getattr(model, "screens", None)
    used = screens is not None and screens.for_rows(1 if not together else 2) is not None
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
        seqs.append(seq)
    for group in [seqs] if together else [[seq] for seq in seqs]:
        for seq in group:
            engine.add_request(seq)
        run_until_done(engine, group, max_steps=200)
    return [s.text for s in seqs], used


@pytest.mark.parametrize("kind", SCREENS)
def test_greedy_answers_are_the_same_with_and_without_the_screen(monkeypatch: pytest.MonkeyPatch, kind: str) -> None:
    together = kind == "several"
    screened, used = _greedy_answers("on", together)
    plain, unused = _greedy_answers("off", together)
    assert used and not unused
    assert screened == plain
