"""The chat page at /, end to end: headless Chromium (Debian's, driven by Playwright) against a
live `roseinfer serve` on the default model. Elements are found the way a person (or a screen
reader) finds them: by role and accessible name. Replies are checked against the same request
sent with the official `openai` client."""

from __future__ import annotations

import json
import re
import shutil
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import openai
import pytest
from live_server import ServerProcess, metric
from support import EXACT_FLAGS, QWEN3_THINKING_CHAT_TEMPLATE, tiny_qwen3_thinking_model

playwright_api = pytest.importorskip("playwright.sync_api")
expect = playwright_api.expect

CHROMIUM = "/usr/bin/chromium"
# Without the networking flags Chromium's own background connections fail (and log) here.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
MODEL = "SmolLM2-135M-Instruct"
SERVER_FLAGS = ("--kv-cache-memory", "0.5", *EXACT_FLAGS)  # a few short chats need little
ANSWER_TIMEOUT_MS = 120_000  # a bound for a short answer on a busy 2-core machine, not a timing
RUNNING = "roseinfer:num_requests_running"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    process = ServerProcess(*SERVER_FLAGS)
    yield process
    assert process.stop() == 0, process.output()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def browser():
    if shutil.which(CHROMIUM) is None:
        pytest.fail(f"{CHROMIUM} is missing: `apt-get install -y chromium` (make test does it)")
    with playwright_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser
        browser.close()


class ChatPage:
    """One browser tab on the chat page, with what it logged and requested."""

    def __init__(self, page, base_url: str) -> None:
        self.page = page
        self.base_url = base_url
        self.console_errors: list[str] = []
        self.request_urls: list[str] = []
        self.chat_bodies: list[dict] = []
        page.on("console", lambda message: message.type == "error" and self.console_errors.append(message.text))
        page.on("pageerror", lambda error: self.console_errors.append(str(error)))
        page.on("request", self._record)
        page.set_default_timeout(30_000)

    def _record(self, request) -> None:
        self.request_urls.append(request.url)
        if request.method == "POST" and request.url.endswith("/v1/chat/completions"):
            self.chat_bodies.append(request.post_data_json)

    def open(self) -> ChatPage:
        self.page.goto(self.base_url + "/")
        return self

    def button(self, name: str):
        return self.page.get_by_role("button", name=name, exact=True)

    @property
    def message_box(self):
        return self.page.get_by_role("textbox", name=re.compile("message", re.IGNORECASE))

    @property
    def alert(self):
        return self.page.get_by_role("alert")

    def messages(self):
        return self.page.get_by_role("main", name="Conversation").get_by_role("article")

    def settings(self, **fields: object) -> None:
        """Fill settings by label: settings(Temperature=0, **{"Max tokens": 8})."""
        toggle = self.button("Settings")
        if toggle.get_attribute("aria-expanded") != "true":
            toggle.click()
        for label, value in fields.items():
            self.page.get_by_label(label, exact=True).fill(str(value))
        toggle.click()

    def send(self, text: str) -> None:
        self.message_box.fill(text)
        self.button("Send").click()

    def wait_until_idle(self) -> None:
        expect(self.button("Send")).to_be_visible(timeout=ANSWER_TIMEOUT_MS)

    def ask(self, text: str) -> None:
        self.send(text)
        self.wait_until_idle()

    def export(self) -> dict:
        with self.page.expect_download() as download:
            self.button("Export").click()
        return json.loads(Path(download.value.path()).read_text())

    def contents(self) -> list[str]:
        """The conversation's texts as the page keeps them (through Export)."""
        return [message["content"] for message in self.export()["messages"]]


@pytest.fixture
def chat(browser, server) -> Iterator[ChatPage]:
    """A fresh browser profile (empty localStorage) on the default server's page."""
    context = browser.new_context(viewport={"width": 1000, "height": 800})
    context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.url)
    yield ChatPage(context.new_page(), server.url)
    context.close()


def squeeze(text: str) -> str:
    """Text without whitespace: rendered Markdown and the raw reply differ in line breaks only."""
    return re.sub(r"\s+", "", text)


