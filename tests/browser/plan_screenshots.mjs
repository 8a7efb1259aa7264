// The Memory Strategy's plan as a user sees it: load templates in the real ComfyUI frontend
// (headless Chromium driven by playwright-core), give the Strategy the budgets of the machine the
// template is sized for, and screenshot the node at 70% zoom (the templates' own) and at 100%.
// Checks, per shot: the smallest plan text on screen (font size x zoom), nothing clipped by the
// node (the plan's content fits its widget, the widget fits the node), every row label whole
// (its drawn width within its column).
//
//   NODE_PATH=/path/to/node_modules node tests/browser/plan_screenshots.mjs \
//     --url http://127.0.0.1:8189 --browser /usr/bin/chromium --workflows workflows \
//     --out docs/screenshots --templates "wan21_t2v_1_3b_files:8:16,wan21_t2v_14b_fp8_files:8:32:blocks_to_swap=30"
//
// --templates lists API names with the VRAM and RAM budgets (GiB) to plan for, and optionally
// widget changes (name=value;...: the Strategy's widget of that name, else the loader's, else the Sampler's; such
// a shot is named plan_<name>_changed_<zoom>.png). The plans are
// the host's: run the server with the models the templates name (docs/verification.md says how
// to get real-size plans without real weights). Prints one JSON report; exit 1 on a problem.
import fs from "node:fs";
import { createRequire } from "node:module";
import os from "node:os";
import path from "node:path";
import { parseArgs } from "node:util";

const require = createRequire(import.meta.url);
const { chromium } = require("playwright-core"); // resolved through NODE_PATH (not a repo dependency)

const { values: args } = parseArgs({
  options: { url: { type: "string" }, browser: { type: "string" }, workflows: { type: "string" },
             out: { type: "string" }, templates: { type: "string" } },
});
const VIEWPORT = { width: 1600, height: 1300 }; // a grown Strategy node at 100% whole
const ZOOMS = [0.7, 1.0];
const MIN_TEXT_PX = 10; // "about 10 px on screen" at the templates' zoom

function wanted() {
  return args.templates.split(",").map((spec) => {
    const [name, vram, ram, changes = ""] = spec.split(":");
    const values = Object.fromEntries(changes.split(";").filter(Boolean).map((pair) => {
      const [key, value] = pair.split("=");
      return [key, value === "true" ? true : value === "false" ? false : Number.isNaN(Number(value)) ? value : Number(value)];
    }));
    return { name, vram: Number(vram), ram: Number(ram), values, tag: changes ? "_changed" : "" };
  });
}

function byApiName(name) {
  for (const file of fs.readdirSync(args.workflows).filter((f) => f.endsWith(".json"))) {
    const ui = JSON.parse(fs.readFileSync(path.join(args.workflows, file), "utf8"));
    if (ui.extra?.vidmem?.api === name) return ui;
  }
  throw new Error(`no template with API name ${name}`);
}

async function open(page) {
  await page.goto(args.url, { waitUntil: "domcontentloaded" });
  await page.waitForFunction(() => window.app?.graph && window.app?.extensionManager && window.LiteGraph, null, { timeout: 90000 });
  await page.waitForTimeout(1500);
  await page.evaluate(async () => {
    for (const [id, value] of Object.entries({ "LiteGraph.Canvas.MinFontSizeForLOD": 0, "Comfy.Minimap.Visible": false })) {
      await window.app.extensionManager.setting.set(id, value);
    }
  });
  await dismissDialogs(page);
}

// The first visit with a fresh profile opens the Templates overlay (maybe a little later): close
// every dialog by its close button, else with Escape (as check_templates.mjs does).
async function dismissDialogs(page) {
  await page.waitForTimeout(1500);
  const dialogs = () => page.locator('[role="dialog"]:visible');
  for (let i = 0; i < 5 && await dialogs().count(); i++) {
    const close = dialogs().first().locator('button[aria-label*="close" i], button:has(.pi-times), .p-dialog-close-button').first();
    if (await close.count()) await close.click({ timeout: 2000 }).catch(() => page.keyboard.press("Escape"));
    else await page.keyboard.press("Escape");
    await page.waitForTimeout(400);
  }
  if (await dialogs().count()) throw new Error("a dialog stays open over the graph");
}

