// loom's chat page: one conversation, streamed from /v1/chat/completions.
//
// Images (attached, pasted or dropped) go with the next message as data: URLs in
// OpenAI's image_url parts; the conversation keeps them, so later turns send them again.
//
// Every URL is relative to the page, so the page works under --root-path. Model text
// only ever reaches the DOM as text nodes (renderMarkdown builds elements itself and
// never assigns innerHTML), so nothing a model writes can become markup.
"use strict";

const $ = (id) => document.getElementById(id);
const KEYS = { settings: "loom.settings", conversation: "loom.conversation", apiKey: "loom.apiKey" };
const NUMBER_SETTINGS = { temperature: "temperature", "top-p": "top_p", "max-tokens": "max_tokens", seed: "seed" };
const RENDER_INTERVAL_MS = 40;

let conversation = readJson(sessionStorage, KEYS.conversation, []); // [{role, content, images?, ...}]
let attachments = []; // data: URLs of the images the next message sends
let modelName = null;
let controller = null; // the AbortController of the reply being streamed

// ------------------------------------------------------------------ server

function apiUrl(path) {
  // "/llm" and "/llm/" both serve the page under --root-path /llm: resolve against "/llm/".
  const base = location.pathname.endsWith("/") ? location.pathname : location.pathname + "/";
  return new URL(path, location.origin + base).href;
}

function headers() {
  const key = sessionStorage.getItem(KEYS.apiKey);
  return { "Content-Type": "application/json", ...(key ? { Authorization: `Bearer ${key}` } : {}) };
}

class ServerError extends Error {
  constructor(message, status) {
    super(message);
    this.status = status;
  }
}

// The message of OpenAI's error envelope {"error": {"message": ...}}, else the status.
async function serverError(response) {
  const text = await response.text();
  let message = `HTTP ${response.status} ${response.statusText}`;
  try {
    const body = JSON.parse(text);
    message = body.error?.message ?? body.status ?? message;
  } catch {
    if (text.trim()) message += `: ${text.trim().slice(0, 300)}`;
  }
  return new ServerError(message, response.status);
}

function describe(error) {
  if (error instanceof ServerError) return error.message;
  if (error instanceof TypeError) {
    return `Cannot reach the server at ${location.origin}: is loom serve still running? (${error.message})`;
  }
  return `${error.name}: ${error.message}`;
}

// The data of each server-sent event, as a string ("[DONE]" included).
async function* sseData(response) {
  const reader = response.body.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += value;
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      const data = event.split("\n").filter((line) => line.startsWith("data:"))
        .map((line) => line.slice(5).replace(/^ /, "")).join("\n");
      if (data) yield data;
    }
  }
}

async function connect() {
  setStatus("Connecting…");
  try {
    const response = await fetch(apiUrl("v1/models"), { headers: headers() });
    if (response.status === 401) {
      setStatus("This server needs an API key.", true);
      askForKey(sessionStorage.getItem(KEYS.apiKey) ? "The server refused this key." : "");
      return;
    }
    if (response.status === 503) {
      setStatus(`${(await serverError(response)).message} (retrying)`, true);
      setTimeout(connect, 2000);
      return;
    }
    if (!response.ok) throw await serverError(response);
    const model = (await response.json()).data?.[0];
    if (!model) throw new Error("the server lists no model at v1/models");
    modelName = model.id;
    setStatus(model.max_model_len ? `${model.id} · context ${model.max_model_len.toLocaleString()} tokens`
                                  : model.id);
  } catch (error) {
    setStatus(describe(error), true);
  }
}

function setStatus(text, problem = false) {
  $("status").textContent = text;
  $("status").classList.toggle("problem", problem);
}

function askForKey(hint) {
  if (hint) $("key-hint").textContent = hint;
  if (!$("key-dialog").open) $("key-dialog").showModal();
}

// ------------------------------------------------------------------ settings

function loadSettings() {
  const saved = readJson(localStorage, KEYS.settings, {});
  for (const id of ["system-prompt", "extra", ...Object.keys(NUMBER_SETTINGS)]) {
    $(id).value = saved[id] ?? "";
    $(id).addEventListener("input", saveSettings);
  }
}

