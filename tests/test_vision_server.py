"""Images through the server's three APIs, with the official `openai` and `anthropic` clients
against a live `roseinfer serve` on a tiny random Idefics3 (test_vision.py's, built by
transformers' own classes): the prompt ids equal transformers' processor's and the greedy answer
equals transformers' `generate` for the same image, whole and streamed; every bad image is a 400
naming what was wrong, and the server answers the next request."""

from __future__ import annotations

import base64
import struct
import threading
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import openai
import pytest
from live_server import ServerProcess
from support import EXACT_FLAGS
from test_vision import build_tiny_idefics3, data_url, image, reference

MODEL = "tiny-vlm"
LIMIT = 2  # --limit-mm-per-prompt
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = tmp_path_factory.mktemp("idefics3")
    model, processor = build_tiny_idefics3(path)
    return path, model, processor


@pytest.fixture(scope="module")
def pictures(tmp_path_factory) -> Iterator[tuple[str, dict]]:
    """PNG files served over http on 127.0.0.1 (the one host the server may fetch from), and the
    images they hold."""
    folder = tmp_path_factory.mktemp("pictures")
    held = {"one.png": image(11, (40, 56))}
    for name, picture in held.items():
        picture.save(folder / name)
    (folder / "not-an-image.png").write_bytes(b"hello, not a picture")
    http = ThreadingHTTPServer(("127.0.0.1", 0), partial(SimpleHTTPRequestHandler, directory=str(folder)))
    thread = threading.Thread(target=http.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{http.server_address[1]}", held
    http.shutdown()
    http.server_close()


@pytest.fixture(scope="module")
def server(vlm) -> Iterator[ServerProcess]:
    path, _, _ = vlm
    process = ServerProcess("--model", str(path), "--served-model-name", MODEL, *EXACT_FLAGS,
                            "--limit-mm-per-prompt", str(LIMIT), "--allowed-media-domains", "127.0.0.1",
                            "--max-num-seqs", "4", "--kv-cache-memory", "0.05")
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def expected_text(processor, tokens: list[int]) -> str:
    return processor.tokenizer.decode(tokens, skip_special_tokens=True)


def chat_parts(*urls: str, text: str) -> list[dict]:
    return [*({"type": "image_url", "image_url": {"url": url, "detail": "auto"}} for url in urls),
            {"type": "text", "text": text}]


# Greedy, stopping at the model's EOS as transformers' generate does.
GREEDY = dict(temperature=0, max_tokens=MAX_TOKENS)


def test_models_say_the_model_reads_images(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.input_modalities == ["text", "image"]


def test_chat_completions_with_images_equal_transformers(vlm, client, server):
    _, model, processor = vlm
    one, two = [image(1, (50, 70))], [image(2, (30, 20)), image(3, (64, 40))]
    for pictures, text in ((one, "What is in this image?"), (two, "Compare the two pictures.")):
        prompt_ids, tokens = reference(model, processor, pictures, text, MAX_TOKENS)
        messages = [{"role": "user", "content": chat_parts(*map(data_url, pictures), text=text)}]
        # the prompt the chat route feeds: the processor's own ids, placeholders included
        tokenized = httpx.post(server.url + "/tokenize", json={"messages": messages}).json()
        assert tokenized["tokens"] == prompt_ids
        response = client.chat.completions.create(model=MODEL, messages=messages, **GREEDY)
        assert response.choices[0].message.content == expected_text(processor, tokens)
        assert response.usage.prompt_tokens == len(prompt_ids)
        assert response.usage.completion_tokens == len(tokens)
        # streamed: the same answer, piece by piece
        stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True, **GREEDY)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices) == \
            expected_text(processor, tokens)


def test_image_requests_batched_with_others_give_their_own_answers(vlm, client):
    """Sent at once (one engine step holds them): two images of the same size (the same
    placeholder ids, different pixels), and a text-only chat; each answer is its own."""
    _, model, processor = vlm
    cases = [([image(7, (48, 32))], "Describe it."), ([image(8, (48, 32))], "Describe it."), ([], "the quick brown fox")]
    expected = [reference(model, processor, pictures, text, MAX_TOKENS) if pictures else None
                for pictures, text in cases]

    def ask(case):
        pictures, text = case
        content = chat_parts(*map(data_url, pictures), text=text) if pictures else text
        return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}], **GREEDY)

    with ThreadPoolExecutor(len(cases)) as pool:
        answers = list(pool.map(ask, cases))
    for answer, reference_answer in zip(answers[:2], expected[:2], strict=True):
        assert answer.choices[0].message.content == expected_text(processor, reference_answer[1])
    alone = ask(cases[2])
    assert answers[2].choices[0].message.content == alone.choices[0].message.content


