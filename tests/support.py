"""Helpers shared by tests: tiny Hugging Face model directories built offline from transformers
configs, and a step-by-step logits comparison of roseinfer's paged engine against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps keys and values in fixed-size blocks.",
    "Continuous batching lets new requests join a running batch.",
    "def add(a, b):\n    return a + b\n",
    "Numbers like 3.14159 and 2024 appear in text too.",
] * 20

TINY_VOCAB = 384

# Outputs compared across different batch shapes (a request alone and in a batch, recomputed after
# a preemption, verified with drafts, on two ranks, against `default_llm`) are equal only where every
# kernel computes a row the same whatever rows stand beside it: `--quantization none` (exact
# products). The default, `auto`, runs GGUF blocks with 8-bit activations in small steps and
# bfloat16 products in large ones, so its tokens can depend on the batch (as llama.cpp's and vLLM's).
EXACT = {"quantization": "none"}
EXACT_FLAGS = ("--quantization", "none")


def tiny_tokenizer_json(path: Path) -> None:
    """A byte-level BPE trained on a small corpus, saved as tokenizer.json (+ tokenizer_config)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_VOCAB - 8,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    tokenizer.save(str(path / "tokenizer.json"))
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|endoftext|>", "bos_token": None, "chat_template": template,
        "clean_up_tokenization_spaces": False,
    }))


def tiny_hf_model(kind: str, path: Path, seed: int = 0, max_positions: int = 512) -> torch.nn.Module:
    """Build a small random model of `kind` with transformers, save it with a tokenizer, return it."""
    import transformers

    common = dict(vocab_size=TINY_VOCAB, max_position_embeddings=max_positions, eos_token_id=0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            **common,
        )
    elif kind == "llama-256":  # rows of 256 values: whole K-quant super-blocks
        config = transformers.LlamaConfig(
            hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False,
            **common,
        )
    elif kind == "qwen2":
        config = transformers.Qwen2Config(
            hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True, **common,
        )
    elif kind == "qwen3":
        config = transformers.Qwen3Config(
            hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rope_theta=1000000.0, tie_word_embeddings=False,
            **common,
        )
    elif kind == "gpt2":
        config = transformers.GPT2Config(
            n_embd=64, n_layer=3, n_head=4, n_positions=512, vocab_size=TINY_VOCAB, eos_token_id=0,
            bos_token_id=0,
        )
    elif kind == "gpt2-exact-gelu":  # the seed's own GPT uses exact GELU
        config = transformers.GPT2Config(
            n_embd=64, n_layer=3, n_head=4, n_positions=512, vocab_size=TINY_VOCAB, eos_token_id=0,
            bos_token_id=0, activation_function="gelu",
        )
    else:
        raise ValueError(kind)
    config.initializer_range = 0.1  # larger weights than the default: logits that differ more
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tiny_tokenizer_json(path)
    return model


# -- thinking models: Qwen3's own chat template ------------------------------------------------