function saveSettings() {
  const values = {};
  for (const id of ["system-prompt", "extra", ...Object.keys(NUMBER_SETTINGS)]) values[id] = $(id).value;
  localStorage.setItem(KEYS.settings, JSON.stringify(values));
  try {
    requestFields();
    $("settings-error").textContent = "";
  } catch (error) {
    $("settings-error").textContent = error.message;
  }
}

// The request's sampling fields from the settings; throws naming a bad one.
function requestFields() {
  const fields = {};
  for (const [id, name] of Object.entries(NUMBER_SETTINGS)) {
    const text = $(id).value.trim();
    if (text === "") continue;
    const value = Number(text);
    if (!Number.isFinite(value)) throw new Error(`${name} must be a number, got "${text}"`);
    fields[name] = value;
  }
  const extra = $("extra").value.trim();
  if (extra) {
    let parsed;
    try {
      parsed = JSON.parse(extra);
    } catch (error) {
      throw new Error(`Extra request fields are not JSON: ${error.message}`);
    }
    if (parsed === null || typeof parsed !== "object" || Array.isArray(parsed)) {
      throw new Error("Extra request fields must be a JSON object, e.g. {\"ignore_eos\": true}");
    }
    Object.assign(fields, parsed);
  }
  return fields;
}

// ------------------------------------------------------------------ conversation

function saveConversation() {
  const withoutViews = (key, value) => (key === "view" ? undefined : value);
  try {
    sessionStorage.setItem(KEYS.conversation, JSON.stringify(conversation, withoutViews));
  } catch {
    // Over the tab's storage quota (images are large): keep the text for a reload.
    const withoutImages = (key, value) => (key === "view" || key === "images" ? undefined : value);
    sessionStorage.setItem(KEYS.conversation, JSON.stringify(conversation, withoutImages));
    setStatus("The images are too large to keep across a reload of this page; the text is kept.", true);
  }
}

// A message as the API takes it: its images (if any) as image_url parts, then its text.
function apiMessage({ role, content, images }) {
  if (!images?.length) return { role, content };
  const parts = images.map((url) => ({ type: "image_url", image_url: { url } }));
  return { role, content: content ? [...parts, { type: "text", text: content }] : parts };
}

function addView(message) {
  const item = element("li", `message ${message.role}`);
  item.append(element("p", "role", message.role === "user" ? "You" : "Assistant"),
              element("div", "content"), element("p", "figures"));
  $("conversation").append(item);
  $("empty").hidden = true;
  message.view = item;
  renderMessage(message);
  return item;
}

function renderMessage(message) {
  const item = message.view;
  const content = item.querySelector(".content");
  item.dataset.state = message.state ?? "done";
  if (message.role === "user") {
    content.replaceChildren();
    if (message.images?.length) {
      const images = element("div", "images");
      message.images.forEach((url, index) => images.append(imageElement(url, `Image ${index + 1} sent`)));
      content.append(images);
    }
    content.append(message.content);
  } else {
    renderMarkdown(message.content, content);
    if (message.reasoning) {
      const details = element("details");
      details.append(element("summary", "", "Reasoning"), element("p", "", message.reasoning));
      content.prepend(details);
    }
    const notes = { stopped: "Stopped.", error: message.error };
    if (notes[message.state]) {
      content.append(element("p", message.state === "error" ? "error-text" : "note", notes[message.state]));
    }
  }
  item.querySelector(".figures").textContent = figuresText(message.figures);
}

function figuresText(figures) {
  if (!figures) return "";
  const parts = [];
  if (figures.ttftMs != null) parts.push(`time to first token ${Math.round(figures.ttftMs)} ms`);
  // Until the server's usage arrives, completion tokens are counted as content chunks: "≈".
  const about = figures.counted ? "≈" : "";
  if (figures.tokensPerS != null) parts.push(`${about}${figures.tokensPerS.toFixed(1)} tokens/s`);
  if (figures.promptTokens != null) parts.push(`prompt ${figures.promptTokens} tokens`);
  if (figures.completionTokens != null) parts.push(`completion ${about}${figures.completionTokens} tokens`);
  return parts.join(" · ");
}

