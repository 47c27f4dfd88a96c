"""Model registry keyed by HF `architectures`."""

from tide.models.registry import get_model_class, supported_architectures

__all__ = ["get_model_class", "supported_architectures"]