// Load the template, set the budgets, wait for the plan to answer at the template's own size.
async function loadWithBudgets(page, ui, vram, ram, values) {
  await page.evaluate(async (ui) => window.app.loadGraphData(structuredClone(ui)), ui);
  await page.evaluate(({ vram, ram, values }) => {
    const strategy = window.app.graph.nodes.find((n) => n.type === "VidMemMemoryStrategy");
    const loader = window.app.graph.nodes.find((n) => /^VidMemLoad(ModelFiles|Pipeline)$/.test(n.type));
    const sampler = window.app.graph.nodes.find((n) => n.type === "VidMemVideoSampler");
    for (const [name, value] of Object.entries({ vram_budget_gb: vram, ram_budget_gb: ram, ...values })) {
      const widget = [strategy, loader, sampler].map((node) => node?.widgets?.find((w) => w.name === name)).find(Boolean);
      widget.value = value;
      widget.callback?.(value);
    }
  }, { vram, ram, values });
  const deadline = Date.now() + 120000;
  let status = "none";
  while (Date.now() < deadline) {
    status = await page.evaluate(() => {
      const node = window.app.graph.nodes.find((n) => n.type === "VidMemMemoryStrategy");
      const element = node.widgets.find((w) => w.name === "vidmem_plan").element;
      return element.dataset.status === "ok" && /GiB RAM/.test(element.textContent) && /of \d/.test(element.textContent)
        ? "ok" : element.dataset.status;
    });
    if (status === "ok" || status === "error") break;
    await page.waitForTimeout(500);
  }
  await page.waitForTimeout(1500); // the node grows to its plan on the next poll
  return status;
}

// Put the Strategy node at the top left at `zoom`; its box on screen, and what the checks measure.
async function frame(page, zoom) {
  return page.evaluate((zoom) => {
    const app = window.app;
    const node = app.graph.nodes.find((n) => n.type === "VidMemMemoryStrategy");
    const canvas = app.canvas;
    canvas.ds.scale = zoom;
    canvas.ds.offset[0] = -node.pos[0] + 90 / zoom;
    canvas.ds.offset[1] = -node.pos[1] + 110 / zoom;
    canvas.setDirty(true, true);
    return node.id;
  }, zoom);
}

async function measure(page, zoom) {
  return page.evaluate((zoom) => {
    const app = window.app;
    const node = app.graph.nodes.find((n) => n.type === "VidMemMemoryStrategy");
    const widget = node.widgets.find((w) => w.name === "vidmem_plan");
    const element = widget.element;
    const body = element.querySelector(".vidmem-plan-body");
    const fonts = [];
    for (const e of element.querySelectorAll("*")) {
      if (e.closest("svg")) continue; // measured below, at the drawing's scale
      if ([...e.childNodes].some((c) => c.nodeType === 3 && c.textContent.trim())) {
        fonts.push(parseFloat(getComputedStyle(e).fontSize) * zoom);
      }
    }
    // SVG text sizes: font-size in drawing units x the drawing's scale on the page (which includes the zoom).
    const chart = element.querySelector("svg");
    let labelsCut = [];
    if (chart) {
      const box = chart.getBoundingClientRect();
      const unit = box.width / chart.viewBox.baseVal.width;
      fonts.push(parseFloat(getComputedStyle(chart).fontSize) * unit);
      const firstPanel = Math.min(...[...chart.querySelectorAll("text")].filter((t) => Number(t.getAttribute("y")) < 20 && t.textContent !== "time")
        .map((t) => Number(t.getAttribute("x"))));
      for (const text of chart.querySelectorAll("text")) {
        if (Number(text.getAttribute("x")) > 2 || Number(text.getAttribute("y")) < 20) continue; // row labels only
        if (Number(text.getAttribute("x")) + text.getComputedTextLength() > firstPanel) labelsCut.push(text.textContent);
      }
    }
    const rect = element.getBoundingClientRect();
    const title = window.LiteGraph.NODE_TITLE_HEIGHT ?? 30;
    const nodeBottom = (node.pos[1] + node.size[1] + app.canvas.ds.offset[1]) * app.canvas.ds.scale;
    return {
      zoom, minTextPx: Math.min(...fonts), texts: fonts.length,
      // below the node, or sideways: a line wider than the node (overflow hidden) is cut at its right edge
      contentClipped: body ? body.offsetHeight > element.clientHeight - 4
        || [element, ...element.querySelectorAll("pre")].some((e) => e.scrollWidth > e.clientWidth + 1) : true,
      widgetBelowNode: rect.bottom > nodeBottom + 2, labelsCut,
      nodeBox: { x: (node.pos[0] + app.canvas.ds.offset[0]) * zoom, y: (node.pos[1] - title + app.canvas.ds.offset[1]) * zoom,
                 width: node.size[0] * zoom, height: (node.size[1] + title) * zoom },
      verdict: element.querySelector(".vidmem-plan-verdict")?.textContent ?? "",
      reasons: [...element.querySelectorAll(".vidmem-plan-reasons div")].map((d) => d.textContent),
    };
  }, zoom);
}

