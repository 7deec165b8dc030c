"""Model architectures in plain PyTorch and their loaders (GGUF, Hugging Face directories, the seed's checkpoints)."""