function scrollToEnd() {
  const scroller = $("scroller");
  scroller.scrollTop = scroller.scrollHeight;
}

function newConversation() {
  controller?.abort();
  conversation = [];
  saveConversation();
  $("conversation").replaceChildren();
  $("empty").hidden = false;
  $("prompt").focus();
}

// ------------------------------------------------------------------ images

function imageElement(url, alt) {
  const image = element("img");
  Object.assign(image, { src: url, alt });
  return image;
}

// Read image files into data: URLs for the next message; anything else is refused.
async function attachFiles(files) {
  const images = [...files].filter((file) => file.type.startsWith("image/"));
  if (images.length < files.length) setStatus("Only images can be attached.", true);
  for (const file of images) {
    try {
      attachments.push(await new Promise((resolve, reject) => {
        const reader = new FileReader();
        reader.onload = () => resolve(reader.result);
        reader.onerror = () => reject(reader.error);
        reader.readAsDataURL(file);
      }));
    } catch (error) {
      setStatus(`Cannot read ${file.name}: ${error.message}`, true);
    }
  }
  renderAttachments();
}

function renderAttachments() {
  const list = $("attachments");
  list.replaceChildren(...attachments.map((url, index) => {
    const item = element("li");
    const remove = element("button", "", "×");
    Object.assign(remove, { type: "button", title: "Remove" });
    remove.setAttribute("aria-label", `Remove image ${index + 1}`);
    remove.addEventListener("click", () => {
      attachments.splice(index, 1);
      renderAttachments();
      $("prompt").focus();
    });
    item.append(imageElement(url, `Image ${index + 1} to send`), remove);
    return item;
  }));
  list.hidden = attachments.length === 0;
}

// ------------------------------------------------------------------ sending

async function send(text) {
  if (controller || (!text.trim() && !attachments.length)) return;
  let fields;
  try {
    fields = requestFields();
  } catch (error) {
    setStatus(`Settings: ${error.message}`, true);
    return;
  }
  const system = $("system-prompt").value.trim();
  const user = { role: "user", content: text, ...(attachments.length ? { images: attachments } : {}) };
  const messages = [...(system ? [{ role: "system", content: system }] : []),
                    ...conversation.map(apiMessage), apiMessage(user)];
  const reply = { role: "assistant", content: "", state: "streaming", figures: {} };
  conversation.push(user, reply);
  addView(user);
  addView(reply);
  $("prompt").value = "";
  attachments = [];
  renderAttachments();
  scrollToEnd();
  setBusy(new AbortController());

  // continuous_usage_stats (vLLM's): usage in every chunk where the server sends it.
  const body = { ...(modelName ? { model: modelName } : {}), ...fields, messages, stream: true,
                 stream_options: { include_usage: true, continuous_usage_stats: true } };
  const started = performance.now();
  let firstTokenAt = null, lastTokenAt = null, counted = 0, renderTimer = null;
  const update = () => {
    const figures = reply.figures;
    if (firstTokenAt != null) figures.ttftMs = firstTokenAt - started;
    if (!figures.usage && counted) Object.assign(figures, { completionTokens: counted, counted: true });
    const decoded = (figures.completionTokens ?? counted) - 1;
    if (decoded > 0 && lastTokenAt > firstTokenAt) {
      figures.tokensPerS = decoded / ((lastTokenAt - firstTokenAt) / 1000);
    }
    renderMessage(reply);
    scrollToEnd();
  };
  try {
    const response = await fetch(apiUrl("v1/chat/completions"), {
      method: "POST", headers: headers(), body: JSON.stringify(body), signal: controller.signal });
    if (!response.ok) throw await serverError(response);
    for await (const data of sseData(response)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new ServerError(chunk.error.message);
      const delta = chunk.choices?.[0]?.delta ?? {};
      if (delta.content || delta.reasoning_content) {
        lastTokenAt = performance.now();
        firstTokenAt ??= lastTokenAt;
        counted += 1;
        reply.content += delta.content ?? "";
        reply.reasoning = (reply.reasoning ?? "") + (delta.reasoning_content ?? "");
      }
      if (chunk.usage) {
        Object.assign(reply.figures, { usage: true, counted: false, promptTokens: chunk.usage.prompt_tokens,
                                       completionTokens: chunk.usage.completion_tokens });
      }
      renderTimer ??= setTimeout(() => { renderTimer = null; update(); }, RENDER_INTERVAL_MS);
    }
    reply.state = "done";
  } catch (error) {
    if (error.name === "AbortError") {
      reply.state = "stopped";
    } else {
      reply.state = "error";
      reply.error = describe(error);
      if (error.status === 401) askForKey("The server refused the request: enter its API key, then send again.");
    }
    const turn = conversation.indexOf(user);
    if (!reply.content && turn >= 0) {
      // Nothing came back: take the turn out of the conversation and give the text and
      // the images back.
      conversation.splice(turn, 2);
      user.view.classList.add("failed");
      if (!$("prompt").value) $("prompt").value = text;
      if (!attachments.length && user.images) {
        attachments = user.images;
        renderAttachments();
      }
    }
  } finally {
    clearTimeout(renderTimer);
    update();
    setBusy(null);
    saveConversation();
  }
}

