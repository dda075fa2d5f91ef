// SafeSage frontend extension: plain ES module, no build step.
//  - Shows the status text that SafeSageAttention returns (runtime, kernel choice, MLP
//    patches, warnings), and the report of SafeSagePreflight, in a read-only box on the node
//    after it runs.
//  - At a sampling run's end the server sends "safesage.quality" (the quality guard's per-block
//    outcome, safe_ops/quality/report.py), one per SafeSage node that ran; its one-line summary
//    ("last run: blocks 4-5 -> ...") is appended under the status of that node (its ``node``: the
//    node's id, a path of ids for a node inside a subgraph), replacing the previous such line only
//    (the node itself does not run again while ComfyUI has its output cached).
//  - The run statistics panel: a "SafeSage" tab in the sidebar (a bottom-panel tab on a frontend
//    without sidebar tabs, a floating panel on one without either) with GET /safesage/stats as
//    tables -- attention calls by plan, fallbacks with reasons, kernels switched off, the H3 MLP's
//    chunks, the quality guard's last run per block. Refreshed at each run's end (the
//    "safesage.quality" event, ComfyUI's "execution_success") and when opened; the raw JSON only
//    behind its "Copy JSON" button. "SafeSage: show run statistics" (Extensions menu, the node's
//    right-click menu) opens it.
// Everything is defensive: a frontend without some API simply gets less, never an error.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

const NODE_TYPE = "SafeSageAttention";
const TEXT_NODE_TYPES = [NODE_TYPE, "SafeSagePreflight", "SafeSageRaylight"]; // nodes whose ui text is shown on them
const STATUS = "safesage_status";
const STATS_CMD = "SafeSage.ShowStats";
const QUALITY_EVENT = "safesage.quality";
const STATS_URL = "/safesage/stats";
const TAB_ID = "safesage-stats";
const TAB_TITLE = "SafeSage";
const TAB_TOOLTIP = "SafeSage run statistics";
// the step-1 measurement's cost as measured (bench/results/quality_guard_cost_38k_h100.json, an H100 with
// the RTX dispatch emulated, 38k tokens); the node's quality tooltip says the same
const PROBE_COST = "Measuring (step 1 of a model's first prompt) cost 0.46-0.53% of a 20-step prompt, "
  + "4.6-5.3% of a 2-step one, in a ComfyUI that had run a prompt before; 0.78% (7.8%) in its first prompt "
  + "on the RTX 40xx path; a prompt with remembered errors measures nothing (an H100 with the RTX paths "
  + "emulated, 38k tokens; not an RTX card's timing).";

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
  const detail = event?.detail;
  if (detail && typeof detail === "object") {
    panel.quality = detail;
    scheduleRefresh("run end");
  }
  const line = detail?.summary;
  if (typeof line !== "string" || !line) return;
  nodesOfOutcome(detail.node).forEach((n) => showLastRun(n, line));
  console.info("[SafeSage] quality guard,", line);
}

function graphNodes(graph) {
  return graph?._nodes ?? graph?.nodes ?? [];
}

function nodeIn(graph, id) {
  return graph?.getNodeById?.(id) ?? graphNodes(graph).find((n) => String(n.id) === String(id)) ?? null;
}

// The node a quality outcome belongs to: its ``node`` is ComfyUI's id of the SafeSage node that ran,
// for a node inside a subgraph the path of ids through the subgraph nodes ("7:3": node 3 inside the
// subgraph of node 7). An outcome without one (a server before per-node reports, SafeSage run without
// a node) is shown on every SafeSage Attention node of the root graph, as before.
function nodesOfOutcome(id) {
  if (typeof id !== "string" || !id) return graphNodes(app.graph).filter((n) => n.type === NODE_TYPE);
  let graph = app.graph;
  let node = null;
  for (const part of id.split(":")) {
    node = nodeIn(graph, part);
    if (!node) return [];
    graph = node.subgraph;
  }
  return node.type === NODE_TYPE ? [node] : [];
}

function textOf(message) {
  const t = message?.text;
  if (Array.isArray(t)) return t.join("\n");
  return typeof t === "string" ? t : "";
}

function notify(summary, detail, severity = "info") {
  const toast = app.extensionManager?.toast;
  if (toast?.add) toast.add({ severity, summary, detail, life: 4000 });
  else console.info(`[SafeSage] ${summary}: ${detail}`);
}

