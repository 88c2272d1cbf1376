"""Request → GrammarSpec, schema profiles, feature scan for routing, post-validation.

Usable as a library: nothing here imports `server`.
"""

from corral.grammars.spec import GrammarKind, GrammarSpec, canonical_json

__all__ = ["GrammarKind", "GrammarSpec", "canonical_json"]
