"""Model loading: any local Hugging Face causal LM, or the embedded tiny default."""

from server.models.default_model import ensure_default_model
from server.models.loading import LoadedModel, ModelLoadError, load_model

__all__ = ["LoadedModel", "ModelLoadError", "ensure_default_model", "load_model"]