// ------------------------------------------------------------------ the run statistics panel
const panel = {
  el: null,        // the element the panel is drawn in while it is open
  data: null,      // the last GET /safesage/stats
  quality: null,   // the last safesage.quality event's data (shown until a fetch brings its own)
  error: null,     // why the last fetch failed
  updated: null,   // when data was fetched, and why
  why: "",
  mode: null,      // "sidebar" | "bottom" | "floating": where this frontend shows it
  floating: false, // drawn in the floating panel now
  timer: null,
  fetching: null,
};

// what each plan kind runs (safe_ops/attention/planner.py, override.py)
const PLAN_KINDS = {
  direct: "the kernel, as ComfyUI would call it",
  repack: "a compact copy, then the kernel",
  head_groups: "the kernel on groups of heads",
  query_chunks: "the kernel on query chunks",
  kv_chunks: "the kernel on key chunks, merged by log-sum-exp",
  sdpa: "ComfyUI's own (PyTorch) attention",
  empty: "empty call: nothing to compute",
  other_gpu: "tensors on another GPU: ComfyUI's own attention",
};
const MLP_ROWS = [
  ["calls", "MLP forwards"],
  ["chunked_calls", "run in token chunks"],
  ["chunks", "chunks"],
  ["passthrough", "fit one chunk (ComfyUI's own forward)"],
  ["casts", "weight casts"],
  ["cast_reuses", "casts reused by a chunk"],
  ["memo_dropped", "cast memo dropped"],
  ["own_cast", "layers casting in their own code"],
  ["cast_faults", "faults in the cast memo"],
  ["internal_errors", "SafeSage errors (ComfyUI's MLP ran)"],
];
const MLP_ALWAYS = ["calls", "chunked_calls", "chunks", "passthrough"];
const ERROR_COUNTERS = [
  ["kernel_errors", "kernel raised"],
  ["oom_fallbacks", "out of memory: ComfyUI's attention"],
  ["call_fallbacks", "call failed: ComfyUI's attention"],
  ["probe_failures", "first-call checks failed"],
  ["internal_errors", "SafeSage errors (ComfyUI's attention ran)"],
];

const STYLE = `
.safesage-stats { padding: 8px 10px; font-size: 12px; line-height: 1.35; color: var(--fg-color, #ddd);
  overflow: auto; height: 100%; box-sizing: border-box; }
.safesage-stats h3 { font-size: 13px; margin: 12px 0 4px; font-weight: 600; }
.safesage-stats .ss-head { display: flex; align-items: center; gap: 6px; flex-wrap: wrap; }
.safesage-stats .ss-head h2 { font-size: 14px; margin: 0; flex: 1 0 100%; }
.safesage-stats button { font: inherit; padding: 2px 8px; cursor: pointer; border-radius: 4px;
  color: inherit; background: var(--comfy-input-bg, #333); border: 1px solid var(--border-color, #555); }
.safesage-stats .ss-muted { opacity: 0.7; }
.safesage-stats .ss-error { color: var(--error-text, #ff6b6b); }
.safesage-stats table { border-collapse: collapse; width: 100%; margin: 2px 0 4px; }
.safesage-stats th, .safesage-stats td { text-align: left; padding: 2px 5px 2px 0; vertical-align: top;
  border-bottom: 1px solid var(--border-color, #444); }
.safesage-stats th { font-weight: 600; opacity: 0.8; }
.safesage-stats td.ss-num, .safesage-stats th.ss-num { text-align: right; font-variant-numeric: tabular-nums; }
.safesage-stats tr.ss-moved td { background: rgba(255, 170, 0, 0.14); }
.safesage-stats tr.ss-block td { border-bottom: none; padding-bottom: 0; }
.safesage-stats tr.ss-why td { font-size: 11px; opacity: 0.75; padding-top: 0; }
.safesage-stats .ss-summary { font-weight: 600; margin: 2px 0 4px; }
.safesage-stats details summary { cursor: pointer; }
.safesage-floating { position: fixed; right: 16px; top: 64px; width: 460px; max-height: 75vh; z-index: 1000;
  background: var(--comfy-menu-bg, #222); border: 1px solid var(--border-color, #555); border-radius: 6px;
  box-shadow: 0 4px 16px rgba(0, 0, 0, 0.5); display: flex; flex-direction: column; }
`;