def reference_reply(client: openai.OpenAI, body: dict) -> openai.types.chat.ChatCompletion:
    """The same request as the page made, without streaming, through the official client."""
    fields = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    return client.chat.completions.create(**fields)


def wait_for_metric(server: ServerProcess, name: str, value: float) -> float:
    deadline = time.monotonic() + 30
    while (current := metric(server, name)) != value and time.monotonic() < deadline:
        time.sleep(0.2)
    return current


# -- loading ---------------------------------------------------------------------------------

def test_the_page_loads_with_no_console_error_and_nothing_from_another_origin(chat, server):
    response = chat.page.goto(server.url + "/")
    assert response.status == 200
    assert "default-src 'none'" in response.headers["content-security-policy"]
    expect(chat.page.get_by_text(MODEL, exact=True)).to_be_visible()  # from /v1/models
    expect(chat.message_box).to_be_editable()
    for name in ("Send", "Regenerate", "New chat", "Export", "Settings"):
        expect(chat.button(name)).to_be_visible()
    chat.button("Settings").click()
    for label in ("System prompt", "Temperature", "Top-p", "Max tokens", "Seed", "API key"):
        expect(chat.page.get_by_label(label, exact=True)).to_be_editable()
    chat.page.wait_for_load_state("networkidle")
    assert chat.console_errors == []
    origins = {f"{urlsplit(url).scheme}://{urlsplit(url).netloc}" for url in chat.request_urls}
    assert origins == {server.url}, chat.request_urls
    assert any(url.endswith("/v1/models") for url in chat.request_urls)


def test_a_text_model_offers_no_image_attachment(chat):
    """test_vision_server.py attaches images on a vision-language model's page; on a text model's
    there is no Attach button, and a dropped image is refused in words, not sent."""
    chat.open()
    expect(chat.page.get_by_text(MODEL, exact=True)).to_be_visible()  # /v1/models has answered
    expect(chat.button("Attach image")).to_be_hidden()
    chat.page.evaluate("""() => {
        const data = new DataTransfer();
        data.items.add(new File([new Uint8Array([137, 80, 78, 71])], "a.png", {type: "image/png"}));
        for (const kind of ["dragover", "drop"]) {
            document.querySelector("main").dispatchEvent(
                new DragEvent(kind, {dataTransfer: data, bubbles: true, cancelable: true}));
        }
    }""")
    expect(chat.alert).to_contain_text(f"{MODEL} reads text only: images cannot be attached")
    expect(chat.page.get_by_role("list", name="Attached images")).to_be_hidden()
    assert chat.console_errors == []


def test_phone_sized_and_dark_mode(browser, server):
    context = browser.new_context(viewport={"width": 375, "height": 700}, color_scheme="dark",
                                  is_mobile=True, has_touch=True)
    page = context.new_page()
    page.goto(server.url + "/")
    for name in ("Send", "Regenerate", "New chat", "Export", "Settings"):
        button = page.get_by_role("button", name=name, exact=True)
        expect(button).to_be_in_viewport()
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    red, green, blue = (int(part) for part in re.findall(r"\d+", background)[:3])
    assert red + green + blue < 3 * 64, f"not a dark background: {background}"
    context.close()


def test_disable_web_ui_turns_the_page_off():
    process = ServerProcess("--disable-web-ui", *SERVER_FLAGS)
    try:
        assert httpx.get(process.url + "/").status_code == 404
        assert httpx.get(process.url + "/static/js/chat.js").status_code == 404
        assert httpx.get(process.url + "/health").status_code == 200
    finally:
        assert process.stop() == 0


# -- chatting --------------------------------------------------------------------------------

