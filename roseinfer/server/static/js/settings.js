// The Settings form: shows the saved settings, saves every edit, and turns them into the
// sampling fields of a chat request.

import { loadSettings, saveSettings } from "./store.js";

const NUMBER_FIELDS = [
  // [form field, request field, label, whole number?]
  ["temperature", "temperature", "Temperature", false],
  ["topP", "top_p", "Top-p", false],
  ["maxTokens", "max_tokens", "Max tokens", true],
  ["seed", "seed", "Seed", true],
  ["thinkingBudget", "thinking_token_budget", "Thinking budget", true],
];

export class SettingsForm {
  constructor(form, onChange) {
    this.form = form;
    this.values = loadSettings();
    for (const [name, value] of Object.entries(this.values)) form.elements[name].value = value;
    form.addEventListener("input", (event) => {
      const name = event.target.name;
      if (!(name in this.values)) return;
      this.values[name] = event.target.value;
      saveSettings(this.values);
      onChange(name);
    });
    form.addEventListener("submit", (event) => event.preventDefault());
  }

  get apiKey() {
    return this.values.apiKey.trim();
  }

  get systemPrompt() {
    return this.values.systemPrompt.trim();
  }

  // The request's sampling fields; empty fields are left out so the server's defaults apply.
  // Throws an Error naming the field when one holds something that is not a usable number
  // (ranges are the server's to check: it answers with a message that names the field).
  samplingFields() {
    const fields = {};
    for (const [name, requestName, label, whole] of NUMBER_FIELDS) {
      const input = this.form.elements[name];
      if (input.validity.badInput) throw new Error(`${label} is not a number; fix it under Settings.`);
      const text = input.value.trim();
      if (text === "") continue;
      const value = Number(text);
      if (!Number.isFinite(value)) throw new Error(`${label} is not a number; fix it under Settings.`);
      if (whole && !Number.isInteger(value)) {
        throw new Error(`${label} must be a whole number, not ${text}; fix it under Settings.`);
      }
      fields[requestName] = value;
    }
    return fields;
  }

  // Settings for an export: everything but the API key.
  exported() {
    const { apiKey: _apiKey, ...rest } = this.values;
    return rest;
  }
}
