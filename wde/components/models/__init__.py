"""Model implementations: packed (unpadded) forward passes that load Hugging Face checkpoints."""