function addStyle() {
  if (document.getElementById("safesage-style")) return;
  const s = document.createElement("style");
  s.id = "safesage-style";
  s.textContent = STYLE;
  document.head.appendChild(s);
}

function h(tag, attrs, ...children) {
  const el = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs ?? {})) {
    if (v == null) continue;
    if (k === "onclick") el.addEventListener("click", v);
    else if (k === "className") el.className = v;
    else el.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c != null) el.append(c instanceof Node ? c : String(c));
  return el;
}

function num(v) {
  return typeof v === "number" && Number.isFinite(v) ? v : 0;
}

function plural(n, what) {
  return `${n} ${what}${n === 1 ? "" : "s"}`;
}

function fmtErr(v) {
  return typeof v === "number" && Number.isFinite(v) ? v.toFixed(3) : "–";
}

function fmtBytes(v) {
  if (typeof v !== "number" || !Number.isFinite(v)) return String(v ?? "–");
  return v >= 2 ** 30 ? `${(v / 2 ** 30).toFixed(2)} GiB` : `${(v / 2 ** 20).toFixed(1)} MiB`;
}

function table(name, head, rows, numeric = []) {
  return h("table", { "data-safesage": name },
    h("thead", null, h("tr", null, head.map((c, i) => h("th", { className: numeric.includes(i) ? "ss-num" : null }, c)))),
    h("tbody", null, rows.map((r) => h("tr", r.attrs ?? null,
      (r.cells ?? r).map((c, i) => h("td", { className: numeric.includes(i) ? "ss-num" : null, title: r.titles?.[i] ?? null }, c))))));
}

function none(text) {
  return h("div", { className: "ss-muted" }, text);
}

function attentionSection(d) {
  const plans = Object.entries(d)
    .filter(([k, v]) => k.startsWith("plan:") && typeof v === "number")
    .map(([k, v]) => [k.slice(5), v])
    .sort((a, b) => b[1] - a[1]);
  const out = [h("h3", null, "Attention calls by plan"),
    h("div", { "data-safesage": "attention-total" },
      `${plural(num(d.attention_calls), "attention call")}, ${plural(num(d.fallbacks), "fallback")}, `
      + plural(num(d.sampling_runs), "sampling run"))];
  if (plans.length) {
    out.push(table("plans", ["plan", "calls", "what runs"],
      plans.map(([k, v]) => [k, v, PLAN_KINDS[k] ?? ""]), [1]));
  } else {
    out.push(none("no attention call guarded yet"));
  }
  const shapes = Object.entries(d.plans ?? {});
  if (shapes.length) {
    out.push(h("details", null, h("summary", null, `plan per call shape (${shapes.length})`),
      table("shapes", ["call shape", "plan"], shapes)));
  }
  return out;
}

function fallbackSection(d) {
  const rows = [];
  for (const [why, n] of Object.entries(d.fallback_reasons ?? {})) rows.push(["attention", why, n]);
  for (const [sec, label] of [["mlp", "H3 MLP"], ["quality", "quality guard"]]) {
    for (const [why, n] of Object.entries(d[sec]?.fallbacks ?? {})) rows.push([label, why, n]);
  }
  for (const [k, label] of ERROR_COUNTERS) if (num(d[k]) > 0) rows.push(["attention", label, d[k]]);
  return [h("h3", null, "Fallbacks"),
    rows.length ? table("fallbacks", ["where", "reason", "calls"], rows, [2]) : none("none: every call ran its plan")];
}

function disabledSection(d) {
  const rows = [
    ...Object.entries(d.disabled_families ?? {}).map(([k, why]) => ["switched off", k, why]),
    ...Object.entries(d.failed_checks ?? {}).map(([k, why]) => ["failed its first-call check", k, why]),
  ];
  return [h("h3", null, "Kernels switched off"),
    rows.length ? table("disabled", ["", "kernel / call class", "why"], rows) : none("none (until ComfyUI restarts)")];
}