# The chat template Qwen3's hybrid thinking models (Qwen3-0.6B ... Qwen3-32B) ship in their
# tokenizer_config.json: the model opens `<think>` itself, `enable_thinking: false` closes an empty
# one in the prompt, and earlier turns' thinking is dropped.
QWEN3_CHAT_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- set tool_start = "<tool_response>" %}
    {%- set tool_start_length = tool_start|length %}
    {%- set start_of_message = message.content[:tool_start_length] %}
    {%- set tool_end = "</tool_response>" %}
    {%- set tool_end_length = tool_end|length %}
    {%- set start_pos = (message.content|length) - tool_end_length %}
    {%- if start_pos < 0 %}
        {%- set start_pos = 0 %}
    {%- endif %}
    {%- set end_of_message = message.content[start_pos:] %}
    {%- if ns.multi_step_tool and message.role == "user" and not(start_of_message == tool_start and end_of_message == tool_end) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set content = message.content %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is defined and message.reasoning_content is not none %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in message.content %}
                {%- set content = (message.content.split('</think>')|last).lstrip('\\n') %}
                {%- set reasoning_content = (message.content.split('</think>')|first).rstrip('\\n') %}
                {%- set reasoning_content = (reasoning_content.split('<think>')|last).lstrip('\\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# The thinking-only Qwen3 models (Qwen3-*-Thinking-2507) differ in one place: their template opens
# the thinking itself, so the output starts inside it.
_QWEN3_HYBRID_GENERATION_PROMPT = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""
QWEN3_THINKING_CHAT_TEMPLATE = QWEN3_CHAT_TEMPLATE.replace(_QWEN3_HYBRID_GENERATION_PROMPT, """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n<think>\\n' }}
{%- endif %}""")
assert QWEN3_THINKING_CHAT_TEMPLATE != QWEN3_CHAT_TEMPLATE

# Added tokens of Qwen3's tokenizer that thinking and tool calls need: single tokens, not special
# (so they stay in the decoded text), as in Qwen3's own tokenizer.json.
QWEN3_MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]


# A live server on the tiny thinking Qwen3 (tiny_qwen3_thinking_model) with the qwen3 reasoning parser.
THINKING_MODEL = "tiny-qwen3-thinking"
THINKING_SERVER_FLAGS = ("--served-model-name", THINKING_MODEL, "--reasoning-parser", "qwen3", "--max-model-len", "1024",
                         "--num-kv-blocks", "160", *EXACT_FLAGS)


def tiny_qwen3_thinking_model(path: Path, chat_template: str = QWEN3_CHAT_TEMPLATE, seed: int = 0) -> torch.nn.Module:
    """A tiny random Qwen3 model directory whose tokenizer has Qwen3's markup tokens (`<think>`
    and `</think>` single added tokens) and Qwen3's chat template, with `<|im_end|>` its EOS."""
    from tokenizers import AddedToken

    model = tiny_hf_model("qwen3", path, seed, max_positions=2048)  # room for a tools prompt
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(token, special=False, normalized=False) for token in QWEN3_MARKUP_TOKENS])
    assert tokenizer.get_vocab_size(with_added_tokens=True) <= TINY_VOCAB
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "bos_token": None, "pad_token": "<|endoftext|>", "chat_template": chat_template,
        "clean_up_tokenization_spaces": False,
    }))
    return model


@torch.no_grad()
def compare_logits_step_by_step(engine, reference, prompts: list[list[int]], decode_steps: int) -> float:
    """Drive the engine core's scheduler and model runner by hand; after each step compare the
    logits of every sampled row with transformers' logits for the same full sequence. Hands the
    scheduler the reference's greedy token so both continue identically. Returns the max abs
    difference."""
    from roseinfer.common.messages import ModelRunnerOutput
    from roseinfer.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
    request_ids = [engine.add_request(None, params, prompt_token_ids=prompt) for prompt in prompts]
    scheduler = engine.scheduler
    worst, sampled_rows = 0.0, 0
    target = len(prompts) * (decode_steps + 1)
    while sampled_rows < target:
        step = scheduler.schedule()
        assert not step.empty, "the scheduler stalled"
        logits, req_ids = engine.runner.compute_logits(step)
        tokens = []
        for row, req_id in enumerate(req_ids):
            expected = reference(torch.tensor([scheduler.requests[req_id].token_ids])).logits[0, -1]
            worst = max(worst, (logits[row].cpu().float() - expected.cpu().float()).abs().max().item())
            tokens.append([int(expected.argmax())])
            sampled_rows += 1
        scheduler.update_from_output(step, ModelRunnerOutput(req_ids, tokens))
    for request_id in request_ids:
        engine.abort_request(request_id)
    return worst


# -- GGUF files written the way llama.cpp's converter writes them ----------------------------

