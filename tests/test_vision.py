"""Images through the engine: a tiny random Idefics3 (SmolVLM's architecture) built by transformers'
own classes, with transformers' own processor. The prompt ids equal the processor's, and the
greedy tokens equal transformers' `generate` on the same processor outputs, with one image and
with two, alone and batched with a text-only request and with another image."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from support import EXACT
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from roseinfer import LLM, SamplingParams
from roseinfer.errors import InvalidRequestError

transformers = pytest.importorskip("transformers")

# SmolVLM's chat template (it reads every message's content as a list of parts).
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<end_of_utterance>", "<fake_token_around_image>", "<image>",
            "<global-img>"] + [f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
CORPUS = ["a picture of the sea and the sky", "What is in this image? Describe it.", "User: Assistant:",
          "red green blue colours shapes", "the quick brown fox jumps over the lazy dog"] * 20
VOCAB = 400


def build_tiny_idefics3(path: Path):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=VOCAB - 8, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path.mkdir(parents=True, exist_ok=True)
    hf_tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<end_of_utterance>", bos_token="<|im_start|>",
        additional_special_tokens=SPECIALS[2:])
    image_token_id = hf_tokenizer.convert_tokens_to_ids("<image>")
    config = transformers.Idefics3Config(
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           patch_size=4, image_size=32),
        text_config=dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=len(hf_tokenizer),
                         max_position_embeddings=2048, eos_token_id=hf_tokenizer.eos_token_id),
        scale_factor=2, image_token_id=image_token_id, eos_token_id=hf_tokenizer.eos_token_id,
    )
    config.text_config.initializer_range = config.initializer_range = 0.1  # logits that differ more
    torch.manual_seed(0)
    model = transformers.Idefics3ForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    image_processor = transformers.Idefics3ImageProcessorPil(size={"longest_edge": 64},
                                                             max_image_size={"longest_edge": 32})
    processor = transformers.Idefics3Processor(image_processor, hf_tokenizer, image_seq_len=16,
                                               chat_template=SMOLVLM_TEMPLATE)
    processor.save_pretrained(path)
    hf_tokenizer.save_pretrained(path)
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = SMOLVLM_TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return model, processor


def image(seed: int, size: tuple[int, int]) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (*size, 3), dtype=np.uint8))


def data_url(picture: Image.Image) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3")
    model, processor = build_tiny_idefics3(path)
    return path, model, processor


def conversation(*pictures: Image.Image, text: str = "What is in this image?") -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pictures]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def reference(model, processor, pictures: list[Image.Image], text: str, max_new_tokens: int):
    """transformers' own processing and greedy generation of the same conversation."""
    messages = [{"role": "user", "content": [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]}]
    prompt = processor.apply_chat_template(messages, add_generation_prompt=True)
    inputs = processor(text=prompt, images=[pictures], return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    prompt_ids = inputs["input_ids"][0].tolist()
    return prompt_ids, out[0, len(prompt_ids):].tolist()


def test_prompts_with_images_generate_the_tokens_transformers_does(vlm):
    path, model, processor = vlm
    one = [image(1, (50, 70))]
    two = [image(2, (30, 20)), image(3, (64, 40))]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm = LLM(str(path), **EXACT, max_num_seqs=4)
    cases = [(one, "What is in this image?"), (two, "Compare the two pictures.")]
    expected = [reference(model, processor, pictures, text, 6) for pictures, text in cases]
    # alone
    for (pictures, text), (prompt_ids, tokens) in zip(cases, expected, strict=True):
        out = llm.chat(conversation(*pictures, text=text), params, use_tqdm=False)[0]
        assert out.prompt_token_ids == prompt_ids
        assert out.outputs[0].token_ids == tokens
    # batched together, and with a text-only request
    text_only = [{"role": "user", "content": "the quick brown fox"}]
    outs = llm.chat([conversation(*one, text=cases[0][1]), text_only, conversation(*two, text=cases[1][1])],
                    params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == expected[0][1]
    assert outs[2].outputs[0].token_ids == expected[1][1]
    alone = llm.chat(text_only, params, use_tqdm=False)[0]
    assert outs[1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_an_image_split_over_prefill_chunks_and_a_cached_conversation_give_the_same_tokens(vlm):
    path, model, processor = vlm
    pictures = [image(4, (60, 60))]
    prompt_ids, tokens = reference(model, processor, pictures, "Describe it.", 5)
    assert len(prompt_ids) > 64
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    # chunks of 32 tokens: each image's placeholders are computed over several steps
    llm = LLM(str(path), **EXACT, max_num_batched_tokens=32, max_num_seqs=2)
    first = llm.chat(conversation(*pictures, text="Describe it."), params, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == tokens
    again = llm.chat(conversation(*pictures, text="Describe it."), params, use_tqdm=False)[0]
    assert again.metrics.num_cached_tokens > 0 and again.outputs[0].token_ids == tokens
    # another image of the same size: the same placeholder ids, but no cached block may be reused
    other = [image(5, (60, 60))]
    other_ids, other_tokens = reference(model, processor, other, "Describe it.", 5)
    assert other_ids == prompt_ids
    out = llm.chat(conversation(*other, text="Describe it."), params, use_tqdm=False)[0]
    assert out.metrics.num_cached_tokens == 0 and out.outputs[0].token_ids == other_tokens


def test_images_for_a_text_model_and_bad_images_are_refused_naming_the_part(vlm, tmp_path):
    path, _, _ = vlm
    llm = LLM(str(path), **EXACT, limit_mm_per_prompt=1)
    with pytest.raises(InvalidRequestError, match="more than 1 image") as caught:
        llm.chat(conversation(image(1, (8, 8)), image(2, (8, 8))), use_tqdm=False)
    assert caught.value.param == "messages[0].content[1]"
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(InvalidRequestError, match="not an image"):
        llm.chat(bad, use_tqdm=False)
    text_model = LLM(**EXACT)
    with pytest.raises(InvalidRequestError, match="takes no images") as caught:
        text_model.chat(conversation(image(1, (8, 8))), use_tqdm=False)
    assert caught.value.param == "messages[0].content[0]"
