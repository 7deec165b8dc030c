"""The engine core: requests, blocks and the step loop (scheduler, KV cache manager, engine core, messages)."""
