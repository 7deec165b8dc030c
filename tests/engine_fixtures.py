"""Session-wide fixtures (loaded as a pytest plugin): the default model loaded once by roseinfer
and once by transformers (the reference), and chat prompts of different lengths."""

from __future__ import annotations

import pytest
import torch

PROMPT_TEXTS = [
    "Hi!",
    "What is the capital of France?",
    "Explain photosynthesis to a high-school student in simple words.",
    "Write a short story about a robot who learns to paint, with a happy ending and a twist.",
    "List three prime numbers.",
    "Translate 'good morning' into Spanish, French and German, and say which is the most common greeting of the three.",
    "Why is the sky blue? Give a short physical explanation suitable for a curious child.",
    "Summarise the plot of Romeo and Juliet in two sentences.",
]


@pytest.fixture(scope="session")
def default_llm():
    from roseinfer import LLM

    # Every weight expanded, exact products: what transformers computes (the token-exact tests).
    return LLM(kv_cache_memory=0.5, quantization="none")


@pytest.fixture(scope="session")
def default_engine(default_llm):
    yield default_llm.engine
    engine = default_llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.fixture(scope="session")
def hf_default_model():
    from transformers import AutoModelForCausalLM

    from roseinfer.models.default_model import default_model_path

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def chat_prompt_ids(default_engine) -> list[list[int]]:
    tokenizer = default_engine.tokenizer
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)
        for text in PROMPT_TEXTS
    ]