def test_an_allowed_http_url_is_fetched(vlm, client, pictures):
    _, model, processor = vlm
    base, held = pictures
    prompt_ids, tokens = reference(model, processor, [held["one.png"]], "Describe it.", MAX_TOKENS)
    response = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": chat_parts(base + "/one.png", text="Describe it.")}],
        **GREEDY)
    assert response.choices[0].message.content == expected_text(processor, tokens)
    assert response.usage.prompt_tokens == len(prompt_ids)


def test_anthropic_image_blocks_equal_transformers(vlm, claude):
    _, model, processor = vlm
    picture = image(4, (48, 48))
    prompt_ids, tokens = reference(model, processor, [picture], "What is in this image?", MAX_TOKENS)
    png = data_url(picture).removeprefix("data:image/png;base64,")
    messages = [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": png}},
        {"type": "text", "text": "What is in this image?"}]}]
    reply = claude.messages.create(model=MODEL, max_tokens=MAX_TOKENS, messages=messages,
                                   extra_body={"temperature": 0})
    assert reply.content[0].text == expected_text(processor, tokens)
    assert reply.usage.output_tokens == len(tokens)
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == len(prompt_ids)
    assert claude.messages.count_tokens(model=MODEL, messages=messages).input_tokens == len(prompt_ids)
    with claude.messages.stream(model=MODEL, max_tokens=MAX_TOKENS, messages=messages,
                                   extra_body={"temperature": 0}) as stream:
        assert "".join(stream.text_stream) == reply.content[0].text


def test_responses_input_image_equals_transformers(vlm, client):
    _, model, processor = vlm
    picture = image(5, (36, 60))
    prompt_ids, tokens = reference(model, processor, [picture], "Describe it.", MAX_TOKENS)
    content = [{"type": "input_image", "image_url": data_url(picture), "detail": "auto"},
               {"type": "input_text", "text": "Describe it."}]
    response = client.responses.create(model=MODEL, input=[{"role": "user", "content": content}],
                                       temperature=0, max_output_tokens=MAX_TOKENS)
    assert response.usage.input_tokens == len(prompt_ids)
    assert response.usage.output_tokens == len(tokens)
    assert response.output_text == expected_text(processor, tokens)
    streamed = client.responses.create(model=MODEL, input=[{"role": "user", "content": content}],
                                       temperature=0, max_output_tokens=MAX_TOKENS, stream=True)
    done = [event for event in streamed if event.type == "response.output_text.done"]
    assert [event.text for event in done] == [response.output_text]
    # a continuation keeps the image in the stored conversation (its placeholders counted again)
    follow = client.responses.create(model=MODEL, previous_response_id=response.id, input="And now?",
                                     temperature=0, max_output_tokens=2)
    assert follow.usage.input_tokens > len(prompt_ids) + response.usage.output_tokens


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose header declares width x height pixels (a decompression bomb's shape), with one
    tiny compressed row: what the pixel limit must refuse before decoding."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 16))
            + chunk(b"IEND", b""))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def bad_chat(client, parts: list[dict], message_index: int = 0) -> openai.BadRequestError:
    messages = [{"role": "user", "content": "hello"}] * message_index + [{"role": "user", "content": parts}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
    return refused.value


def test_bad_images_are_400s_naming_the_part(client, claude, pictures, server):
    base, _ = pictures
    small = data_url(image(6, (8, 8)))
    text = {"type": "text", "text": "What is it?"}
    bomb = "data:image/png;base64," + b64(png_declaring(8000, 8000))
    cases = [  # (parts, the part named, what the message says)
        ([text, {"type": "image_url", "image_url": {"url": "data:image/png;base64," + b64(b"not a picture")}}],
         "messages[1].content[1]", "not an image"),
        ([{"type": "image_url", "image_url": {"url": bomb}}], "messages[1].content[0]", "8000x8000 pixels; the limit is 40000000"),
        ([{"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGVsbG8="}}],
         "messages[1].content[0]", "not an image"),
        ([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}],
         "messages[1].content[0]", "'example.com' is not among the domains"),
        ([{"type": "image_url", "image_url": {"url": "file:///etc/passwd"}}], "messages[1].content[0]",
         "file:// URLs are never fetched"),
        ([{"type": "image_url", "image_url": {"url": base + "/not-an-image.png"}}], "messages[1].content[0]",
         "not an image"),
        ([{"type": "image_url", "image_url": {"url": small}}] * (LIMIT + 1), f"messages[1].content[{LIMIT}]",
         f"more than {LIMIT} image(s)"),
    ]
    for parts, param, says in cases:
        error = bad_chat(client, parts, message_index=1)
        assert error.body["param"] == param, error.body
        assert error.body["message"].startswith(param) and says in error.body["message"], error.body
    # a shape the API does not define is named too
    error = bad_chat(client, [{"type": "image_url", "image_url": {"url": small, "detail": "huge"}}])
    assert "detail" in error.body["message"]
    # Anthropic: named by the block's place in the request as sent (after a system prompt)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64(b"not a picture")}}
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model=MODEL, max_tokens=2, system="Be brief.", messages=[
            {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
            {"role": "user", "content": [{"type": "text", "text": "and this?"}, block]}])
    assert refused.value.body["error"]["message"].startswith("messages[2].content[1]: is not an image")
    for source, says in (({"type": "file", "file_id": "file_1"}, "'file' (the Files API) is not supported"),
                         ({"type": "url", "url": "https://example.com/a.png"}, "'example.com' is not among")):
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(model=MODEL, max_tokens=2, messages=[
                {"role": "user", "content": [{"type": "image", "source": source}]}])
        assert says in refused.value.body["error"]["message"]
    # Responses: named by the part's place in input (after the instructions)
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, instructions="Be brief.", max_output_tokens=2, input=[
            {"role": "user", "content": "hi"},
            {"role": "user", "content": [{"type": "input_image", "image_url": bomb}]}])
    assert refused.value.body["param"] == "input[1].content[0]" and "pixels" in refused.value.body["message"]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, max_output_tokens=2, input=[
            {"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}])
    assert "file_id is not supported" in refused.value.body["message"]
    # the server is unharmed
    response = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": chat_parts(
        small, text="hi")}], max_tokens=2)
    assert response.usage.completion_tokens >= 1
    assert "Traceback" not in server.output()


