"""The built-in backends' descriptors: what corral knows about each engine (routing traits, keyword table,
sandbox codec) in a module that imports no engine, so routing and the registry cost nothing at start. The
engines themselves are corral/grammar_engines/xgrammar_backend.py and corral/grammar_engines/llguidance_backend.py,
loaded on first
use."""
