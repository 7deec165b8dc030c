"""`roseinfer export-hf`: the default GGUF model written as a Hugging Face directory loads in
transformers with the same logits and tokens as transformers' own GGUF loading, and in roseinfer."""

import pytest
import torch
import transformers

from roseinfer import LLM, SamplingParams
from roseinfer.models.export import export_gguf_to_hf


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_gguf_to_hf(None, tmp_path_factory.mktemp("export") / "smollm2")


def test_transformers_loads_the_export_like_the_gguf(exported, hf_default_model, smollm_hf_tokenizer,
                                                    chat_prompt_ids):
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    ids = torch.tensor([chat_prompt_ids[1]])
    with torch.no_grad():
        assert (model(ids).logits - hf_default_model(ids).logits).abs().max() < 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(exported)
    text = "Café déjà vu 東京 🙂  spaces\tand code: def f(x): return x**2"
    messages = [{"role": "user", "content": "Hi!"}]
    ours = LLM(str(exported), num_kv_blocks=64)
    assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == \
        ours.get_tokenizer().apply_chat_template(messages)
    assert tokenizer(text)["input_ids"] == smollm_hf_tokenizer(text)["input_ids"] == ours.get_tokenizer().encode(text)


def test_roseinfer_serves_the_export_like_the_gguf(exported, default_llm, chat_prompt_ids):
    params = SamplingParams(temperature=0.0, max_tokens=16)
    ours = LLM(str(exported), num_kv_blocks=64)
    from_export = ours.generate(prompt_token_ids=chat_prompt_ids[:3], sampling_params=params, use_tqdm=False)
    from_gguf = default_llm.generate(prompt_token_ids=chat_prompt_ids[:3], sampling_params=params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in from_export] == [o.outputs[0].token_ids for o in from_gguf]
