// Keeps the conversation and the settings in this browser's localStorage, across reloads.

const CONVERSATION_KEY = "roseinfer.chat.conversation";
const SETTINGS_KEY = "roseinfer.chat.settings";

export const DEFAULT_SETTINGS = Object.freeze({
  systemPrompt: "",
  temperature: "0.7",
  topP: "",
  maxTokens: "512",
  seed: "",
  thinkingBudget: "",
  apiKey: "",
});

function read(key) {
  try {
    return JSON.parse(localStorage.getItem(key) ?? "null");
  } catch {
    return null; // unreadable (hand-edited or from an older page): start afresh
  }
}

// A conversation is {messages: [{role: "user" | "assistant", content, images?, reasoning?, figures?}]}
// (images: a user message's attached images as data URLs; reasoning: a thinking model's
// thinking, from a server with --reasoning-parser).
export function loadConversation() {
  const saved = read(CONVERSATION_KEY);
  const messages = Array.isArray(saved?.messages) ? saved.messages : [];
  return {
    messages: messages
      .filter((m) => (m?.role === "user" || m?.role === "assistant") && typeof m.content === "string")
      .map((m) => (m.images === undefined ? m : { ...m, images: imagesOf(m.images) })),
  };
}

function imagesOf(images) {
  const ok = Array.isArray(images) && images.every((url) => typeof url === "string" && url.startsWith("data:image/"));
  return ok ? images : [];
}

// Returns false when the browser's storage is full (images are large): the conversation is then
// kept without its images, which stay on screen until the page is reloaded.
export function saveConversation(conversation) {
  try {
    localStorage.setItem(CONVERSATION_KEY, JSON.stringify(conversation));
    return true;
  } catch {
    const messages = conversation.messages.map(({ images, ...rest }) => rest);
    try {
      localStorage.setItem(CONVERSATION_KEY, JSON.stringify({ ...conversation, messages }));
    } catch {
      // nothing more can be kept
    }
    return false;
  }
}

// Settings are kept as the strings typed, so that a half-typed value survives a reload.
export function loadSettings() {
  const saved = read(SETTINGS_KEY) ?? {};
  const settings = { ...DEFAULT_SETTINGS };
  for (const name of Object.keys(settings)) {
    if (typeof saved[name] === "string") settings[name] = saved[name];
  }
  return settings;
}

export function saveSettings(settings) {
  localStorage.setItem(SETTINGS_KEY, JSON.stringify(settings));
}
