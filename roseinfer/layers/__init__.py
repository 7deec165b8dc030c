"""Building blocks of the models: paged attention, rotary embeddings, norms, linear kernels, C++ CPU kernels."""
