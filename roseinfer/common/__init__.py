"""Plain data and wire that every layer shares: the engine's messages and their encoding, the KV
cache groups' specification, and the worker channel with its security."""