def test_a_reply_streams_in_growing_and_equals_the_servers_answer(chat, client):
    chat.open()
    chat.settings(Temperature=0, **{"Max tokens": 16})
    # Record the answer's text (without its heading and figures) at every change on the page.
    chat.page.evaluate("""() => {
        window.seen = [];
        const main = document.querySelector("main");
        new MutationObserver(() => {
            const last = [...main.querySelectorAll("article")].at(-1);
            if (last?.querySelector("h2").textContent !== "Assistant") return;
            const answer = last.cloneNode(true);
            answer.querySelectorAll("h2, [role=note]").forEach((element) => element.remove());
            window.seen.push(answer.textContent);
        }).observe(main, {subtree: true, childList: true, characterData: true});
    }""")
    chat.ask("Write one sentence about the sea.")

    (body,) = chat.chat_bodies
    reference = reference_reply(client, body).choices[0].message.content
    target = squeeze(reference)
    assert len(target) > 20
    shown = [max(n for n in range(len(target) + 1) if target[:n] in squeeze(s)) for s in chat.page.evaluate("seen")]
    partial = {n for n in shown if 0 < n < len(target)}
    assert len(partial) >= 2, f"the reply was not seen growing: {shown}"
    assert shown == sorted(shown) and shown[-1] == len(target)

    user, assistant = chat.messages().all()
    expect(user).to_contain_text("Write one sentence about the sea.")
    figures = assistant.get_by_role("note").inner_text()
    assert re.search(r"TTFT \d+ ms", figures) and re.search(r"\d+\.\d tok/s", figures), figures
    assert chat.contents() == ["Write one sentence about the sea.", reference]
    assert chat.console_errors == []


def test_settings_reach_the_request_body(chat, client):
    chat.open()
    chat.settings(**{"System prompt": "You are a pirate.", "Temperature": 0.5, "Max tokens": 6,
                     "Top-p": 0.9, "Seed": 42})
    chat.ask("Hello there!")
    (body,) = chat.chat_bodies
    assert body["model"] == MODEL and body["stream"] is True
    assert body["messages"] == [{"role": "system", "content": "You are a pirate."},
                                {"role": "user", "content": "Hello there!"}]
    assert (body["temperature"], body["max_tokens"], body["top_p"], body["seed"]) == (0.5, 6, 0.9, 42)
    # Seeded sampling: the server gives the official client the same reply.
    reference = reference_reply(client, body)
    exported = chat.export()
    assert exported["messages"][-1]["content"] == reference.choices[0].message.content
    figures = chat.messages().last.get_by_role("note").inner_text()
    assert f"{reference.usage.completion_tokens} token" in figures
    assert exported["settings"]["systemPrompt"] == "You are a pirate." and "apiKey" not in exported["settings"]


def test_stop_ends_the_generation_and_the_server_frees_it(chat, server):
    chat.open()
    chat.settings(Temperature=0, **{"Max tokens": 400})
    generated_before = metric(server, "roseinfer:generation_tokens_total")
    chat.send("Count from 1 to 200, one number per line.")
    expect(chat.messages().last.get_by_role("note")).to_contain_text("TTFT")  # tokens are arriving
    assert metric(server, RUNNING) == 1
    chat.button("Stop").click()
    chat.wait_until_idle()
    assert wait_for_metric(server, RUNNING, 0) == 0
    figures = chat.messages().last.get_by_role("note").inner_text()
    assert "stopped" in figures
    assert metric(server, "roseinfer:generation_tokens_total") - generated_before < 400
    expect(chat.alert).to_be_hidden()


def test_regenerate_resends_the_same_message_and_edit_changes_it(chat):
    chat.open()
    chat.settings(Temperature=0, **{"Max tokens": 4})
    chat.ask("Name three colours.")
    first_answer = chat.contents()[1]
    chat.button("Regenerate").click()
    chat.wait_until_idle()
    first, again = chat.chat_bodies
    assert again == first
    expect(chat.messages()).to_have_count(2)  # the answer was replaced, not added
    assert chat.contents() == ["Name three colours.", first_answer]  # greedy: the same again

    chat.button("Edit last message").click()
    expect(chat.messages()).to_have_count(0)
    expect(chat.message_box).to_have_value("Name three colours.")
    chat.message_box.fill("Name three animals.")
    chat.button("Send").click()
    chat.wait_until_idle()
    assert chat.chat_bodies[-1]["messages"] == [{"role": "user", "content": "Name three animals."}]
    expect(chat.messages()).to_have_count(2)


