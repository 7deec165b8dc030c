// The chat page's controller: the conversation on screen, the composer (with its attached images,
// for a model that reads them), and the buttons that send, stop, regenerate, edit, start afresh
// and export.

import { ChatError, fetchModel, streamChat } from "./api.js";
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
  attach: $("attach"),
  attachFile: $("attach-file"),
  attachments: $("attachments"),
};

const state = {
  conversation: loadConversation(),
  modelName: null,
  takesImages: false, // the model reads images: the composer takes them
  attached: [], // the composer's images, as data URLs, sent with the next message
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
    if (message.images?.length) article.insertBefore(imagesElement(message.images), body);
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

// A user message's images, as thumbnails.
function imagesElement(images) {
  const list = document.createElement("ul");
  list.className = "images";
  list.setAttribute("aria-label", "Images");
  images.forEach((url, i) => {
    const item = document.createElement("li");
    const img = document.createElement("img");
    img.src = url;
    img.alt = `Image ${i + 1}`;
    item.append(img);
    list.append(item);
  });
  return list;
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
  for (const { role, content, images } of state.conversation.messages) {
    if (images?.length) {
      // OpenAI's image_url parts, the images before the text (as the chat templates expect them)
      const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
      if (content) parts.push({ type: "text", text: content });
      messages.push({ role, content: parts });
    } else if (content) {
      messages.push({ role, content }); // an answer that failed before any text is left out
    }
  }
  return messages;
}

// Saves the conversation; says so once if the browser's storage cannot hold its images.
let storageWarned = false;
function save() {
  if (saveConversation(state.conversation) || storageWarned) return;
  storageWarned = true;
  showAlert("This browser's storage is full: after a reload the conversation is kept without its images.", "storage");
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
    save();
    render();
  }
}

function send() {
  if (state.running) return;
  const text = view.message.value.trim();
  if (!text && !state.attached.length) {
    showAlert("Type a message first.");
    return;
  }
  const sampling = samplingOrAlert();
  if (!sampling) return;
  view.message.value = "";
  const message = { role: "user", content: text };
  if (state.attached.length) message.images = state.attached;
  setAttached([]);
  state.conversation.messages.push(message);
  save();
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
  setAttached(state.conversation.messages[index].images ?? []);
  state.conversation.messages.splice(index);
  save();
  render();
  view.message.focus();
}

function newChat() {
  const running = state.running;
  state.running = null;
  running?.controller.abort();
  state.conversation = { messages: [] };
  save();
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

// -- attached images ------------------------------------------------------------------------

function setAttached(images) {
  state.attached = images;
  view.attachments.hidden = !images.length;
  view.attachments.replaceChildren(...images.map((url, i) => {
    const item = document.createElement("li");
    const img = document.createElement("img");
    img.src = url;
    img.alt = `Attached image ${i + 1}`;
    const remove = document.createElement("button");
    remove.type = "button";
    remove.className = "remove";
    remove.textContent = "×";
    remove.setAttribute("aria-label", `Remove image ${i + 1}`);
    remove.addEventListener("click", () => setAttached(state.attached.filter((_, j) => j !== i)));
    item.append(img, remove);
    return item;
  }));
}

function readAsDataURL(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}

// Files picked, pasted or dropped: the images among them join the composer's.
async function attachFiles(files) {
  const images = [...files].filter((file) => file.type.startsWith("image/"));
  if (!images.length) {
    if (files.length) showAlert("Only images can be attached.", "attach");
    return;
  }
  if (!state.takesImages) {
    showAlert(`${state.modelName ?? "This model"} reads text only: images cannot be attached.`, "attach");
    return;
  }
  try {
    const urls = await Promise.all(images.map(readAsDataURL));
    setAttached([...state.attached, ...urls]);
    clearAlert("attach");
  } catch (error) {
    showAlert(`The image could not be read: ${error?.message ?? error}`, "attach");
  }
}

async function refreshModelName() {
  try {
    const model = await fetchModel(settings.apiKey);
    state.modelName = model.id;
    state.takesImages = model.takesImages;
    view.attach.hidden = !model.takesImages;
    if (!model.takesImages) setAttached([]);
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
view.attach.addEventListener("click", () => view.attachFile.click());
view.attachFile.addEventListener("change", () => {
  attachFiles(view.attachFile.files);
  view.attachFile.value = ""; // the same file can be picked again
});
view.message.addEventListener("paste", (event) => {
  const files = [...(event.clipboardData?.files ?? [])];
  if (!files.some((file) => file.type.startsWith("image/"))) return; // text pastes as text
  event.preventDefault();
  attachFiles(files);
});
const carriesFiles = (event) => [...(event.dataTransfer?.types ?? [])].includes("Files");
document.addEventListener("dragover", (event) => {
  if (!carriesFiles(event)) return;
  event.preventDefault(); // a dropped file is attached, not opened in place of the page
  view.composer.classList.add("dropping");
});
document.addEventListener("dragleave", (event) => {
  if (event.relatedTarget === null) view.composer.classList.remove("dropping");
});
document.addEventListener("drop", (event) => {
  view.composer.classList.remove("dropping");
  if (!carriesFiles(event)) return;
  event.preventDefault();
  attachFiles(event.dataTransfer.files);
});
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