function setBusy(abortController) {
  controller = abortController;
  $("send").hidden = controller != null;
  $("stop").hidden = controller == null;
}

// ------------------------------------------------------------------ markdown

// Fenced code blocks, headings, lists, quotes, paragraphs; inline code, bold, italic and
// http(s) links. Built as elements and text nodes: model text is never parsed as HTML.
function renderMarkdown(text, container) {
  container.replaceChildren();
  const lines = text.split("\n");
  const isBlockStart = (line) => /^\s*(```|~~~|#{1,6}\s|>|[-*+]\s|\d+[.)]\s)/.test(line);
  let i = 0;
  while (i < lines.length) {
    const line = lines[i];
    const fence = line.match(/^\s*(```+|~~~+)\s*([^\s`]*)/);
    if (fence) {
      const code = [];
      for (i += 1; i < lines.length && !lines[i].trim().startsWith(fence[1]); i += 1) code.push(lines[i]);
      i += 1; // the closing fence; a reply still streaming may not have it yet
      container.append(codeBlock(code.join("\n"), fence[2]));
      continue;
    }
    const heading = line.match(/^(#{1,6})\s+(.*)$/);
    if (heading) {
      container.append(inline(element(`h${Math.min(heading[1].length + 2, 6)}`), heading[2]));
      i += 1;
      continue;
    }
    const listKind = /^\s*[-*+]\s/.test(line) ? "ul" : /^\s*\d+[.)]\s/.test(line) ? "ol" : null;
    if (listKind) {
      const list = element(listKind);
      const itemPattern = listKind === "ul" ? /^\s*[-*+]\s+(.*)$/ : /^\s*\d+[.)]\s+(.*)$/;
      for (let match; i < lines.length && (match = lines[i].match(itemPattern)); i += 1) {
        list.append(inline(element("li"), match[1]));
      }
      container.append(list);
      continue;
    }
    if (/^\s*>/.test(line)) {
      const quoted = [];
      for (; i < lines.length && /^\s*>/.test(lines[i]); i += 1) quoted.push(lines[i].replace(/^\s*>\s?/, ""));
      const quote = element("blockquote");
      renderMarkdown(quoted.join("\n"), quote);
      container.append(quote);
      continue;
    }
    if (!line.trim()) {
      i += 1;
      continue;
    }
    const paragraph = [line];
    for (i += 1; i < lines.length && lines[i].trim() && !isBlockStart(lines[i]); i += 1) paragraph.push(lines[i]);
    container.append(inline(element("p"), paragraph.join("\n")));
  }
}

const INLINE = /(`+)([\s\S]+?)\1|\*\*([\s\S]+?)\*\*|\*([^*\s][^*]*?)\*|\[([^\]\n]+)\]\(([^)\s]+)\)/g;

