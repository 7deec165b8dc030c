"""What runs the model for the engine core: the model runner (persistent per-request state, flattened batch) and the sampler."""
