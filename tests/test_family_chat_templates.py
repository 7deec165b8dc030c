"""The chat templates of the families we load (the real ones, from llama.cpp's collection of model
templates or, for the families it lacks, tests/chat_templates/) render as transformers renders them:
plain, system, multi-turn conversations, with and without the generation prompt, and tool
definitions, calls and results where the template has them; where a template refuses a
conversation, ours refuses it with the template's own message."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
from hf_to_gguf import llama_cpp_chat_template
from support import assert_chat_renders_as_transformers

pytest.importorskip("transformers")

FIXTURES = Path(__file__).parent / "chat_templates"
# Templates llama.cpp's collection lacks: each file is the `chat_template` string of the model's own
# tokenizer_config.json on Hugging Face, byte for byte (its SHA-256 here), taken only where two
# independent public sources agree on every byte:
FIXTURE_SOURCES = {
    # google/gemma-3-4b-it (the same template as gemma-3-1b/12b/27b-it). Sources: (1) ShishirPatil/
    # gorilla, berkeley-function-call-leaderboard/bfcl_eval/model_handler/local_inference/gemma.py
    # (commit 6ea5797), which quotes the tokenizer_config.json entry as JSON; (2) xorbitsai/
    # inference, xinference/model/llm/llm_family.json, "gemma-3-it" (commit 7ecec16); (3)
    # huggingface/huggingface.js, packages/ollama-utils/src/chat-template-automap.ts, the template
    # inside ollama's gemma3:270m GGUF (which llama.cpp's converter copies from tokenizer_config).
    "google-gemma-3-4b-it": "7de1c58e208eda46e9c7f86397df37ec49883aeece39fb961e0a6b24088dd3c4",
    # mistralai/Mixtral-8x7B-Instruct-v0.1 (the 2024 template with an optional system message).
    # Sources: (1) huggingface.js chat-template-automap.ts (as above), the template inside ollama's
    # mixtral:8x7b GGUF; (2) a knowledge-generation notebook built on sdg_hub that hard-codes
    # `AutoTokenizer.from_pretrained("mistralai/Mixtral-8x7B-Instruct-v0.1").chat_template`;
    # (3) llama.cpp's tests/test-chat-template.cpp, Mistral's "v1" template with a system prompt
    # (named there for Mistral-7B-Instruct-v0.2, which shares it). (xinference's "mixtral-instruct-
    # v0.1" entry is an edited copy, with <s> and </s> written in: not used.)
    "mistralai-Mixtral-8x7B-Instruct-v0.1": "796853172235ab3aaa4810013ddfe2eab481bda3306dad4f700c00d436eed596",
    # allenai/OLMoE-1B-7B-0924-Instruct (Tulu's template, with bos_token). Sources: (1) a
    # llama-cpp-python tool-use preset table whose "allenai/OLMoE-1B-7B-0924-Instruct-GGUF" entry
    # holds the template of allenai's own GGUF; (2) an offline OLMoE tokenizer backend that pins
    # "the exact OLMoE template" and refuses to run unless the model's tokenizer_config.json
    # chat_template equals it (bos and eos <|endoftext|>).
    "allenai-OLMoE-1B-7B-0924-Instruct": "1ca918f1bbf9c4d4de517e7fc5d1fa80ce0be74fb8df8a66b74d931a6b8bdf0a",
}
# Gemma 2's (google/gemma-2-2b-it, = 9b/27b-it) is in llama.cpp's collection; ollama's gemma2:2b
# GGUF (huggingface.js chat-template-automap.ts) holds the same bytes.


def chat_template(name: str) -> str:
    if name in FIXTURE_SOURCES:
        return (FIXTURES / f"{name}.jinja").read_text(encoding="utf-8")
    return llama_cpp_chat_template(name)


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
# Gemma's, Mixtral's and OLMoE's templates know no tools: all three ignore `tools`; a tool result
# after the assistant's call is out of turn for Gemma's and Mixtral's (refused), and Mixtral's
# refuses the tool role by name anywhere; OLMoE's drops tool messages. Roles out of turn: Gemma 2
# refuses a system message first, Gemma 3 folds one into the first user turn; both and Mixtral
# refuse roles not alternating, and Mixtral any role but user and assistant after the first
# message; OLMoE's renders any order.
ROLE_ORDER = [
    ([{"role": "user", "content": "Hi"}, {"role": "user", "content": "again"}], {}),
    ([{"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Hi"}], {}),
    ([{"role": "user", "content": "Hi"}, {"role": "system", "content": "Late system."}], {}),
    ([{"role": "system", "content": "A"}, {"role": "system", "content": "B"}, {"role": "user", "content": "Hi"}], {}),
]
# Content as a list of text parts, for templates that loop over them (Gemma 3's trims each part).
PARTS = [
    ([{"role": "user", "content": [{"type": "text", "text": " Hello "}, {"type": "text", "text": "world\n"}]}], {}),
    ([{"role": "system", "content": [{"type": "text", "text": "Be terse."}]},
      {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
      {"role": "assistant", "content": [{"type": "text", "text": "Hello."}, {"type": "text", "text": " Yes?"}]},
      {"role": "user", "content": "A joke."}], {}),
]
THINKING = [
    # Earlier turns' reasoning is dropped, in the content or in reasoning_content; thinking off.
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nFour."},
      {"role": "user", "content": "3+3?"}], {"enable_thinking": False}),
    ([{"role": "user", "content": "2+2?"}, {"role": "assistant", "reasoning_content": "hmm", "content": "Four."},
      {"role": "user", "content": "3+3?"}, {"role": "assistant", "reasoning_content": "hmm", "content": "Six."}], {}),
]

# (Phi-3's and Phi-4-mini's are checked in tests/test_phi3_rope_scaling.py.)
# llama.cpp's template file (or FIXTURE_SOURCES') -> the conversations it is checked with, and how
# many of the renders (two per conversation) transformers completes (the rest the template refuses,
# and so must ours).
TEMPLATES = {
    "Qwen-Qwen3-0.6B": (BASIC + WITH_TOOLS + THINKING, 20),  # Qwen3 and Qwen3-MoE
    "Qwen-Qwen2.5-7B-Instruct": (BASIC + WITH_TOOLS, 16),  # Qwen2 and Qwen2-MoE
    "mistralai-Mistral-Nemo-Instruct-2407": (BASIC + WITH_TOOLS, 16),
    "meta-llama-Llama-3.1-8B-Instruct": (BASIC + WITH_TOOLS + LLAMA3, 20),
    "meta-llama-Llama-3.2-3B-Instruct": (BASIC + WITH_TOOLS + LLAMA3, 20),
    "meta-llama-Llama-3.3-70B-Instruct": (BASIC + WITH_TOOLS + LLAMA3, 20),
    "microsoft-Phi-3.5-mini-instruct": (BASIC, 6),
    "google-gemma-3-4b-it": (BASIC + WITH_TOOLS + ROLE_ORDER + PARTS, 16),
    "google-gemma-2-2b-it": (BASIC + WITH_TOOLS + ROLE_ORDER, 10),
    "mistralai-Mixtral-8x7B-Instruct-v0.1": (BASIC + WITH_TOOLS + ROLE_ORDER, 10),
    "allenai-OLMoE-1B-7B-0924-Instruct": (BASIC + WITH_TOOLS + ROLE_ORDER, 24),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_family_chat_template_renders_as_transformers(smollm_tokenizer, smollm_hf_tokenizer, name):
    conversations, renders = TEMPLATES[name]
    rendered = assert_chat_renders_as_transformers(
        smollm_tokenizer, smollm_hf_tokenizer, chat_template(name), conversations
    )
    assert rendered == renders


@pytest.mark.parametrize("name", list(FIXTURE_SOURCES))
def test_fixture_is_the_sourced_template(name):
    """The file still holds the bytes both sources agree on (no editor's newline or strip)."""
    assert hashlib.sha256((FIXTURES / f"{name}.jinja").read_bytes()).hexdigest() == FIXTURE_SOURCES[name]


REFUSALS = [
    ("google-gemma-2-2b-it", ROLE_ORDER[3][0], "System role not supported"),
    ("google-gemma-2-2b-it", ROLE_ORDER[0][0], "Conversation roles must alternate user/assistant/user/assistant/..."),
    ("google-gemma-3-4b-it", ROLE_ORDER[1][0], "Conversation roles must alternate user/assistant/user/assistant/..."),
    ("google-gemma-3-4b-it", WITH_TOOLS[1][0], "Conversation roles must alternate user/assistant/user/assistant/..."),
    ("mistralai-Mixtral-8x7B-Instruct-v0.1", ROLE_ORDER[0][0],
     "After the optional system message, conversation roles must alternate user/assistant/user/assistant/..."),
    ("mistralai-Mixtral-8x7B-Instruct-v0.1", ROLE_ORDER[2][0],
     "Only user and assistant roles are supported, with the exception of an initial optional system message!"),
    ("mistralai-Mixtral-8x7B-Instruct-v0.1", [{"role": "user", "content": "Weather?"},
                                              {"role": "tool", "tool_call_id": "abcDEF123", "content": "Sunny"}],
     "Only user and assistant roles are supported, with the exception of an initial optional system message!"),
]


@pytest.mark.parametrize(("name", "messages", "message"), REFUSALS)
def test_family_template_refuses_as_transformers(smollm_tokenizer, smollm_hf_tokenizer, name, messages, message):
    """Where the template raises on a conversation as sent, ours places it as the template allows
    (an agent's system turn mid-conversation, two turns of one role) and renders what transformers
    renders for that placement; where the template takes no placement, ours refuses in the
    template's own words."""
    from support import _placed_as_transformers_renders

    from roseinfer.tokenizer import Tokenizer

    template = chat_template(name)
    with pytest.raises(Exception, match="^" + re.escape(message) + "$"):
        smollm_hf_tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False)
    ours = Tokenizer(smollm_tokenizer.backend, chat_template=template, bos_token=smollm_tokenizer.bos_token,
                     eos_token=smollm_tokenizer.eos_token)
    placed = _placed_as_transformers_renders(smollm_hf_tokenizer, template, messages, True, {})
    if placed is None:
        with pytest.raises(ValueError, match=re.escape(message)):
            ours.apply_chat_template(messages)
    else:
        assert ours.apply_chat_template(messages) == placed
