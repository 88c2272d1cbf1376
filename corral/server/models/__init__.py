"""Model loading: a built-in model (qwen2.5-coder-1.5b-instruct, gemma-3-270m, corral-tiny), a local Hugging Face
causal LM, or a GGUF file."""

from corral.server.models.checkpoint_meta import ModelLoadError
from corral.server.models.default_model import ensure_default_model
from corral.server.models.loading import LoadedModel, ModelOptions, load_model

__all__ = ["LoadedModel", "ModelLoadError", "ModelOptions", "ensure_default_model", "load_model"]