_GGUF_LLAMA_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_LLAMA_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _permute_qk(weight, num_heads: int):
    """llama.cpp's converter reorders q/k rows for its interleaved rotary layout."""
    rows = weight.shape[0]
    return weight.reshape(num_heads, 2, rows // num_heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(model, tokenizer_dir: Path, path: Path, arch: str, matrix_type: str,
                     random_blocks: bool = False) -> None:
    """Save a transformers Llama-family model as GGUF: metadata, a gpt2-style BPE tokenizer and
    every 2-D weight quantized to `matrix_type` (norms stay F32), as llama.cpp's converter does.
    `random_blocks`: every 2-D weight is random blocks of the type instead (for the types gguf's
    Python package cannot quantize: K-quants, IQ4_*), scaled to weights of ~0.05."""
    import gguf
    import numpy as np
    from gguf.quants import quantize
    from gguf_blocks import random_blocks as random_weight

    config = model.config
    qtype = gguf.GGMLQuantizationType[matrix_type]
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)

    tokenizer = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    tokens = [None] * TINY_VOCAB
    for token, index in vocab.items():
        tokens[index] = token
    for added in tokenizer["added_tokens"]:
        tokens[added["id"]] = added["content"]
    tokens = [t if t is not None else f"[PAD{i}]" for i, t in enumerate(tokens)]
    special = {a["id"] for a in tokenizer["added_tokens"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    merges = tokenizer["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_eos_token_id(0)
    writer.add_add_bos_token(False)

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        stem, suffix = name.rsplit(".", 1)
        if stem in _GGUF_LLAMA_GLOBAL:
            gguf_name = f"{_GGUF_LLAMA_GLOBAL[stem]}.{suffix}"
        else:
            _, _, layer, module = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{_GGUF_LLAMA_NAMES[module]}.{suffix}"
        array = tensor.float().numpy()
        if arch == "llama" and module_of(gguf_name) in ("attn_q", "attn_k"):
            array = _permute_qk(array, heads if module_of(gguf_name) == "attn_q" else kv_heads)
        if array.ndim == 2 and random_blocks:
            blocks = random_weight(matrix_type, *array.shape, seed=len(gguf_name) + int(layer_of(gguf_name)))
            writer.add_tensor(gguf_name, blocks, raw_dtype=qtype)
        elif array.ndim == 2:
            writer.add_tensor(gguf_name, quantize(array, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(array, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def layer_of(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    return parts[1] if parts[0] == "blk" else "99"


def module_of(gguf_name: str) -> str:
    parts = gguf_name.split(".")
    return parts[2] if parts[0] == "blk" else parts[0]


def _placed_as_transformers_renders(reference, template: str, messages: list[dict], add_generation_prompt: bool,
                                    variables: dict) -> str | None:
    """transformers' rendering of the first placement of a refused conversation it takes, in the
    order ours tries them; None where it takes none."""
    from roseinfer.chat_template import conformed_messages, normalize_messages

    normalized = normalize_messages(messages)
    for placed in (conformed_messages(normalized), conformed_messages(normalized, system_role=False)):
        if placed == normalized:
            continue
        try:
            return reference.apply_chat_template(placed, chat_template=template, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt, **variables)
        except Exception:  # noqa: BLE001 - the template refuses this placement too
            continue
    return None


def assert_chat_renders_as_transformers(
    ours, reference, template: str, conversations: list[tuple[list[dict], dict]]
) -> int:
    """Our `Tokenizer` (`ours`) renders `template` as transformers' tokenizer (`reference`) does,
    for each (messages, template variables) pair, with and without the generation prompt. Where
    transformers refuses a conversation (the template's raise_exception, an undefined key), ours
    must refuse it too, with a ValueError carrying the same message. Returns how many rendered."""
    import pytest

    from roseinfer.tokenizer import Tokenizer

    ours = Tokenizer(ours.backend, chat_template=template, bos_token=ours.bos_token, eos_token=ours.eos_token)
    rendered = 0
    for messages, variables in conversations:
        for add_generation_prompt in (True, False):
            try:
                expected = reference.apply_chat_template(
                    messages, chat_template=template, tokenize=False, add_generation_prompt=add_generation_prompt,
                    **variables,
                )
            except Exception as exc:  # jinja2's TemplateError or UndefinedError: the template refused
                # Ours then places the conversation as the template allows (chat_template.py's
                # conformed_messages): what transformers renders for that placement, or, where
                # the template refuses every placement, the same refusal.
                placed = _placed_as_transformers_renders(reference, template, messages, add_generation_prompt,
                                                         variables)
                if placed is None:
                    with pytest.raises(ValueError) as refused:
                        ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **variables)
                    assert str(exc) in str(refused.value), (messages, add_generation_prompt)
                else:
                    got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **variables)
                    assert got == placed, (messages, add_generation_prompt)
                continue
            got = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **variables)
            assert got == expected, (messages, add_generation_prompt)
            rendered += 1
    return rendered
