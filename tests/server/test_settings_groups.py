"""Settings by concern: every setting sits in one group, `corral serve --help` lists them by group, and each
component's options dataclass is built from the settings of the same names, with the same defaults."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from typing import Any

import pytest

from corral.grammar_engines.compilation import CompileOptions, GrammarCache
from corral.grammars.limits import InputLimits
from corral.server.engine import EngineConfig
from corral.server.models import ModelOptions
from corral.server.settings import GROUPS, Settings
from corral.structured.watchdog import WatchdogLimits

OPTIONS: list[type[Any]] = [ModelOptions, EngineConfig, WatchdogLimits, CompileOptions, InputLimits]


def test_every_setting_is_in_exactly_one_group() -> None:
    grouped = [name for names in GROUPS.values() for name in names]
    assert sorted(grouped) == sorted(Settings.model_fields)


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: o.__name__)
def test_options_default_as_the_settings_of_the_same_names(options: type[Any]) -> None:
    shared = [f.name for f in dataclasses.fields(options) if f.name in Settings.model_fields]
    assert shared, f"{options.__name__} shares no field with Settings"
    defaults = options(**_not_settings(options))
    for name in shared:  # the declared defaults (the environment, e.g. CORRAL_MODEL in tests, aside)
        assert getattr(defaults, name) == Settings.model_fields[name].default, name


def test_a_changed_setting_reaches_its_component() -> None:
    settings = Settings(max_batch=3, stall_repeat_tokens=9, max_tools=2, model_impl="transformers")
    config = settings.group(EngineConfig, limits=settings.group(WatchdogLimits))
    assert config.max_batch == 3 and config.limits.stall_repeat_tokens == 9
    assert settings.input_limits().max_tools == 2
    assert settings.group(ModelOptions).model_impl == "transformers"


def test_compile_settings_reach_the_grammar_cache(tokenizer: Any) -> None:
    from corral.grammar_engines.registry import BackendSet

    settings = Settings(compile_timeout_s=3.5, compile_isolate=False, compile_timeout_retry_s=42.0)
    cache = GrammarCache.from_options(BackendSet(tokenizer), settings.group(CompileOptions))
    assert (cache.compile_timeout_s, cache.timeout_retry_s, cache.sandbox) == (3.5, 42.0, None)


def test_serve_help_lists_settings_by_group() -> None:
    out = subprocess.run([sys.executable, "-m", "corral.server.cli", "serve", "--help"], capture_output=True, text=True,
                         check=True).stdout
    positions = [out.index(f"{group} settings:") for group in GROUPS]
    assert positions == sorted(positions)
    # A flag's help line sits under its own group's heading (the usage line above names every flag too).
    engine, compile_ = out.index("engine settings:"), out.index("compile settings:")
    assert engine < out.index("\n  --max-batch") < compile_
    assert out.index("\n  --max-tools") > out.index("limits settings:")


def _not_settings(options: type[Any]) -> dict[str, Any]:
    """Fields a component's options hold that are no setting and have no default."""
    return {
        f.name: None
        for f in dataclasses.fields(options)
        if f.name not in Settings.model_fields
        and f.default is dataclasses.MISSING
        and f.default_factory is dataclasses.MISSING
    }