function inline(parent, text) {
  let last = 0;
  for (const match of text.matchAll(INLINE)) {
    parent.append(text.slice(last, match.index));
    last = match.index + match[0].length;
    const [whole, , code, bold, italic, linkText, href] = match;
    if (code !== undefined) parent.append(element("code", "", code));
    else if (bold !== undefined) parent.append(inline(element("strong"), bold));
    else if (italic !== undefined) parent.append(inline(element("em"), italic));
    else if (safeUrl(href)) {
      const link = inline(element("a"), linkText);
      Object.assign(link, { href: safeUrl(href), target: "_blank", rel: "noopener noreferrer" });
      parent.append(link);
    } else parent.append(whole);
  }
  parent.append(text.slice(last));
  return parent;
}

function safeUrl(href) {
  try {
    const url = new URL(href);
    return ["http:", "https:"].includes(url.protocol) ? url.href : null;
  } catch {
    return null;
  }
}

function codeBlock(code, language) {
  const block = element("div", "code");
  const head = element("div", "code-head");
  const copy = element("button", "", "Copy");
  copy.type = "button";
  copy.addEventListener("click", async () => {
    try {
      await navigator.clipboard.writeText(code);
      copy.textContent = "Copied";
    } catch {
      copy.textContent = "Copy failed";
    }
    setTimeout(() => { copy.textContent = "Copy"; }, 1500);
  });
  head.append(element("span", "", language || "code"), copy);
  const pre = element("pre");
  pre.append(element("code", "", code));
  block.append(head, pre);
  return block;
}

// ------------------------------------------------------------------ helpers

function element(tag, className = "", text = null) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text != null) node.textContent = text;
  return node;
}

function readJson(storage, key, fallback) {
  try {
    return JSON.parse(storage.getItem(key)) ?? fallback;
  } catch {
    return fallback;
  }
}

// ------------------------------------------------------------------ wiring

$("composer").addEventListener("submit", (event) => {
  event.preventDefault();
  send($("prompt").value);
});
$("prompt").addEventListener("keydown", (event) => {
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    send($("prompt").value);
  }
});
document.addEventListener("keydown", (event) => {
  if (event.key === "Escape" && controller && !document.querySelector("dialog[open]")) {
    event.preventDefault();
    controller.abort();
  }
});
$("stop").addEventListener("click", () => controller?.abort());
$("attach").addEventListener("click", () => $("image-input").click());
$("image-input").addEventListener("change", async (event) => {
  await attachFiles(event.target.files);
  event.target.value = "";
  $("prompt").focus();
});
$("prompt").addEventListener("paste", (event) => {
  const files = [...(event.clipboardData?.files ?? [])];
  if (files.some((file) => file.type.startsWith("image/"))) {
    event.preventDefault(); // the images, not their file names as text
    attachFiles(files);
  }
});
// Dropped files anywhere on the page attach; the browser would otherwise open them.
const carriesFiles = (event) => event.dataTransfer?.types.includes("Files");
document.addEventListener("dragover", (event) => {
  if (!carriesFiles(event)) return;
  event.preventDefault();
  $("composer").classList.add("dropping");
});
document.addEventListener("dragleave", (event) => {
  if (!event.relatedTarget) $("composer").classList.remove("dropping");
});
document.addEventListener("drop", (event) => {
  $("composer").classList.remove("dropping");
  if (!carriesFiles(event)) return;
  event.preventDefault();
  attachFiles(event.dataTransfer.files);
});
$("new-chat").addEventListener("click", newConversation);
$("open-settings").addEventListener("click", () => $("settings").showModal());
$("key-form").addEventListener("submit", () => {
  sessionStorage.setItem(KEYS.apiKey, $("api-key").value);
  $("api-key").value = "";
  connect();
});

loadSettings();
for (const message of conversation) addView(message);
scrollToEnd();
connect();
$("prompt").focus();