function mlpSection(d) {
  const m = d.mlp ?? {};
  const out = [h("h3", null, "MiniMax H3 MLP")];
  if (!num(d.mlp_patched) && !num(m.calls)) {
    out.push(none("no H3 MLP patched in this process (the model is not MiniMax H3, or mlp_chunking is off)"));
    return out;
  }
  const rows = [["MLPs patched", num(d.mlp_patched)]];
  // the chunking counters always; the cast memo's and the error counters where they are not 0
  for (const [k, label] of MLP_ROWS) if (k in m && (MLP_ALWAYS.includes(k) || num(m[k]) > 0)) rows.push([label, num(m[k])]);
  // a peak the store reports (bytes) is shown as such; the counters above are calls
  for (const [k, v] of Object.entries(m)) {
    if (/peak/i.test(k)) rows.splice(3, 0, [`peak (${k})`, /bytes/i.test(k) ? fmtBytes(v) : String(v)]);
  }
  for (const [k, v] of Object.entries(d)) {
    if (/^mlp.*peak/i.test(k)) rows.splice(3, 0, [`peak (${k})`, /bytes/i.test(k) ? fmtBytes(v) : String(v)]);
  }
  out.push(table("mlp", ["", ""], rows, [1]));
  return out;
}

function qualitySection(d) {
  const q = d.quality_last_run ?? panel.quality;
  const out = [h("h3", null, "Quality guard: last run")];
  const blocks = q?.choices?.blocks;
  // every SafeSage node's own last run (two nodes, or nodes inside subgraphs), the latest first below
  const others = Object.values(q?.nodes ?? {}).filter((r) => r?.summary && r.node !== q.node);
  const nodeRows = others.length
    ? [table("quality-nodes", ["node", "last run"],
      [[q.node || "-", q.summary ?? ""], ...others.map((r) => [r.node || "-", r.summary])])]
    : [];
  if (!Array.isArray(blocks) || !blocks.length) {
    // a run that measured nothing says so (its summary); before any run, nothing to show
    out.push(q?.summary ? h("div", { className: "ss-summary", "data-safesage": "quality-summary" }, q.summary)
      : none("no run measured yet (quality is 'faults only', or no sampling run since ComfyUI started)"));
    out.push(...nodeRows);
    return out;
  }
  if (q.summary) out.push(h("div", { className: "ss-summary", "data-safesage": "quality-summary" }, q.summary));
  out.push(...nodeRows);
  // one row per block; its "why" on a row of its own under it (the sidebar is narrow)
  const head = ["block", "planned", "error", "target", "runs now"];
  const numeric = [0, 2, 3];
  const body = [];
  for (const b of blocks) {
    const alt = (b.alternatives ?? []).length ? `where ${b.family} cannot run: ${b.alternatives.join(", ")}` : null;
    // runs_now: what the block's calls run once its chosen family could not (failed its check, switched off)
    const now = b.runs_now && b.runs_now !== b.family ? `${b.runs_now} (${b.family} could not run)` : null;
    const cells = [b.block, b.planned ?? "", fmtErr(b.planned_error), fmtErr(b.target),
      now ?? (b.moved ? `${b.family} (${fmtErr(b.error)})` : (b.family ?? ""))];
    body.push(h("tr", { "data-block": String(b.block), className: b.moved ? "ss-moved ss-block" : "ss-block",
      title: b.call_class ? `class of call: ${b.call_class}` : null },
    cells.map((c, i) => h("td", { className: numeric.includes(i) ? "ss-num" : null, title: i === 4 ? alt : null }, c))));
    body.push(h("tr", { className: b.moved ? "ss-moved ss-why" : "ss-why", "data-why": String(b.block) },
      h("td", null, ""), h("td", { colspan: String(head.length - 1) }, b.why ?? "")));
  }
  out.push(h("table", { "data-safesage": "quality" },
    h("thead", null, h("tr", null, head.map((c, i) => h("th", { className: numeric.includes(i) ? "ss-num" : null }, c)))),
    h("tbody", null, body)));
  if (q.choices.quality) out.push(h("div", { className: "ss-muted" }, `quality: ${q.choices.quality}`));
  // the speed budget, the choices' predicted attention time and where each kernel's speed comes from
  const c = q.choices.cost ?? {};
  if (num(q.choices.budget) > 1) {
    out.push(h("div", { className: "ss-muted", "data-safesage": "quality-budget" },
      `speed budget ${num(q.choices.budget).toFixed(2)}x; predicted attention time ` +
      (c.budget != null ? `${num(c.budget).toFixed(2)}x` : "unknown") +
      (c.safety != null ? `, blocks over target ${num(c.safety).toFixed(2)}x (${c.safety_blocks})` : "") +
      (num(c.unknown) ? `, ${num(c.unknown)} block(s) of unknown speed` : "") +
      (q.choices.source ? `; errors ${q.choices.source === "remembered" ? "remembered from an earlier prompt" : q.choices.source}` : "")));
    for (const src of Object.values(q.choices.speeds ?? {})) {
      out.push(h("div", { className: "ss-muted", "data-safesage": "quality-speed" }, `speed: ${src}`));
    }
  }
  // what measuring costs (bench/results/quality_guard_cost_38k_h100.json; no live timing: that would sync the GPU)
  out.push(h("div", { className: "ss-muted", "data-safesage": "quality-cost" },
    (q.choices.source === "remembered"
      ? "this run measured nothing: its errors were remembered from an earlier prompt on this model. "
      : "") + PROBE_COST));
  const later = q.later;
  if (Array.isArray(later?.blocks) && later.blocks.length) {
    out.push(h("div", { className: "ss-muted", "data-safesage": "quality-later" },
      `step ${later.step} (report only): ` + later.blocks.map((b) => `block ${b.block} ${b.family} ${fmtErr(b.error)}`).join(", ")));
  }
  return out;
}