async function main() {
  const report = { shots: [], problems: [] };
  const profile = fs.mkdtempSync(path.join(os.tmpdir(), "vidmem-chromium-"));
  const context = await chromium.launchPersistentContext(profile, {
    executablePath: args.browser, headless: true, viewport: VIEWPORT,
    args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"],
  });
  const page = context.pages()[0] ?? await context.newPage();
  try {
    await open(page);
    fs.mkdirSync(args.out, { recursive: true });
    for (const { name, vram, ram, values, tag } of wanted()) {
      const status = await loadWithBudgets(page, byApiName(name), vram, ram, values);
      if (status !== "ok") report.problems.push(`${name}: no plan (status ${status})`);
      for (const zoom of ZOOMS) {
        await dismissDialogs(page);
        await frame(page, zoom);
        await page.waitForTimeout(800);
        const shot = await measure(page, zoom);
        shot.name = name;
        shot.file = path.join(args.out, `plan_${name}${tag}_${Math.round(zoom * 100)}.png`);
        shot.changes = values;
        const box = shot.nodeBox;
        await page.screenshot({ path: shot.file, type: "png", clip: {
          x: Math.max(0, box.x - 10), y: Math.max(0, box.y - 10),
          width: Math.min(VIEWPORT.width - Math.max(0, box.x - 10), box.width + 20),
          height: Math.min(VIEWPORT.height - Math.max(0, box.y - 10), box.height + 20) } });
        report.shots.push(shot);
        if (zoom === 0.7 && shot.minTextPx < MIN_TEXT_PX) report.problems.push(`${name}: plan text ${shot.minTextPx.toFixed(1)} px on screen at 70%`);
        if (shot.contentClipped || shot.widgetBelowNode) report.problems.push(`${name} at ${zoom}: the plan is clipped`);
        if (shot.labelsCut.length) report.problems.push(`${name} at ${zoom}: labels run into the bars: ${shot.labelsCut}`);
      }
      // The table folded under the chart: opened, the node grows to show all of it.
      await page.evaluate(() => { // the plan at the top of the view, at 100%
        const canvas = window.app.canvas;
        const node = window.app.graph.nodes.find((n) => n.type === "VidMemMemoryStrategy");
        const widget = node.widgets.find((w) => w.name === "vidmem_plan");
        canvas.ds.scale = 1;
        canvas.ds.offset[0] = -node.pos[0] + 90;
        canvas.ds.offset[1] = -node.pos[1] - (widget.y ?? widget.last_y ?? 0) + 110; // below the tabs and the name
        canvas.setDirty(true, true);
      });
      await page.waitForTimeout(800);
      await page.locator(".vidmem-plan-details summary").first().click();
      await page.waitForTimeout(1500);
      const opened = await measure(page, 1.0);
      if (opened.contentClipped || opened.widgetBelowNode) report.problems.push(`${name}: the opened table is clipped`);
      opened.name = name;
      opened.file = path.join(args.out, `plan_${name}${tag}_table_100.png`);
      const box = opened.nodeBox, top = 100, bottom = Math.min(VIEWPORT.height, box.y + box.height + 10);
      await page.screenshot({ path: opened.file, type: "png", clip: { x: Math.max(0, box.x - 10), y: top,
        width: box.width + 20, height: bottom - top } });
      report.shots.push(opened);
      await page.evaluate(() => { // closed again for the next template
        for (const details of document.querySelectorAll(".vidmem-plan-details")) details.open = false;
      });
    }
  } finally {
    await context.close();
    fs.rmSync(profile, { recursive: true, force: true });
  }
  console.log(JSON.stringify(report, null, 1));
  process.exit(report.problems.length ? 1 : 0);
}

main().catch((error) => { console.error(error); process.exit(2); });
