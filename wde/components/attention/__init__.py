"""Attention backends: varlen attention over packed sequences, causal or bidirectional."""

from wde.components.attention.base import AttentionBackend, AttentionMetadata, AttentionParams

__all__ = ["AttentionBackend", "AttentionMetadata", "AttentionParams"]