async function copyJSON(button) {
  const text = JSON.stringify(panel.data ?? {}, null, 2);
  let ok = false;
  try {
    await navigator.clipboard.writeText(text);
    ok = true;
  } catch {
    // no clipboard API (an insecure origin): a hidden textarea and the legacy copy command
    const ta = h("textarea", { style: "position:fixed;left:-9999px;top:0;" }, text);
    document.body.appendChild(ta);
    ta.select();
    try { ok = document.execCommand("copy"); } catch { ok = false; }
    ta.remove();
  }
  if (button) {
    button.textContent = ok ? "Copied" : "Copy failed";
    setTimeout(() => { button.textContent = "Copy JSON"; }, 1500);
  }
  notify(ok ? "SafeSage stats copied" : "SafeSage stats not copied",
    ok ? `${text.length} characters of /safesage/stats JSON` : "the browser refused the clipboard", ok ? "info" : "warn");
}

function build() {
  const d = panel.data;
  const copy = h("button", { "data-safesage": "copy", title: "Copy GET /safesage/stats as JSON (to attach to an issue)" },
    "Copy JSON");
  copy.addEventListener("click", () => copyJSON(copy));
  const head = h("div", { className: "ss-head" },
    h("h2", null, "SafeSage run statistics"),
    h("button", { "data-safesage": "refresh", onclick: () => refresh("refreshed") }, "Refresh"),
    copy);
  if (panel.floating) {
    head.append(h("button", { onclick: () => closeFloating(), title: "Close" }, "×"));
  }
  // the counters are this ComfyUI process's totals, not one run's: said on screen, not only in a tooltip
  const when = panel.updated ? `updated ${panel.updated.toLocaleTimeString()} (${panel.why})` : "loading…";
  const out = [head, h("div", { className: "ss-muted", "data-safesage": "updated",
    title: "the counters are this ComfyUI process's, since it started; the quality guard's table is the last run's" },
    `Totals since ComfyUI started (not per run) · ${when}`)];
  if (panel.error) out.push(h("div", { className: "ss-error", "data-safesage": "error" }, `${STATS_URL}: ${panel.error}`));
  if (d) {
    out.push(...attentionSection(d), ...fallbackSection(d), ...disabledSection(d), ...mlpSection(d), ...qualitySection(d));
  } else if (panel.quality) {
    out.push(...qualitySection({}));
  }
  return out;
}

function draw() {
  if (!panel.el) return;
  try {
    panel.el.replaceChildren(...build());
  } catch (e) {
    console.warn("[SafeSage] could not draw the run statistics:", e);
  }
}

async function fetchStats() {
  const res = await api.fetchApi(STATS_URL, { cache: "no-store" });
  const data = await res.json();
  if (!res.ok) throw new Error(data?.error ?? `HTTP ${res.status}`);
  return data;
}