def test_a_code_block_renders_as_code_with_a_copy_button(chat, client):
    chat.open()
    chat.settings(Temperature=0, **{"Max tokens": 12})
    chat.ask("Write a Python function that adds two numbers.")
    reference = reference_reply(client, chat.chat_bodies[0]).choices[0].message.content
    assert reference.startswith("```python\n"), f"the model answered without a code block: {reference!r}"
    answer = chat.messages().last
    code = answer.get_by_role("code")
    expect(code).to_have_count(1)
    expected_code = reference.removeprefix("```python\n").split("```")[0]
    assert squeeze(code.inner_text()) == squeeze(expected_code)
    answer.get_by_role("button", name="Copy").click()
    expect(answer.get_by_role("button", name="Copied")).to_be_visible()
    assert chat.page.evaluate("navigator.clipboard.readText()") == code.text_content()


def test_the_conversation_and_settings_survive_a_reload_and_new_chat_clears_them(chat):
    chat.open()
    chat.settings(Temperature=0, **{"Max tokens": 4})
    chat.ask("What is 2 + 2?")
    before = [squeeze(m) for m in chat.messages().all_inner_texts()]
    chat.page.reload()
    expect(chat.messages()).to_have_count(2)
    assert [squeeze(m) for m in chat.messages().all_inner_texts()] == before
    chat.button("Settings").click()
    expect(chat.page.get_by_label("Max tokens", exact=True)).to_have_value("4")
    chat.button("New chat").click()
    expect(chat.messages()).to_have_count(0)
    chat.page.reload()
    expect(chat.messages()).to_have_count(0)
    assert chat.export()["messages"] == []


def test_markup_in_messages_is_shown_as_text_and_never_runs(chat):
    chat.open()
    chat.settings(**{"Max tokens": 1})
    attack = '<img src="/pwned.png" onerror="window.pwned = 1"><script>window.pwned = 2</script> **not bold**'
    chat.ask(attack)
    user = chat.messages().first
    expect(user).to_contain_text(attack)  # literally, as typed
    # Markdown the model might write, through the page's own renderer.
    rendered = chat.page.evaluate("""async () => {
        const { renderMarkdown } = await import("/static/js/markdown.js");
        const host = document.createElement("div");
        host.append(renderMarkdown([
            '<img src=/pwned.png onerror="window.pwned = 3">', "<script>window.pwned = 4</script>",
            "[link](javascript:window.pwned=5)", "![picture](http://example.com/a.png)",
            '<a href="#" onclick="window.pwned = 6">raw link</a>', "**bold**",
            "```js\\nwindow.pwned = 7\\n```",
        ].join("\\n\\n")));
        document.body.append(host);
        await new Promise((resolve) => setTimeout(resolve, 100));
        const links = [...host.querySelectorAll("a")].map((a) => a.getAttribute("href"));
        const handlers = [...host.querySelectorAll("*")].flatMap(
            (el) => [...el.attributes].map((a) => a.name).filter((name) => name.startsWith("on")));
        const result = {
            tags: [...new Set([...host.querySelectorAll("*")].map((el) => el.tagName.toLowerCase()))].sort(),
            links, handlers, text: host.textContent, pwned: window.pwned ?? null,
            code: host.querySelector("pre code").textContent,
            copy: [...host.querySelectorAll("button")].map((b) => b.textContent),
        };
        host.remove();
        return result;
    }""")
    assert rendered["pwned"] is None and rendered["handlers"] == []
    assert not {"img", "script", "iframe", "style"} & set(rendered["tags"]), rendered["tags"]
    assert "strong" in rendered["tags"] and rendered["code"] == "window.pwned = 7\n"
    assert rendered["copy"] == ["Copy"]
    assert all(href is None or not href.startswith("javascript:") for href in rendered["links"])
    assert "http://example.com/a.png" in rendered["links"]  # an image becomes a link, not a fetch
    assert '<img src=/pwned.png onerror="window.pwned = 3">' in rendered["text"]
    assert not any("pwned" in url or "example.com" in url for url in chat.request_urls)


