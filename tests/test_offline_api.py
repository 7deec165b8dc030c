"""The offline APIs as users call them: vLLM's LLM.generate / LLM.chat, the seed's OfflineScheduler
and InferenceEngine.generate / stream_generate, on the default model."""

import torch

from roseinfer import OfflineScheduler, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def test_generate_returns_outputs_in_input_order(default_llm):
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    outputs = default_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == prompts
    alone = [default_llm.generate(p, GREEDY, use_tqdm=False)[0] for p in prompts]
    assert [o.outputs[0].text for o in outputs] == [o.outputs[0].text for o in alone]
    assert all(o.outputs[0].finish_reason == "length" and len(o.outputs[0].token_ids) == 12 for o in outputs)
    assert all(o.finished for o in outputs)


def test_prompt_forms_agree(default_llm):
    tokenizer = default_llm.get_tokenizer()
    text = "The three primary colours are"
    ids = tokenizer.encode(text)
    by_text = default_llm.generate(text, GREEDY, use_tqdm=False)[0]
    by_ids = default_llm.generate(prompt_token_ids=ids, sampling_params=GREEDY, use_tqdm=False)[0]
    by_dict = default_llm.generate({"prompt_token_ids": ids}, GREEDY, use_tqdm=False)[0]
    assert by_text.outputs[0].token_ids == by_ids.outputs[0].token_ids == by_dict.outputs[0].token_ids
    assert by_text.prompt_token_ids == ids


def test_stop_string_is_excluded_and_reported(default_llm):
    free = default_llm.generate("1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    text = free.outputs[0].text
    assert " 8" in text, text
    stopped = default_llm.generate(
        "1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=20, stop=[" 8"]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == " 8"
    assert stopped.text == text[: text.index(" 8")]
    kept = default_llm.generate(
        "1, 2, 3, 4, 5,",
        SamplingParams(temperature=0, max_tokens=20, stop=" 8", include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == text[: text.index(" 8") + 2]


def test_stop_token_ids_and_eos(default_llm):
    first = default_llm.generate("1, 2, 3, 4, 5,", GREEDY, use_tqdm=False)[0].outputs[0]
    stop_id = first.token_ids[3]
    stopped = default_llm.generate(
        "1, 2, 3, 4, 5,", SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_id]), use_tqdm=False
    )[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    assert stopped.token_ids == first.token_ids[: first.token_ids.index(stop_id) + 1]

    chat = [{"role": "user", "content": "Say hello."}]
    natural = default_llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    assert natural.finish_reason == "stop" and natural.token_ids[-1] == 2  # <|im_end|>
    assert "<|im_end|>" not in natural.text
    forced = default_llm.chat(
        chat, SamplingParams(temperature=0, max_tokens=len(natural.token_ids) + 3, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert forced.finish_reason == "length"
    assert forced.token_ids[: len(natural.token_ids)] == natural.token_ids


def test_min_tokens_holds_back_eos(default_llm):
    chat = [{"role": "user", "content": "Say hello."}]
    natural = default_llm.chat(chat, SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0].outputs[0]
    longer = default_llm.chat(
        chat, SamplingParams(temperature=0, max_tokens=64, min_tokens=len(natural.token_ids) + 2), use_tqdm=False
    )[0].outputs[0]
    assert len(longer.token_ids) >= len(natural.token_ids) + 2
    assert 2 not in longer.token_ids[:-1]


def test_chat_applies_the_template(default_llm):
    conversations = [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    ]
    outputs = default_llm.chat(conversations, GREEDY, use_tqdm=False)
    tokenizer = default_llm.get_tokenizer()
    for conversation, output in zip(conversations, outputs, strict=True):
        assert output.prompt == tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
        assert output.prompt.endswith("<|im_start|>assistant\n")
    single = default_llm.chat(conversations[0], GREEDY, use_tqdm=False)
    assert single[0].outputs[0].text == outputs[0].outputs[0].text


def test_logprobs_match_transformers(default_llm, hf_default_model):
    params = SamplingParams(temperature=0, max_tokens=5, logprobs=3)
    output = default_llm.generate("The capital of France is", params, use_tqdm=False)[0]
    completion = output.outputs[0]
    ids = output.prompt_token_ids + completion.token_ids
    with torch.no_grad():
        reference = torch.log_softmax(hf_default_model(torch.tensor([ids])).logits[0], -1)
    for step, entry in enumerate(completion.logprobs):
        row = reference[len(output.prompt_token_ids) + step - 1]
        assert entry.token_id == completion.token_ids[step]
        assert abs(entry.logprob - row[entry.token_id].item()) < 1e-3
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
    assert abs(completion.cumulative_logprob - sum(e.logprob for e in completion.logprobs)) < 1e-6


def test_offline_scheduler_joins_new_requests_between_steps(default_engine):
    scheduler = OfflineScheduler(default_engine)
    first = scheduler.add_request("Once upon a time", max_new_tokens=10)
    produced = scheduler.step()
    assert set(produced) == {first}
    second = scheduler.add_request("The best way to learn is", max_new_tokens=10)
    produced = scheduler.step()
    assert set(produced) == {first, second}  # the newcomer joined the running batch
    assert scheduler.has_unfinished()
    texts = scheduler.run()
    assert not scheduler.has_unfinished()
    assert texts[first] == default_engine.generate("Once upon a time", max_new_tokens=10)
    assert texts[second] == default_engine.generate("The best way to learn is", max_new_tokens=10)


def test_stream_generate_pieces_add_up(default_engine):
    prompt = "Write a poem with emoji 🌞 and accents: café, naïve."
    pieces = list(default_engine.stream_generate(prompt, max_new_tokens=40))
    assert len(pieces) > 1
    assert "".join(pieces) == default_engine.generate(prompt, max_new_tokens=40)
    assert not any("\ufffd" in piece for piece in pieces)