async function refresh(why) {
  if (panel.fetching) return panel.fetching;
  panel.fetching = (async () => {
    try {
      panel.data = await fetchStats();
      panel.error = null;
    } catch (e) {
      panel.error = String(e?.message ?? e);
    }
    panel.updated = new Date();
    panel.why = why;
    draw();
    panel.fetching = null;
    if (panel.el) panel.el.dataset.safesageRefreshes = String(Number(panel.el.dataset.safesageRefreshes ?? 0) + 1);
  })();
  return panel.fetching;
}

// several run-end events arrive together (safesage.quality, execution_success): one fetch
function scheduleRefresh(why) {
  if (!panel.el) return;
  clearTimeout(panel.timer);
  panel.timer = setTimeout(() => refresh(why), 250);
}

function mount(el) {
  // the sidebar may hand the same element again on a re-render: draw once per element
  if (panel.el === el) return;
  addStyle();
  panel.el = el;
  el.classList.add("safesage-stats");
  el.dataset.safesage = "stats-panel";
  draw();
  refresh("opened");
}

function unmount(el) {
  if (el === undefined || panel.el === el) panel.el = null;
}

function openFloating() {
  let box = document.getElementById("safesage-stats-floating");
  if (!box) {
    addStyle();
    box = h("div", { id: "safesage-stats-floating", className: "safesage-floating" });
    const body = h("div", null);
    box.appendChild(body);
    document.body.appendChild(box);
    panel.floating = true;
    mount(body);
  } else {
    refresh("refreshed");
  }
}

function closeFloating() {
  document.getElementById("safesage-stats-floating")?.remove();
  panel.floating = false;
  unmount();
}

// Register the panel where this frontend has room for it; returns where.
function registerPanel() {
  const em = app.extensionManager;
  const tab = {
    id: TAB_ID, icon: "pi pi-chart-bar", title: TAB_TITLE, tooltip: TAB_TOOLTIP, label: TAB_TITLE,
    type: "custom", render: (el) => mount(el), destroy: () => { if (!panel.floating) unmount(); },
  };
  try {
    if (typeof em?.registerSidebarTab === "function") {
      em.registerSidebarTab(tab);
      return "sidebar";
    }
    const bottom = em?.bottomPanel;
    if (typeof bottom?.registerBottomPanelTab === "function") {
      bottom.registerBottomPanelTab({ ...tab, title: TAB_TOOLTIP });
      return "bottom";
    }
  } catch (e) {
    console.warn("[SafeSage] could not add the run statistics tab; the command opens a floating panel:", e);
  }
  return "floating";
}

async function openStats() {
  const em = app.extensionManager;
  try {
    if (panel.mode === "sidebar") {
      const open = em?.sidebarTab?.activeSidebarTabId === TAB_ID || panel.el?.isConnected;
      if (!open) {
        if (em?.command?.execute) await em.command.execute(`Workspace.ToggleSidebarTab.${TAB_ID}`);
        else if (em?.sidebarTab?.toggleSidebarTab) em.sidebarTab.toggleSidebarTab(TAB_ID);
      }
      if (panel.el) return refresh("refreshed");
    } else if (panel.mode === "bottom") {
      if (!panel.el?.isConnected) await em.command.execute(`Workspace.ToggleBottomPanelTab.${TAB_ID}`);
      if (panel.el) return refresh("refreshed");
    }
  } catch (e) {
    console.warn("[SafeSage] could not open the run statistics tab:", e);
  }
  if (!panel.el?.isConnected) openFloating();
}

app.registerExtension({
  name: "SafeSage.Status",
  commands: [{ id: STATS_CMD, label: "SafeSage: show run statistics", function: openStats }],
  menuCommands: [{ path: ["Extensions", "SafeSage"], commands: [STATS_CMD] }],

  setup() {
    panel.mode = registerPanel();
    // an older frontend without custom websocket events: no last-run line, the panel refreshes when opened
    if (typeof api?.addEventListener === "function") {
      api.addEventListener(QUALITY_EVENT, onQuality);
      api.addEventListener("execution_success", () => scheduleRefresh("run end"));
    }
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
      options?.push?.({ content: "SafeSage: show run statistics", callback: () => openStats() });
      return r;
    };
  },
});

// for tests and other extensions: the panel as it degrades on a frontend without sidebar or
// bottom-panel tabs, and its state
export { openFloating as openFloatingStatsPanel, openStats as openStatsPanel, panel as statsPanel };