def test_a_thinking_models_thinking_is_folded_above_its_answer(browser, tmp_path):
    tiny_qwen3_thinking_model(tmp_path, QWEN3_THINKING_CHAT_TEMPLATE)  # a tiny random thinking model
    server = ServerProcess("--model", str(tmp_path), "--reasoning-parser", "qwen3", "--max-model-len", "256",
                           "--num-kv-blocks", "64", *EXACT_FLAGS)
    context = browser.new_context(viewport={"width": 1000, "height": 800})
    try:
        chat = ChatPage(context.new_page(), server.url).open()
        chat.settings(Temperature=0, **{"Max tokens": 12, "Thinking budget": 2})
        chat.ask("What is two plus two?")
        (body,) = chat.chat_bodies
        assert body["thinking_token_budget"] == 2
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        fields = {k: v for k, v in body.items() if k not in ("stream", "stream_options", "thinking_token_budget")}
        reference = client.chat.completions.create(**fields, extra_body={"thinking_token_budget": 2}).choices[0].message
        reasoning = reference.model_extra["reasoning_content"]
        assert reasoning and reference.content

        answer = chat.messages().last
        thinking = answer.get_by_role("group")  # a <details>: folded until opened
        expect(thinking).to_have_count(1)
        expect(thinking.get_by_text("Thinking", exact=True)).to_be_visible()
        text = answer.locator(".thinking-text")
        expect(text).to_be_hidden()
        above = "a => a.querySelector('details').compareDocumentPosition(a.querySelector('.body'))"
        assert answer.evaluate(above) & 4  # DOCUMENT_POSITION_FOLLOWING: the answer comes after it
        thinking.get_by_text("Thinking", exact=True).click()
        expect(text).to_be_visible()
        assert text.text_content() == reasoning
        exported = chat.export()["messages"][-1]
        assert (exported["reasoning"], exported["content"]) == (reasoning, reference.content)
        assert chat.console_errors == []
    finally:
        context.close()
        assert server.stop() == 0, server.output()


# -- failures --------------------------------------------------------------------------------

def test_a_server_error_is_shown_with_the_servers_message(chat, server):
    chat.open()
    chat.settings(**{"Max tokens": 100000})  # more than the context holds: the server says 400
    chat.ask("Hello")
    (body,) = chat.chat_bodies
    response = httpx.post(server.url + "/v1/chat/completions", json=body)
    assert response.status_code == 400
    expect(chat.alert).to_contain_text("400")
    expect(chat.alert).to_contain_text(response.json()["error"]["message"])
    expect(chat.messages()).to_have_count(1)  # the question stays, for Regenerate once fixed


def test_a_keyed_server_says_401_until_the_key_is_given_and_a_lost_server_is_reported(browser):
    server = ServerProcess("--api-key", "sesame", *SERVER_FLAGS)
    context = browser.new_context()
    try:
        chat = ChatPage(context.new_page(), server.url)
        response = chat.page.goto(server.url + "/")
        assert response.status == 200  # the page itself needs no key
        expect(chat.alert).to_contain_text("401")  # /v1/models refused
        chat.settings(Temperature=0, **{"Max tokens": 3})
        chat.ask("Hi")
        expect(chat.alert).to_contain_text("401")
        expect(chat.alert).to_contain_text("invalid or missing API key")

        chat.settings(**{"API key": "sesame"})
        expect(chat.page.get_by_text(MODEL, exact=True)).to_be_visible()
        expect(chat.alert).to_be_hidden()
        chat.button("Regenerate").click()
        chat.wait_until_idle()
        expect(chat.alert).to_be_hidden()
        expect(chat.messages()).to_have_count(2)
        expect(chat.messages().last.get_by_role("note")).to_contain_text("TTFT")

        # The server dies while answering: the answer is reported cut off.
        chat.settings(**{"Max tokens": 400})
        chat.send("Count from 1 to 200, one number per line.")
        expect(chat.messages().last.get_by_role("note")).to_contain_text("TTFT")
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(timeout=30)
        chat.wait_until_idle()
        expect(chat.alert).to_contain_text("cut off")
        # And then it is down.
        chat.ask("Are you there?")
        expect(chat.alert).to_contain_text("Cannot reach the server")
    finally:
        context.close()
        if server.process.poll() is None:
            server.stop()
        server.log.close()
