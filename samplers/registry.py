"""Backend registry: built-ins imported lazily, third-party backends through an entry-point group."""

from __future__ import annotations

import importlib
import logging
import threading
from collections.abc import Callable
from importlib.metadata import entry_points

from samplers.contract_guard import ContractGuard
from samplers.protocol import SamplerBackend, TokenizerSpec

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "corral.sampler_backends"
AUTO = "auto"

BackendFactory = Callable[[TokenizerSpec], SamplerBackend]

# name -> "module:attribute"; imported only when first used (xgrammar pulls in triton, for instance).
_BUILTIN: dict[str, str] = {
    "xgrammar": "samplers.xgrammar_backend:XGrammarBackend",
    "llguidance": "samplers.llguidance_backend:LLGuidanceBackend",
}
_registered: dict[str, BackendFactory] = {}
_lock = threading.Lock()


class UnknownBackend(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown backend {name!r}; available: {', '.join([AUTO, *backend_names()])}")
        self.name = name


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make `factory` available as backend `name` (overrides a built-in of the same name)."""
    if not name or name == AUTO:
        raise ValueError(f"backend name {name!r} is reserved or empty")
    with _lock:
        _registered[name] = factory


def _entry_point_factories() -> dict[str, str]:
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def backend_names() -> list[str]:
    names = list(_BUILTIN)
    names += [n for n in _entry_point_factories() if n not in names]
    names += [n for n in _registered if n not in names]
    return names


def _load(target: str) -> BackendFactory:
    module_name, _, attribute = target.partition(":")
    factory: BackendFactory = getattr(importlib.import_module(module_name), attribute)
    return factory


def resolve_factory(name: str) -> BackendFactory:
    with _lock:
        if name in _registered:
            return _registered[name]
    target = _BUILTIN.get(name) or _entry_point_factories().get(name)
    if target is None:
        raise UnknownBackend(name)
    return _load(target)


class BackendSet:
    """The backends for one tokenizer, instantiated on first use and shared by every request."""

    def __init__(self, tokenizer: TokenizerSpec, enabled: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.enabled = enabled or backend_names()
        self._instances: dict[str, SamplerBackend] = {}
        self._guarded: dict[str, SamplerBackend] = {}
        self._lock = threading.Lock()

    def check_name(self, name: str) -> None:
        if name != AUTO and name not in self.enabled:
            raise UnknownBackend(name)

    def get(self, name: str) -> SamplerBackend:
        self.check_name(name)
        with self._lock:
            backend = self._instances.get(name)
            if backend is None:
                log.info("initialising grammar backend %s", name)
                backend = resolve_factory(name)(self.tokenizer)
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
