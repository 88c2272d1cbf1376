"""The structured-output wing: everything the engine does so that an answer keeps its constraint's shape.

- `stage.py` — per step: start the grammar masks, settle and judge them, apply them (`StructuredOutput`);
- `lazy_masks.py` — which greedy rows may pick before their mask and be checked after;
- `grammar_tokens.py` — the tokens the grammar writes (jump-forward) and the completions that close an answer;
- `answer_closing.py`, `closing.py`, `json_syntax.py`, `pattern_texts.py` — closing an answer within budget;
- `revision.py`, `watchdog.py`, `rows.py` — taking back a step, the stall and mask-budget watchdog, a row's
  structured life from admission on.

The grammar engines it drives (backends, compilation, the sandbox) are `corral.grammar_engines`.
Modules outside this wing import what it offers from `corral.structured` alone (`__all__`; the architecture test
checks it). The names load on first use: the engine's `Sequence` carries the wing's per-row state and the stage
reads sequences, so an eager import here would go round in a circle.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from corral.structured.answer_closing import AnswerCloser
    from corral.structured.closing import ClosingVocabulary, required_keys
    from corral.structured.grammar_tokens import GrammarTokens
    from corral.structured.lazy_masks import LazyMaskState
    from corral.structured.pattern_texts import pattern_examples
    from corral.structured.revision import RevisionTracker
    from corral.structured.rows import admit, observe, take_back
    from corral.structured.stage import MaskFill, SettledMasks, StructuredOutput, set_bit
    from corral.structured.watchdog import MaskBudget, StallDetector, Trip, WatchdogLimits

_HOMES = {
    "AnswerCloser": "answer_closing",
    "ClosingVocabulary": "closing",
    "required_keys": "closing",
    "GrammarTokens": "grammar_tokens",
    "LazyMaskState": "lazy_masks",
    "pattern_examples": "pattern_texts",
    "RevisionTracker": "revision",
    "admit": "rows",
    "observe": "rows",
    "take_back": "rows",
    "MaskFill": "stage",
    "SettledMasks": "stage",
    "StructuredOutput": "stage",
    "set_bit": "stage",
    "MaskBudget": "watchdog",
    "StallDetector": "watchdog",
    "Trip": "watchdog",
    "WatchdogLimits": "watchdog",
}
__all__ = [
    "AnswerCloser",
    "ClosingVocabulary",
    "GrammarTokens",
    "LazyMaskState",
    "MaskBudget",
    "MaskFill",
    "RevisionTracker",
    "SettledMasks",
    "StallDetector",
    "StructuredOutput",
    "Trip",
    "WatchdogLimits",
    "admit",
    "observe",
    "pattern_examples",
    "required_keys",
    "set_bit",
    "take_back",
]
assert sorted(_HOMES) == __all__


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{home}"), name)
    globals()[name] = value  # once loaded, a plain module attribute
    return value
