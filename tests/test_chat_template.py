"""roseinfer.chat_template: same text as transformers' apply_chat_template, sandboxed, clear errors."""

from __future__ import annotations

import datetime

import pytest

from roseinfer.chat_template import render_chat_template
from roseinfer.tokenizer import Tokenizer

pytest.importorskip("transformers")

CONVERSATIONS = {
    "one user message": [{"role": "user", "content": "What is 2+2?"}],
    "system + user": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name a colour."},
    ],
    "multi-turn": [
        {"role": "user", "content": "Hi! Café? 漢字 😀"},
        {"role": "assistant", "content": "Hello.\nHow can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
}

# A Llama-3-style template exercising what real ones use: bos_token, namespace, loop controls,
# tojson, `tools is not none`, raise_exception.
RICH_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(system='') -%}
{%- if messages[0]['role'] == 'system' -%}{%- set ns.system = messages[0]['content'] -%}{%- endif -%}
{%- if tools is not none -%}<tools>{{ tools | tojson }}</tools>{%- endif -%}
{%- if ns.system %}<|system|>{{ ns.system | trim }}<|end|>{% endif -%}
{%- for message in messages -%}
    {%- if message['role'] == 'system' -%}{%- continue -%}{%- endif -%}
    {%- if message['role'] not in ['user', 'assistant'] -%}
        {{ raise_exception('Unknown role: ' + message['role']) }}
    {%- endif -%}
    <|{{ message['role'] }}|>
    {{ message['content'] | trim }}{{ eos_token }}
{% endfor -%}
{%- if add_generation_prompt %}<|assistant|>
{% endif -%}"""


@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_matches_transformers(smollm_tokenizer, smollm_hf_tokenizer, name, add_generation_prompt):
    messages = CONVERSATIONS[name]
    expected = smollm_hf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert smollm_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_rich_template_matches_transformers(smollm_tokenizer, smollm_hf_tokenizer, name):
    tok = Tokenizer(
        smollm_tokenizer.backend, chat_template=RICH_TEMPLATE,
        bos_token=smollm_tokenizer.bos_token, eos_token=smollm_tokenizer.eos_token,
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Météo <now>"}}]
    for kwargs in ({}, {"tools": tools}):
        for add_generation_prompt in (True, False):
            expected = smollm_hf_tokenizer.apply_chat_template(
                CONVERSATIONS[name], chat_template=RICH_TEMPLATE, tokenize=False,
                add_generation_prompt=add_generation_prompt, **kwargs,
            )
            got = tok.apply_chat_template(CONVERSATIONS[name], add_generation_prompt=add_generation_prompt, **kwargs)
            assert got == expected


def test_default_is_add_generation_prompt(smollm_tokenizer):
    text = smollm_tokenizer.apply_chat_template(CONVERSATIONS["one user message"])
    assert text.endswith("<|im_start|>assistant\n")


def test_text_parts_are_joined(smollm_tokenizer):
    parts = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
    as_parts = smollm_tokenizer.apply_chat_template([{"role": "user", "content": parts}])
    as_string = smollm_tokenizer.apply_chat_template([{"role": "user", "content": "first\nsecond"}])
    assert as_parts == as_string


def test_tool_call_message_without_content():
    template = "{% for m in messages %}{{ m.role }}:{{ m.content | default('-') }};{% endfor %}"
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"name": "get_weather"}]},
    ]
    assert render_chat_template(template, messages) == "user:weather?;assistant:-;"


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ([], "non-empty list"),
        ("hello", "non-empty list"),
        (["hello"], r"messages\[0\] must be an object"),
        ([{"content": "hi"}], r"messages\[0\] needs a 'role'"),
        ([{"role": 3, "content": "hi"}], r"messages\[0\] needs a 'role'"),
        ([{"role": "user"}], r"messages\[0\] \(user\) needs a 'content'"),
        ([{"role": "user", "content": "a"}, {"role": "user", "content": 42}], r"messages\[1\]\['content'\].*got int"),
        ([{"role": "user", "content": {"text": "hi"}}], r"got dict"),
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "'image_url'"),
    ],
)
def test_invalid_messages(smollm_tokenizer, messages, match):
    with pytest.raises(ValueError, match=match):
        smollm_tokenizer.apply_chat_template(messages)


def test_raise_exception_carries_the_templates_message():
    with pytest.raises(ValueError, match="Unknown role: robot"):
        render_chat_template(RICH_TEMPLATE, [{"role": "robot", "content": "beep"}])


@pytest.mark.parametrize(
    "template",
    [
        "{{ ''.__class__.__mro__ }}",
        "{{ messages.__class__.__base__.__subclasses__() }}",
        "{{ raise_exception.__globals__.keys() | list }}",
        "{% set _ = messages.append({'role': 'x'}) %}",
        "{{ messages[0].update(role='system') }}",
    ],
)
def test_sandbox_refuses_unsafe_operations(template):
    with pytest.raises(ValueError):
        render_chat_template(template, [{"role": "user", "content": "hi"}])


def test_template_errors_become_value_errors():
    with pytest.raises(ValueError, match="syntax error"):
        render_chat_template("{% for m in messages %}", [{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="failed to render"):
        render_chat_template("{{ messages[0].content.nope.deeper }}", [{"role": "user", "content": "hi"}])


def test_helpers_available_to_templates():
    messages = [{"role": "user", "content": "Ünïcode <b> & 'quotes'"}, {"role": "user", "content": "x"}]
    assert render_chat_template("{{ messages[0] | tojson }}", messages) == (
        '{"role": "user", "content": "Ünïcode <b> & \'quotes\'"}'
    )
    assert render_chat_template("{{ {'b': 1, 'a': [1, 2]} | tojson(indent=2) }}", messages) == (
        '{\n  "b": 1,\n  "a": [\n    1,\n    2\n  ]\n}'
    )
    assert render_chat_template("{{ strftime_now('%Y') }}", messages) == str(datetime.date.today().year)
    loop = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content[:3] }}{% endfor %}"
    assert render_chat_template(loop, messages) == "Ünï"
    generation = "{% for m in messages %}{% generation %}[{{ m.content }}]{% endgeneration %}{% endfor %}"
    assert render_chat_template(generation, messages[1:]) == "[x]"
    # Extra variables reach the template; a missing special token renders as nothing, not "None".
    assert render_chat_template("{{ bos_token }}{{ greeting }}", messages, greeting="hey") == "hey"


def test_trim_and_lstrip_blocks():
    template = "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    assert render_chat_template(template, [{"role": "user", "content": "a"}]) == "a\n"


def test_compiled_template_is_cached():
    from roseinfer.chat_template import _compile

    template = "{{ messages | length }}"
    assert _compile(template) is _compile(template)


def test_sandbox_hides_unsafe_attributes():
    # Printing an unsafe attribute yields an empty Undefined: nothing leaks.
    assert render_chat_template("{{ raise_exception.__globals__ }}", [{"role": "user", "content": "hi"}]) == ""


# -- conversations as agents send them ------------------------------------------------------------

AGENT_CONVERSATION = [
    {"role": "system", "content": "You are an agent."},
    {"role": "developer", "content": "Sandbox: none."},
    {"role": "user", "content": "Fix the bug."},
    {"role": "user", "content": [{"type": "text", "text": "It is in app.py."}]},
    {"role": "assistant", "content": "Looking."},
    {"role": "system", "content": "Reminder: be brief."},
    {"role": "user", "content": "Go on."},
]
# The same conversation in the shape strict templates take: one leading system message, the later
# system turn a user turn where it stood, consecutive user turns merged.
AGENT_CONFORMED = [
    {"role": "system", "content": "You are an agent.\n\nSandbox: none."},
    {"role": "user", "content": "Fix the bug.\n\nIt is in app.py."},
    {"role": "assistant", "content": "Looking."},
    {"role": "user", "content": "Reminder: be brief.\n\nGo on."},
]


def test_strict_templates_get_the_conversation_as_they_allow():
    """Mixtral's and Gemma 3's templates raise "roles must alternate" for the conversation as sent."""
    from pathlib import Path

    from hf_to_gguf import llama_cpp_chat_template

    templates = Path(__file__).parent / "chat_templates"
    for template in ((templates / "mistralai-Mixtral-8x7B-Instruct-v0.1.jinja").read_text(),
                     (templates / "google-gemma-3-4b-it.jinja").read_text()):
        assert render_chat_template(template, AGENT_CONVERSATION, bos_token="<s>", eos_token="</s>") == \
            render_chat_template(template, AGENT_CONFORMED, bos_token="<s>", eos_token="</s>")
    # Gemma 2's template has no system role: the system text opens the first user turn.
    gemma2 = llama_cpp_chat_template("google-gemma-2-2b-it")
    folded = [{"role": "user", "content": "You are an agent.\n\nSandbox: none.\n\nFix the bug.\n\nIt is in app.py."},
              *AGENT_CONFORMED[2:]]
    assert render_chat_template(gemma2, AGENT_CONVERSATION, bos_token="<bos>") == render_chat_template(
        gemma2, folded, bos_token="<bos>")


def test_templates_that_take_the_conversation_render_it_as_sent(smollm_tokenizer):
    """ChatML (the default model's) takes system turns anywhere: nothing is moved, so an agent's
    earlier turns render the same text every turn (its prefix-cache hits). Only a developer turn,
    a role the template does not know, is read as system."""
    as_system = [{**m, "role": "system"} if m["role"] == "developer" else m for m in AGENT_CONVERSATION]
    assert smollm_tokenizer.apply_chat_template(AGENT_CONVERSATION) == smollm_tokenizer.apply_chat_template(as_system)
    assert "Reminder: be brief.<|im_end|>\n<|im_start|>user\nGo on." in smollm_tokenizer.apply_chat_template(
        AGENT_CONVERSATION)
