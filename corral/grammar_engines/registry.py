"""Backend registry: every backend is a BackendDescriptor (corral/grammar_engines/protocol.py) under a name. The
built-ins'
descriptors (corral/grammar_engines/backends/) are imported when first asked for; third-party backends come through the
`corral.sampler_backends` entry-point group (an entry point names a descriptor, or a bare factory) or
`register_backend`. Importing this module installs `backend_traits` as the grammars layer's traits lookup,
so `auto` routing and the keyword report (corral/grammars/features.py, corral/grammars/enforcement.py) read what each
backend declares without the grammars layer naming any engine."""

from __future__ import annotations

import logging
import threading
from importlib.metadata import entry_points

from corral.grammar_engines.contract_guard import ContractGuard
from corral.grammar_engines.protocol import BackendDescriptor, BackendFactory, Lazy, SamplerBackend, TokenizerSpec
from corral.grammars.features import BackendTraits, use_traits

__all__ = [
    "AUTO", "ENTRY_POINT_GROUP", "BackendFactory", "BackendSet", "UnknownBackend", "backend_names",
    "backend_traits", "descriptor", "find_descriptor", "register_backend", "resolve_factory",
]

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "corral.sampler_backends"
AUTO = "auto"

# name -> "module:attribute" of its descriptor (light modules; the engines load on first use).
_BUILTIN: dict[str, str] = {
    "xgrammar": "corral.grammar_engines.backends.xgrammar:DESCRIPTOR",
    "llguidance": "corral.grammar_engines.backends.llguidance:DESCRIPTOR",
}
_registered: dict[str, BackendFactory | BackendDescriptor] = {}
_lock = threading.Lock()


class UnknownBackend(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown backend {name!r}; available: {', '.join([AUTO, *backend_names()])}")
        self.name = name


def register_backend(
    name: str, factory: BackendFactory | BackendDescriptor, *, traits: BackendTraits | None = None
) -> None:
    """Make a backend available as `name` (overrides a built-in or entry point of the same name): a
    BackendDescriptor, or a bare factory with `traits` (default: neutral ones) and no codec, so it compiles
    in the caller's thread. A codec needs a descriptor whose parts a compile worker can import."""
    if not name or name == AUTO:
        raise ValueError(f"backend name {name!r} is reserved or empty")
    entry = _as_descriptor(factory)
    if traits is not None:
        entry = BackendDescriptor(entry.factory, traits, entry.codec)
    with _lock:
        _registered[name] = entry


def _entry_point_targets() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_names() -> list[str]:
    names = list(_BUILTIN)
    names += [n for n in _entry_point_targets() if n not in names]
    names += [n for n in _registered if n not in names]
    return names


def _as_descriptor(entry: object) -> BackendDescriptor:
    if isinstance(entry, BackendDescriptor):
        return entry
    if callable(entry):
        return BackendDescriptor(entry)
    raise TypeError(f"a backend is a BackendDescriptor or a factory, not {type(entry).__name__}")


def find_descriptor(name: str) -> BackendDescriptor | None:
    """`name`'s descriptor: registered, built in, or from an entry point (imported now); None if unknown."""
    with _lock:
        entry = _registered.get(name)
    if entry is not None:
        return _as_descriptor(entry)
    target = _BUILTIN.get(name) or _entry_point_targets().get(name)
    return None if target is None else _as_descriptor(Lazy(target).load())


def descriptor(name: str) -> BackendDescriptor:
    found = find_descriptor(name)
    if found is None:
        raise UnknownBackend(name)
    return found


def resolve_factory(name: str) -> BackendFactory:
    return descriptor(name).factory


def backend_traits(name: str) -> BackendTraits:
    """What `name` declares of itself; neutral traits for a name nothing registers (a test double)."""
    found = find_descriptor(name)
    return found.traits if found is not None else BackendTraits()


use_traits(backend_traits)


class BackendSet:
    """The backends for one tokenizer, instantiated on first use and shared by every request."""

    def __init__(self, tokenizer: TokenizerSpec, enabled: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.enabled = enabled or backend_names()
        self._instances: dict[str, SamplerBackend] = {}
        self._guarded: dict[str, SamplerBackend] = {}
        self._traits: dict[str, BackendTraits] = {}
        self._lock = threading.Lock()

    def check_name(self, name: str) -> None:
        if name != AUTO and name not in self.enabled:
            raise UnknownBackend(name)

    def traits(self, name: str) -> BackendTraits:
        """`name`'s traits, looked up once per set (an entry point's lookup scans the installed packages)."""
        found = self._traits.get(name)
        if found is None:
            found = self._traits[name] = backend_traits(name)
        return found

    def get(self, name: str) -> SamplerBackend:
        self.check_name(name)
        with self._lock:
            backend = self._instances.get(name)
            if backend is None:
                log.info("initialising grammar backend %s", name)
                backend = descriptor(name).factory(self.tokenizer)
                self._instances[name] = backend
            return backend

    def for_request(self, routed: str, requested: str) -> SamplerBackend:
        """The backend that serves a request compiled by `routed`: under `auto`, wrapped in the contract
        guard (an answer can only end when the full schema holds); a named backend as it is."""
        backend = self.get(routed)
        if requested != AUTO:
            return backend
        with self._lock:
            guarded = self._guarded.get(routed)
            if guarded is None:
                guarded = self._guarded[routed] = ContractGuard(backend, self.tokenizer)
            return guarded

    def warm_up(self) -> None:
        for name in self.enabled:
            self.get(name)
