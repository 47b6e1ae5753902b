"""Model families (one module each) and the registry that picks one from a checkpoint's `config.json`."""

from worker.models.hf_config import load_model_config
from worker.models.registry import SUPPORTED_ARCHITECTURES, family_for, family_named

__all__ = ["SUPPORTED_ARCHITECTURES", "family_for", "family_named", "load_model_config"]
