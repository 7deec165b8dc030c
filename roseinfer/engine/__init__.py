"""The engines callers use: `LLMEngine` (synchronous), `AsyncLLM` (asyncio), and the seed's names."""
