// The chat page's controller: the conversation on screen, the composer, and the buttons that
// send, stop, regenerate, edit, start afresh and export.

import { ChatError, fetchModelName, streamChat } from "./api.js";
import { copyCode, renderMarkdown } from "./markdown.js";
import { loadConversation, saveConversation } from "./store.js";
import { SettingsForm } from "./settings.js";

const $ = (id) => document.getElementById(id);
const view = {
  conversation: $("conversation"),
  emptyHint: $("empty-hint"),
  alert: $("alert"),
  composer: $("composer"),
  message: $("message"),
  send: $("send"),
  stop: $("stop"),
  regenerate: $("regenerate"),
  newChat: $("new-chat"),
  exportButton: $("export"),
  settingsToggle: $("settings-toggle"),
  settingsForm: $("settings"),
  modelName: $("model-name"),
};

const state = {
  conversation: loadConversation(),
  modelName: null,
  running: null, // {controller, message, element} while an answer streams
  alertSource: null,
};

// -- alerts ---------------------------------------------------------------------------------

function showAlert(text, source = "chat") {
  view.alert.textContent = text;
  view.alert.hidden = false;
  state.alertSource = source;
}

function clearAlert(source = null) {
  if (source !== null && state.alertSource !== source) return;
  view.alert.hidden = true;
  view.alert.textContent = "";
  state.alertSource = null;
}

// -- the conversation on screen ---------------------------------------------------------------

// "TTFT 150 ms · 25.3 tok/s · 24 tokens": time to first token, then the decode rate (tokens
// after the first over the time since it arrived).
function figuresText(figures) {
  const { ttftMs, tokensPerSecond, tokens, ended } = figures ?? {};
  const parts = [];
  if (Number.isFinite(ttftMs)) parts.push(`TTFT ${Math.round(ttftMs)} ms`);
  if (Number.isFinite(tokensPerSecond)) parts.push(`${tokensPerSecond.toFixed(1)} tok/s`);
  if (Number.isFinite(tokens)) parts.push(`${tokens} token${tokens === 1 ? "" : "s"}`);
  if (typeof ended === "string") parts.push(ended);
  return parts.join(" · ");
}

function messageElement(message, index, lastUserIndex) {
  const article = document.createElement("article");
  article.className = `message ${message.role}`;
  const meta = document.createElement("header");
  meta.className = "meta";
  const who = document.createElement("h2");
  who.className = "who";
  who.textContent = message.role === "user" ? "You" : "Assistant";
  meta.append(who);
  const body = document.createElement("div");
  body.className = "body";
  article.append(meta, body);
  if (message.role === "user") {
    body.textContent = message.content; // shown as typed, never as markup
    if (index === lastUserIndex && !state.running) {
      const edit = document.createElement("button");
      edit.type = "button";
      edit.className = "edit";
      edit.textContent = "Edit";
      edit.setAttribute("aria-label", "Edit last message");
      meta.append(edit);
    }
  } else {
    article.insertBefore(thinkingElement(message.reasoning), body);
    body.replaceChildren(renderMarkdown(message.content));
    const figures = document.createElement("p");
    figures.className = "figures";
    figures.setAttribute("role", "note");
    figures.textContent = figuresText(message.figures);
    article.append(figures);
  }
  return article;
}

// A thinking model's thinking, folded above its answer (hidden when there is none). Plain text:
// it is the model's scratch work, not a formatted reply.
function thinkingElement(reasoning) {
  const details = document.createElement("details");
  details.className = "thinking";
  const summary = document.createElement("summary");
  summary.textContent = "Thinking";
  const text = document.createElement("div");
  text.className = "thinking-text";
  text.textContent = reasoning ?? "";
  details.append(summary, text);
  details.hidden = !reasoning;
  return details;
}

function lastUserIndex() {
  return state.conversation.messages.findLastIndex((m) => m.role === "user");
}

function nearBottom() {
  const el = view.conversation;
  return el.scrollHeight - el.scrollTop - el.clientHeight < 48;
}

function render() {
  const stick = nearBottom();
  const { messages } = state.conversation;
  const lastUser = lastUserIndex();
  const articles = messages.map((m, i) => messageElement(m, i, lastUser));
  view.conversation.replaceChildren(...(messages.length ? articles : [view.emptyHint]));
  if (state.running) state.running.element = articles.at(-1);
  updateButtons();
  if (stick) view.conversation.scrollTop = view.conversation.scrollHeight;
}

let frameRequested = false;

// While an answer streams only its own element is redrawn, at most once a frame.
function renderRunningSoon() {
  if (frameRequested) return;
  frameRequested = true;
  requestAnimationFrame(() => {
    frameRequested = false;
    const running = state.running;
    if (!running) return;
    const stick = nearBottom();
    const thinking = running.element.querySelector(".thinking"); // updated in place: it stays open if opened
    thinking.querySelector(".thinking-text").textContent = running.message.reasoning ?? "";
    thinking.hidden = !running.message.reasoning;
    running.element.querySelector(".body").replaceChildren(renderMarkdown(running.message.content));
    running.element.querySelector(".figures").textContent = figuresText(running.message.figures);
    if (stick) view.conversation.scrollTop = view.conversation.scrollHeight;
  });
}

function updateButtons() {
  const running = Boolean(state.running);
  view.send.hidden = running;
  view.stop.hidden = !running;
  view.regenerate.disabled = running || lastUserIndex() < 0;
}

// -- asking the model -----------------------------------------------------------------------

function requestMessages() {
  const messages = [];
  if (settings.systemPrompt) messages.push({ role: "system", content: settings.systemPrompt });
  for (const { role, content } of state.conversation.messages) {
    if (content) messages.push({ role, content }); // an answer that failed before any text is left out
  }
  return messages;
}

