"""Integrations with other libraries (safetensors, HF). The engine never imports this package."""
