"""`corral` console script: `corral serve` starts the server; `corral bench ...` runs benchmarks."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic.fields import FieldInfo

from corral.server.settings import GROUPS, Settings

REPEATABLE = {"api_key": "KEY", "cors_allow_origin": "ORIGIN"}  # flag name -> metavar


def _serve_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible server",
        description="Start the server. Every flag can also be set as an environment variable CORRAL_<FLAG> "
        "(e.g. CORRAL_PORT=9000); a flag on the command line wins.",
    )
    fields = Settings.model_fields
    for group, names in GROUPS.items():
        section = p.add_argument_group(f"{group} settings")
        for name in names:
            _add_setting(section, name, fields[name])


def _add_setting(p: argparse._ArgumentGroup, name: str, info: FieldInfo) -> None:
    flag = "--" + name.replace("_", "-")
    help_text = f"{info.description or name} (env CORRAL_{name.upper()})"
    if info.annotation is bool:
        p.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None, help=help_text)
    elif name == "model":
        p.add_argument(flag, dest=name, default=None, metavar="NAME|DIR|FILE.gguf", help=help_text)
    elif name == "chat_template":
        p.add_argument(flag, dest=name, type=Path, default=None, metavar="FILE", help=help_text)
    elif name == "device":
        p.add_argument(flag, dest=name, choices=["cpu", "cuda"], default=None, help=help_text)
    elif name == "model_impl":
        p.add_argument(flag, dest=name, choices=["auto", "corral", "transformers"], default=None, help=help_text)
    elif name in REPEATABLE:
        p.add_argument(flag, dest=name, action="append", default=None, metavar=REPEATABLE[name], help=help_text)
    elif get_origin(info.annotation) is Literal:
        p.add_argument(flag, dest=name, choices=list(get_args(info.annotation)), default=None, help=help_text)
    else:
        p.add_argument(flag, dest=name, default=None, help=help_text)


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    for name in REPEATABLE:  # repeated flags: one comma-separated setting, like CORRAL_API_KEY
        if name in overrides:
            overrides[name] = ",".join(overrides[name])
    return Settings(**overrides)


def serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    from corral.server.memory import limit_malloc_arenas

    limit_malloc_arenas()  # before the server's threads exist
    from corral.server.request_context import LOG_FORMAT, install_log_record_factory, uvicorn_log_config

    install_log_record_factory()
    logging.basicConfig(level=settings.log_level.upper(), format=LOG_FORMAT)
    # Heavy imports after argument parsing, so `corral --help` is instant.
    import torch
    import uvicorn

    from corral.server.app import create_app
    from corral.server.models import ModelLoadError, ModelOptions, load_model
    from corral.server.serving import Service
    from corral.server.torch_threads import on_passing_thread

    cores = torch.get_num_threads()
    torch.set_num_threads(1)  # this thread (HTTP) never forms an OpenMP team: see corral/server/torch_threads.py
    if settings.compile_isolate:
        from corral.grammar_engines.worker_handles import prespawn_zygote

        prespawn_zygote(settings.compile_memory_limit_mb)  # boots beside the model's load
    options = dataclasses.asdict(settings.group(ModelOptions))
    try:
        loaded = on_passing_thread(lambda: load_model(**options), threads=cores)
    except ModelLoadError as exc:
        print(f"corral: {exc}", file=sys.stderr)
        return 2
    problem = _memory_problem(loaded, settings)
    if problem is not None:
        print(f"corral: {problem}.", file=sys.stderr)
        return 2
    service = Service(settings, loaded)
    service.start()
    logging.getLogger("corral").info("serving %s on http://%s:%d", service.model_name, settings.host, settings.port)
    # Bounded drain: without a limit uvicorn waits for every open request, e.g. a compile under a long
    # deadline or a long generation, and `docker stop` would end in SIGKILL.
    uvicorn.run(
        create_app(service, settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=uvicorn_log_config(),
        timeout_graceful_shutdown=settings.shutdown_timeout_s,
    )
    return 0


def _memory_problem(loaded: Any, settings: Settings) -> str | None:
    """Why the model cannot be served in this machine's memory (None: it fits; a full KV cache that would not
    is logged as a warning). Weights: what a GGUF's blocks hold (with repacked copies beside them) or the
    parameters' bytes."""
    from corral.server.memory import available_bytes, memory_verdict

    model = loaded.model
    held = getattr(model, "weight_memory_bytes", None)
    weights = int(held()) if callable(held) else sum(p.numel() * p.element_size() for p in model.parameters())
    text = model.config.get_text_config()
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    kv_dtype = getattr(model, "kv_dtype", loaded.dtype)
    per_token = 2 * int(text.num_hidden_layers) * kv_heads * head_dim * kv_dtype.itemsize
    tokens = settings.max_batch * min(settings.max_model_len, loaded.context_length)
    store = settings.prefix_cache_ram_mb << 20 if settings.prefix_cache else 0  # the host block store's most
    error, warning = memory_verdict(weights, per_token * tokens + store, available_bytes())
    if warning is not None:
        logging.getLogger("corral").warning("%s", warning)
    return error


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="corral", description="Constrained-decoding inference server.")
    sub = parser.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # corral/benchmarks/ (and its packages, the `bench` extra) load only for `corral bench`
        from corral.benchmarks.cli import add_bench_parser

        add_bench_parser(sub)
    else:
        sub.add_parser("bench", help="run a benchmark")  # listed in `corral --help`, as corral.benchmarks.cli words it
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve(args)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.error(f"unknown command {args.command}")
    code: int = handler(args)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
