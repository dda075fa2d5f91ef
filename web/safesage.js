// SafeSage frontend extension: plain ES module, no build step.
//  - Shows the status text that SafeSageAttention returns (runtime, kernel choice, MLP
//    patches, warnings), and the report of SafeSagePreflight, in a read-only box on the node
//    after it runs.
//  - "SafeSage: show run statistics" (Extensions menu, and the node's right-click menu)
//    fetches GET /safesage/stats and shows it on every SafeSage node.
//  - At a sampling run's end the server sends "safesage.quality" (the quality guard's per-block
//    outcome, safe_ops/quality/guard.py); its one-line summary ("last run: blocks 4-5 -> ...") is
//    appended under the status on every SafeSage Attention node, replacing the previous such line
//    only (the node itself does not run again while ComfyUI has its output cached).
// Everything is defensive: a frontend without some API simply gets less, never an error.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const NODE_TYPE = "SafeSageAttention";
const TEXT_NODE_TYPES = [NODE_TYPE, "SafeSagePreflight"]; // nodes whose ui text is shown on them
const STATUS = "safesage_status";
const STATS_CMD = "SafeSage.ShowStats";
const QUALITY_EVENT = "safesage.quality";

function statusWidget(node) {
  let w = node.widgets?.find((x) => x.name === STATUS);
  if (w) return w;
  if (typeof node.addDOMWidget === "function") {
    const el = document.createElement("textarea");
    el.readOnly = true;
    el.rows = 8;
    el.style.cssText = "width:100%;font:11px monospace;opacity:0.85;resize:vertical;white-space:pre-wrap;overflow-wrap:anywhere;";
    w = node.addDOMWidget(STATUS, "safesage_status", el, {
      serialize: false, // not a node input: never sent in the prompt
      getValue: () => el.value,
      setValue: (v) => { el.value = v ?? ""; },
    });
    w.safesageElement = el;
  } else {
    w = node.addWidget("text", STATUS, "", () => {}, { serialize: false });
  }
  w.serialize = false; // not stored in the workflow's widgets_values either
  return w;
}

function showOnNode(node, text) {
  try {
    const w = statusWidget(node);
    if (w.safesageElement) w.safesageElement.value = text;
    else w.value = text;
    node.setDirtyCanvas?.(true, true);
  } catch (e) {
    console.warn("[SafeSage] could not show status on the node:", e, "\n" + text);
  }
}

function statusText(node) {
  const w = statusWidget(node);
  return (w.safesageElement ? w.safesageElement.value : w.value) ?? "";
}

// Append `line` under the node's status; a line this added before is replaced, nothing else.
function showLastRun(node, line) {
  try {
    const lines = statusText(node).split("\n");
    const i = node.safesageLastRun ? lines.lastIndexOf(node.safesageLastRun) : -1;
    if (i >= 0) lines.splice(i, 1);
    while (lines.length && lines[lines.length - 1] === "") lines.pop();
    lines.push(line);
    node.safesageLastRun = line;
    showOnNode(node, lines.join("\n"));
    // the status is often taller than its box: scroll to the new line (the status is above it)
    const el = statusWidget(node).safesageElement;
    if (el) el.scrollTop = el.scrollHeight;
  } catch (e) {
    console.warn("[SafeSage] could not show the quality outcome on the node:", e, "\n" + line);
  }
}

function onQuality(event) {
  const line = event?.detail?.summary;
  if (typeof line !== "string" || !line) return;
  const nodes = (app.graph?._nodes ?? app.graph?.nodes ?? []).filter((n) => n.type === NODE_TYPE);
  nodes.forEach((n) => showLastRun(n, line));
  console.info("[SafeSage] quality guard,", line);
}

function textOf(message) {
  const t = message?.text;
  if (Array.isArray(t)) return t.join("\n");
  return typeof t === "string" ? t : "";
}

function notify(summary, detail, severity = "info") {
  const toast = app.extensionManager?.toast;
  if (toast?.add) toast.add({ severity, summary, detail, life: 6000 });
  else console.info(`[SafeSage] ${summary}: ${detail}`);
}

async function showStats() {
  let data;
  try {
    const res = await api.fetchApi("/safesage/stats");
    data = await res.json();
    if (!res.ok) throw new Error(data?.error ?? `HTTP ${res.status}`);
  } catch (e) {
    notify("SafeSage stats unavailable", String(e?.message ?? e), "error");
    return;
  }
  const text = "run statistics (/safesage/stats)\n" + JSON.stringify(data, null, 2);
  const nodes = (app.graph?._nodes ?? app.graph?.nodes ?? []).filter((n) => n.type === NODE_TYPE);
  nodes.forEach((n) => showOnNode(n, text));
  const numbers = Object.entries(data ?? {})
    .filter(([, v]) => typeof v === "number")
    .map(([k, v]) => `${k}: ${v}`)
    .join(", ");
  notify("SafeSage stats", numbers || (nodes.length ? "shown on the SafeSage node" : text));
  console.info("[SafeSage] stats", data);
}

app.registerExtension({
  name: "SafeSage.Status",
  commands: [{ id: STATS_CMD, label: "SafeSage: show run statistics", function: showStats }],
  menuCommands: [{ path: ["Extensions", "SafeSage"], commands: [STATS_CMD] }],

  setup() {
    // an older frontend without custom websocket events simply shows no last-run line
    if (typeof api?.addEventListener === "function") api.addEventListener(QUALITY_EVENT, onQuality);
  },

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!TEXT_NODE_TYPES.includes(nodeData?.name)) return;

    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      const r = onExecuted?.apply(this, arguments);
      const text = textOf(message);
      if (text) showOnNode(this, text);
      return r;
    };

    if (nodeData.name !== NODE_TYPE) return;
    const getExtraMenuOptions = nodeType.prototype.getExtraMenuOptions;
    nodeType.prototype.getExtraMenuOptions = function (canvas, options) {
      const r = getExtraMenuOptions?.apply(this, arguments);
      options?.push?.({ content: "SafeSage: show run statistics", callback: () => showStats() });
      return r;
    };
  },
});
