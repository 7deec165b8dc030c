"""The chat templates of the families we load (the real ones, from llama.cpp's collection of model
templates) render as transformers renders them: plain, system, multi-turn conversations, with and
without the generation prompt, and tool definitions, calls and results where the template has them."""

from __future__ import annotations

import pytest
from hf_to_gguf import llama_cpp_chat_template
from support import assert_chat_renders_as_transformers

pytest.importorskip("transformers")

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name"}},
            "required": ["city"],
        },
    },
}]


# Non-ASCII and HTML characters: tojson must write them as they are (as transformers' does).
UNICODE_TOOLS = [{"type": "function", "function": {
    "name": "météo", "description": "Le temps qu'il fait — « ville » & <b>",
    "parameters": {"type": "object", "properties": {"ville": {"type": "string"}}},
}}]


def _tool_call(arguments: object, call_id: str = "abcDEF123") -> dict:
    # Nine-character ids: Mistral's template refuses any other.
    return {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": arguments}}


BASIC = [
    ([{"role": "user", "content": "What is 2+2?"}], {}),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi! Café? 漢字 😀"}], {}),
    ([{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": " Hello.\nHow can I help?"},
      {"role": "user", "content": "A joke."}], {}),
]
WITH_TOOLS = [
    # Tools offered; a call (arguments as an object), its result, the answer, the next question.
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [_tool_call({"city": "Paris"})]},
      {"role": "tool", "tool_call_id": "abcDEF123", "name": "get_weather", "content": "Sunny, 21 C"},
      {"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks."}], {"tools": TOOLS}),
    # Arguments as the JSON string the OpenAI API sends; the conversation ends on the result.
    ([{"role": "user", "content": "Weather in Paris?"},
      {"role": "assistant", "content": "", "tool_calls": [_tool_call('{"city": "Paris"}')]},
      {"role": "tool", "tool_call_id": "abcDEF123", "name": "get_weather", "content": "Sunny, 21 C"}],
     {"tools": TOOLS}),
    ([{"role": "user", "content": "Weather in Paris?"}], {"tools": TOOLS}),
    ([{"role": "user", "content": "Météo à Zürich? 漢字"}], {"tools": UNICODE_TOOLS}),
    # Two calls at once (Llama 3's templates refuse them, with their own message).
    ([{"role": "user", "content": "Weather in Paris and Rome?"},
      {"role": "assistant", "content": "Checking.",
       "tool_calls": [_tool_call({"city": "Paris"}), _tool_call({"city": "Rome"}, "xyzXYZ789")]},
      {"role": "tool", "tool_call_id": "abcDEF123", "content": "Sunny"},
      {"role": "tool", "tool_call_id": "xyzXYZ789", "content": "Rain"}], {"tools": TOOLS}),
]
LLAMA3 = [
    # Tools in the system turn instead of the first user turn; built-in tools and their results.
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}],
     {"tools": TOOLS, "tools_in_user_message": False}),
    ([{"role": "user", "content": "Search cats"}],
     {"builtin_tools": ["brave_search", "wolfram_alpha"], "date_string": "26 Nov 2026"}),
    ([{"role": "user", "content": "Search cats"},
      {"role": "assistant", "content": "", "tool_calls": [
          {"type": "function", "function": {"name": "brave_search", "arguments": {"query": "cats"}}}]},
      {"role": "ipython", "content": "cats are cute"}], {"builtin_tools": ["brave_search"]}),
]
THINKING = [
    # Earlier turns' reasoning is dropped, in the content or in reasoning_content; thinking off.
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nFour."},
      {"role": "user", "content": "3+3?"}], {"enable_thinking": False}),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "reasoning_content": "hmm", "content": "Four."},
      {"role": "user", "content": "3+3?"}, {"role": "assistant", "reasoning_content": "hmm", "content": "Six."}], {}),
]

# (Gemma 2's, Phi-3's and Phi-4-mini's are checked in tests/test_gemma.py and test_phi3_rope_scaling.py.)
# llama.cpp's template file -> the conversations it is checked with, and how many of the renders
# (two per conversation) transformers completes (the rest the template refuses, and so must ours).
TEMPLATES = {
    "Qwen-Qwen3-0.6B": (BASIC + WITH_TOOLS + THINKING, 20),  # Qwen3 and Qwen3-MoE
    "Qwen-Qwen2.5-7B-Instruct": (BASIC + WITH_TOOLS, 16),  # Qwen2 and Qwen2-MoE
    "mistralai-Mistral-Nemo-Instruct-2407": (BASIC + WITH_TOOLS, 16),
    "meta-llama-Llama-3.1-8B-Instruct": (BASIC + WITH_TOOLS + LLAMA3, 20),
    "meta-llama-Llama-3.2-3B-Instruct": (BASIC + WITH_TOOLS + LLAMA3, 20),
    "meta-llama-Llama-3.3-70B-Instruct": (BASIC + WITH_TOOLS + LLAMA3, 20),
    "microsoft-Phi-3.5-mini-instruct": (BASIC, 6),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_family_chat_template_renders_as_transformers(smollm_tokenizer, smollm_hf_tokenizer, name):
    conversations, renders = TEMPLATES[name]
    rendered = assert_chat_renders_as_transformers(
        smollm_tokenizer, smollm_hf_tokenizer, llama_cpp_chat_template(name), conversations
    )
    assert rendered == renders
