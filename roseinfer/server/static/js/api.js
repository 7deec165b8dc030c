// Talks to this server's own OpenAI-compatible routes (same origin only) and turns every way a
// request can fail into a sentence a person can act on.

export class ChatError extends Error {
  constructor(message, status = null) {
    super(message);
    this.status = status; // the HTTP status when the server refused the request
  }
}

function headers(apiKey) {
  const result = { "Content-Type": "application/json" };
  if (apiKey) result.Authorization = `Bearer ${apiKey}`;
  return result;
}

async function send(path, options) {
  let response;
  try {
    response = await fetch(path, options);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ChatError(`Cannot reach the server at ${location.origin}: is it still running?`);
  }
  if (!response.ok) throw new ChatError(await describeFailure(response), response.status);
  return response;
}

async function describeFailure(response) {
  let detail = "";
  try {
    const body = await response.json();
    detail = body?.error?.message ?? body?.detail ?? "";
  } catch {
    // not JSON (a proxy's page, say): the status alone has to do
  }
  let text = `The server answered ${response.status} ${response.statusText}`.trimEnd();
  if (detail) text += `: ${detail}`;
  if (response.status === 401) text += " (enter the server's API key under Settings)";
  return text;
}

// The model this server serves (the first of /v1/models): its id, and whether it reads images
// ("image" among its input_modalities).
export async function fetchModel(apiKey) {
  const response = await send("/v1/models", { headers: headers(apiKey) });
  const body = await response.json();
  const card = body?.data?.[0];
  if (typeof card?.id !== "string") throw new ChatError("The server's /v1/models lists no model.");
  const modalities = Array.isArray(card.input_modalities) ? card.input_modalities : ["text"];
  return { id: card.id, takesImages: modalities.includes("image") };
}

// Server-sent events, one `data:` payload at a time, from a fetch response body.
async function* ssePayloads(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buffer += value.replaceAll("\r\n", "\n");
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event
        .split("\n")
        .filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, ""))
        .join("\n");
      if (data) yield data;
    }
  }
}

// POSTs a streaming chat completion; calls onText(piece) for each piece of the answer as it
// arrives, and onReasoning(piece) for each piece of a thinking model's thinking. Resolves to
// {finishReason, usage}. Rejects with ChatError (said in plain words), or with the AbortError of
// `signal` when the user stops it.
export async function streamChat(request, { apiKey, signal, onText, onReasoning }) {
  const response = await send("/v1/chat/completions", {
    method: "POST",
    headers: headers(apiKey),
    body: JSON.stringify({ ...request, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  let finishReason = null;
  let usage = null;
  try {
    for await (const data of ssePayloads(response.body)) {
      if (data === "[DONE]") return { finishReason, usage };
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ChatError(`The server failed while answering: ${chunk.error.message}`);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices?.[0];
      if (choice?.delta?.reasoning_content) onReasoning(choice.delta.reasoning_content);
      if (choice?.delta?.content) onText(choice.delta.content);
      if (choice?.finish_reason) finishReason = choice.finish_reason;
    }
  } catch (error) {
    if (error instanceof ChatError || error.name === "AbortError") throw error;
    if (signal.aborted) throw signal.reason;
    throw new ChatError(`The answer was cut off: ${error.message}.`);
  }
  throw new ChatError("The answer was cut off: the connection closed before the server finished.");
}
