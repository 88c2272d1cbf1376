"""The built-in backends' descriptors: what corral knows about each engine (routing traits, keyword table,
sandbox codec) in a module that imports no engine, so routing and the registry cost nothing at start. The
engines themselves are corral/samplers/xgrammar_backend.py and corral/samplers/llguidance_backend.py, loaded on first
use."""