# -- the chat page ------------------------------------------------------------------------------

DROP = """([selector, name, b64]) => {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    const data = new DataTransfer();
    data.items.add(new File([bytes], name, {type: "image/png"}));
    const target = document.querySelector(selector);
    if (selector === "#message") {
        target.dispatchEvent(new ClipboardEvent("paste", {clipboardData: data, bubbles: true, cancelable: true}));
    } else {
        for (const kind of ["dragover", "drop"]) {
            target.dispatchEvent(new DragEvent(kind, {dataTransfer: data, bubbles: true, cancelable: true}));
        }
    }
}"""


def png_bytes(picture) -> bytes:
    return base64.b64decode(data_url(picture).split(",", 1)[1])


def test_the_chat_page_attaches_picked_pasted_and_dropped_images(vlm, server, client, tmp_path):
    playwright_api = pytest.importorskip("playwright.sync_api")
    from test_web_ui import CHROMIUM, CHROMIUM_FLAGS, ChatPage

    expect = playwright_api.expect
    _, model, processor = vlm
    picked, pasted, dropped = image(21, (40, 40)), image(22, (24, 56)), image(23, (60, 30))
    (tmp_path / "picked.png").write_bytes(png_bytes(picked))
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        chat = ChatPage(browser.new_page(), server.url).open()
        chat.settings(Temperature=0, **{"Max tokens": MAX_TOKENS})
        attach = chat.button("Attach image")
        expect(attach).to_be_visible()  # the model reads images (/v1/models)
        with chat.page.expect_file_chooser() as chooser:
            attach.click()
        chooser.value.set_files(str(tmp_path / "picked.png"))
        chat.page.evaluate(DROP, ["#message", "pasted.png", base64.b64encode(png_bytes(pasted)).decode()])
        chat.page.evaluate(DROP, ["main", "dropped.png", base64.b64encode(png_bytes(dropped)).decode()])
        attached = chat.page.get_by_role("list", name="Attached images").get_by_role("img")
        expect(attached).to_have_count(3)
        chat.button("Remove image 2").click()  # the pasted one goes
        expect(attached).to_have_count(2)
        chat.ask("Compare the two pictures.")

        (body,) = chat.chat_bodies
        parts = body["messages"][-1]["content"]
        assert [part["type"] for part in parts] == ["image_url", "image_url", "text"]
        sent = [base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) for part in parts[:2]]
        assert sent == [png_bytes(picked), png_bytes(dropped)]  # the files' own bytes
        _, tokens = reference(model, processor, [picked, dropped], "Compare the two pictures.", MAX_TOKENS)
        user, assistant = chat.messages().all()
        expect(user.get_by_role("img")).to_have_count(2)  # shown in the conversation
        expect(attached).to_have_count(0)  # the composer is empty again
        assert chat.contents() == ["Compare the two pictures.", expected_text(processor, tokens)]
        # kept across a reload, and sent again by Regenerate
        chat.page.reload()
        expect(chat.messages().first.get_by_role("img")).to_have_count(2)
        chat.button("Regenerate").click()
        chat.wait_until_idle()
        assert chat.chat_bodies[-1]["messages"] == body["messages"]
        assert chat.console_errors == []
        browser.close()