function samplingOrAlert() {
  try {
    return settings.samplingFields();
  } catch (error) {
    showAlert(error.message);
    return null;
  }
}

// Streams an answer to the conversation as it stands (its last message is the user's).
async function answer(sampling) {
  clearAlert();
  const request = { messages: requestMessages(), ...sampling };
  if (state.modelName) request.model = state.modelName;
  const message = { role: "assistant", content: "", figures: null };
  state.conversation.messages.push(message);
  const controller = new AbortController();
  state.running = { controller, message, element: null };
  render();

  const started = performance.now();
  let firstAt = null;
  let lastAt = null;
  let pieces = 0;
  const measure = (tokens, ended = null) => {
    if (firstAt === null) return { ended };
    const seconds = (lastAt - firstAt) / 1000;
    const tokensPerSecond = tokens > 1 && seconds > 0 ? (tokens - 1) / seconds : null;
    return { ttftMs: firstAt - started, tokensPerSecond, tokens, ended };
  };
  try {
    const result = await streamChat(request, {
      apiKey: settings.apiKey,
      signal: controller.signal,
      onText(text) {
        lastAt = performance.now();
        firstAt ??= lastAt;
        pieces += 1;
        message.content += text;
        message.figures = measure(pieces);
        renderRunningSoon();
      },
      onReasoning(text) {
        lastAt = performance.now();
        firstAt ??= lastAt;
        pieces += 1;
        message.reasoning = (message.reasoning ?? "") + text;
        message.figures = measure(pieces);
        renderRunningSoon();
      },
    });
    const ended = result.finishReason === "length" ? "max tokens reached" : null;
    message.figures = measure(result.usage?.completion_tokens ?? pieces, ended);
  } catch (error) {
    if (error.name === "AbortError") {
      message.figures = measure(pieces, "stopped");
    } else {
      if (error instanceof ChatError) showAlert(error.message, error.status === 401 ? "key" : "chat");
      else showAlert(`Something went wrong: ${error.message}`);
      message.figures = measure(pieces, "cut off");
    }
  } finally {
    const { messages } = state.conversation; // (a New chat may have replaced it meanwhile)
    const empty = !message.content && !message.reasoning;
    if (empty && messages.includes(message)) messages.splice(messages.indexOf(message), 1);
    if (state.running?.message === message) state.running = null;
    saveConversation(state.conversation);
    render();
  }
}

function send() {
  if (state.running) return;
  const text = view.message.value.trim();
  if (!text) {
    showAlert("Type a message first.");
    return;
  }
  const sampling = samplingOrAlert();
  if (!sampling) return;
  view.message.value = "";
  state.conversation.messages.push({ role: "user", content: text });
  saveConversation(state.conversation);
  answer(sampling);
}

function regenerate() {
  if (state.running || lastUserIndex() < 0) return;
  const sampling = samplingOrAlert();
  if (!sampling) return;
  const { messages } = state.conversation;
  messages.splice(lastUserIndex() + 1); // drop the answer being replaced
  answer(sampling);
}

// The last user message goes back into the composer; it and its answer leave the conversation.
function editLast() {
  if (state.running) return;
  const index = lastUserIndex();
  if (index < 0) return;
  view.message.value = state.conversation.messages[index].content;
  state.conversation.messages.splice(index);
  saveConversation(state.conversation);
  render();
  view.message.focus();
}

function newChat() {
  const running = state.running;
  state.running = null;
  running?.controller.abort();
  state.conversation = { messages: [] };
  saveConversation(state.conversation);
  clearAlert("chat");
  render();
  view.message.focus();
}

function exportConversation() {
  const data = {
    exported: new Date().toISOString(),
    model: state.modelName,
    settings: settings.exported(),
    messages: state.conversation.messages,
  };
  const url = URL.createObjectURL(new Blob([JSON.stringify(data, null, 2)], { type: "application/json" }));
  const link = document.createElement("a");
  link.href = url;
  link.download = `roseinfer-chat-${data.exported.replaceAll(":", "-").slice(0, 19)}.json`;
  link.click();
  setTimeout(() => URL.revokeObjectURL(url), 1000);
}

async function refreshModelName() {
  try {
    state.modelName = await fetchModelName(settings.apiKey);
    view.modelName.textContent = state.modelName;
    clearAlert("models");
    clearAlert("key"); // the key works now
  } catch (error) {
    state.modelName = null;
    view.modelName.textContent = "model unknown";
    showAlert(error.message, error.status === 401 ? "key" : "models");
  }
}

// -- wiring ---------------------------------------------------------------------------------

let keyTimer = null;
const settings = new SettingsForm(view.settingsForm, (name) => {
  if (name !== "apiKey") return;
  clearTimeout(keyTimer);
  keyTimer = setTimeout(refreshModelName, 300);
});

view.composer.addEventListener("submit", (event) => {
  event.preventDefault();
  send();
});
view.message.addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send();
  }
});
view.stop.addEventListener("click", () => state.running?.controller.abort());
view.regenerate.addEventListener("click", regenerate);
view.newChat.addEventListener("click", newChat);
view.exportButton.addEventListener("click", exportConversation);
view.settingsToggle.addEventListener("click", () => {
  const open = view.settingsForm.hidden;
  view.settingsForm.hidden = !open;
  view.settingsToggle.setAttribute("aria-expanded", String(open));
});
view.conversation.addEventListener("click", (event) => {
  const button = event.target.closest("button");
  if (button?.classList.contains("copy")) copyCode(button);
  if (button?.classList.contains("edit")) editLast();
});

render();
refreshModelName();
if (matchMedia("(pointer: fine)").matches) view.message.focus(); // no keyboard popping up on a phone
