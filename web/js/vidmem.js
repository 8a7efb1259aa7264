// vidmem's web extension: receipts on the nodes after they run, a VRAM/RAM meter, "Free VRAM now".
// Official hooks only: registerExtension (beforeRegisterNodeDef chains onExecuted the documented
// way, setup), commands/menuCommands, settings, api.addEventListener. Served by ComfyUI at
// /extensions/vidmem/js/vidmem.js, so ComfyUI's scripts are three levels up.
import { app } from "../../../scripts/app.js";
import { api } from "../../../scripts/api.js";
import { FREE_BODY, MEMORY_ROUTE, NODE_TYPES, meterText, summarize } from "./vidmem_format.js";

const RECEIPT_WIDGET = "vidmem_receipt";
const INTERVAL_SETTING = "VidMem.Meter.IntervalSeconds";
const FREE_COMMAND = "vidmem.freeVram";
const LINE_HEIGHT = 15;

function showSummary(node, nodeType, message) {
  const { title, lines } = summarize(nodeType, message);
  if (!lines.length) return;
  let widget = node.widgets?.find((w) => w.name === RECEIPT_WIDGET);
  if (!widget) {
    const element = document.createElement("div");
    element.className = "vidmem-receipt";
    Object.assign(element.style, {
      whiteSpace: "pre-wrap", font: "11px/15px monospace", padding: "4px 6px", overflow: "auto",
      color: "var(--input-text, #ddd)", background: "var(--comfy-input-bg, #222)", borderRadius: "4px",
    });
    widget = node.addDOMWidget(RECEIPT_WIDGET, "vidmem-receipt", element, {
      serialize: false, // never part of the prompt
      getValue: () => "",
      setValue: () => {},
      getMinHeight: () => (element.dataset.lines || 1) * LINE_HEIGHT + 10,
    });
    widget.serialize = false; // nor of the workflow's widgets_values
  }
  widget.element.dataset.lines = String(lines.length + 1);
  widget.element.textContent = [title, ...lines].join("\n");
  const wanted = node.computeSize();
  node.setSize([Math.max(node.size[0], wanted[0]), Math.max(node.size[1], wanted[1])]);
  app.graph?.setDirtyCanvas(true, true);
}

class Meter {
  constructor() {
    this.element = document.createElement("div");
    this.element.id = "vidmem-meter";
    Object.assign(this.element.style, {
      position: "fixed", left: "64px", bottom: "8px", zIndex: 1000, display: "flex", gap: "8px",
      alignItems: "center", font: "11px monospace", padding: "3px 8px", borderRadius: "6px",
      color: "var(--fg-color, #ddd)", background: "var(--comfy-menu-bg, #353535)", opacity: 0.9,
      border: "1px solid var(--border-color, #4e4e4e)",
    });
    this.label = document.createElement("span");
    this.label.textContent = "vidmem: memory ...";
    const button = document.createElement("button");
    button.textContent = "Free VRAM now";
    button.title = "POST /free: ComfyUI unloads its models and frees cached memory when it is idle";
    Object.assign(button.style, { font: "inherit", cursor: "pointer", padding: "1px 6px" });
    button.addEventListener("click", () => app.extensionManager?.command?.execute(FREE_COMMAND) ?? freeVram());
    this.element.append(this.label, button);
    this.timer = null;
  }

  async refresh() {
    try {
      const response = await api.fetchApi(MEMORY_ROUTE, { cache: "no-store" });
      if (!response.ok) throw new Error(`HTTP ${response.status}`);
      const { text, detail, level } = meterText(await response.json());
      this.label.textContent = text;
      this.element.title = detail;
      this.element.dataset.level = level;
      this.label.style.color = { ok: "", high: "#e5c07b", full: "#e06c75" }[level];
    } catch (error) {
      this.label.textContent = `vidmem: memory n/a (${error.message})`;
    }
  }

  schedule(seconds) {
    clearInterval(this.timer);
    const every = Number(seconds) || 0;
    this.element.style.display = every > 0 ? "flex" : "none";
    if (every > 0) {
      this.timer = setInterval(() => this.refresh(), every * 1000);
      this.refresh();
    }
  }
}

let meter = null;

async function freeVram() {
  const response = await api.fetchApi("/free", {
    method: "POST",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(FREE_BODY),
  });
  const ok = response.ok;
  app.extensionManager?.toast?.add({
    severity: ok ? "info" : "error",
    summary: "VidMem",
    detail: ok ? "ComfyUI unloads its models and frees cached memory as soon as no prompt is running."
      : `POST /free failed: HTTP ${response.status}`,
    life: 4000,
  });
  setTimeout(() => meter?.refresh(), 1500);
  return ok;
}

app.registerExtension({
  name: "vidmem.ui",
  settings: [{
    id: INTERVAL_SETTING,
    category: ["VidMem", "Meter", "Refresh"],
    name: "Memory meter refresh (seconds; 0 hides the meter)",
    type: "number",
    defaultValue: 5,
    attrs: { min: 0, max: 60, step: 1 },
    onChange: (value) => meter?.schedule(value),
  }],
  commands: [{ id: FREE_COMMAND, label: "Free VRAM now (VidMem)", icon: "pi pi-eraser", function: freeVram }],
  menuCommands: [{ path: ["Extensions", "VidMem"], commands: [FREE_COMMAND] }],

  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!NODE_TYPES.includes(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      showSummary(this, nodeData.name, message);
    };
  },

  async setup() {
    meter = new Meter();
    document.body.append(meter.element);
    meter.schedule(app.extensionManager?.setting?.get(INTERVAL_SETTING) ?? 5);
    for (const event of ["execution_success", "execution_error", "execution_interrupted"]) {
      api.addEventListener(event, () => meter.refresh());
    }
  },
});
