"""Model architectures written against the shared layers in `impasto.models.layers`."""

from impasto.models.registry import get_model_class, register_model, supported_architectures

__all__ = ["get_model_class", "register_model", "supported_architectures"]
