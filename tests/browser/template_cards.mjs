// The Templates browser's card images: one square JPEG per template, drawn in headless Chromium from
// what workflows/generate.py writes in the template's extra.vidmem.card: the model, the card (VRAM)
// and RAM it is made for, the steps it computes, the files to download, when to pick it. ComfyUI
// 0.8.0's browser shows a pack's template with its file name as title and description, and its
// `<title>.jpg` in a square slot (object-fit: contain): the card is square and its text large
// enough to read at the slot's ~250 px.
//
//   NODE_PATH=/path/to/node_modules node tests/browser/template_cards.mjs --browser /usr/bin/chromium \
//     --workflows workflows [--out workflows]
//
// check_templates.mjs --thumbnails calls writeCards() the same way.
import fs from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";

const SIZE = 600; // the card's layout in CSS px, zoomed to PIXELS: an 800 px JPEG at any device scale
const PIXELS = 800;
const COLORS = {
  wan21: ["#1f4fa8", "#2f6fdc"], wan22: ["#5b2aa8", "#8251e0"], cogvideox: ["#11734a", "#1d9a63"],
  hunyuan15: ["#a8431f", "#dc6a2f"], ltx2: ["#8a1f5e", "#c2347f"],
};

const escape = (text) => String(text ?? "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
const gb = (value) => `${Number(value).toFixed(Number.isInteger(Number(value)) ? 0 : 1)} GB`;

/** The card as a self-contained HTML page (system fonts only, nothing fetched). */
export function cardHtml(card) {
  const [dark, light] = COLORS[card.family] ?? COLORS.wan21;
  const vram = card.vram_gb ? gb(card.vram_gb) : "< 8 GB";
  const badges = [[vram, "VRAM"], ...(card.ram_gb ? [[gb(card.ram_gb), "RAM"]] : [])]
    .map(([value, label]) => `<div class="badge"><b>${escape(value)}</b><span>${label}</span></div>`).join("");
  const row = (label, text) => `<div class="row"><span>${label}</span>${escape(text)}</div>`;
  return `<!doctype html><html><head><meta charset="utf-8"><style>
    * { box-sizing: border-box; margin: 0; }
    html { zoom: ${PIXELS / SIZE}; }
    body { width: ${SIZE}px; height: ${SIZE}px; background: #181b22; color: #eef1f6; overflow: hidden;
           font-family: "DejaVu Sans", "Liberation Sans", Arial, sans-serif; }
    .card { width: ${SIZE}px; height: ${SIZE}px; display: flex; flex-direction: column; }
    .head { background: linear-gradient(135deg, ${dark}, ${light}); padding: 26px 30px 22px; }
    .model { font-size: 62px; font-weight: 700; line-height: 1.05; letter-spacing: -1px; white-space: nowrap; }
    .variant { font-size: 31px; font-weight: 600; line-height: 1.3; opacity: 0.92; margin-top: 6px; white-space: nowrap; }
    .badges { display: flex; gap: 18px; padding: 24px 30px 10px; }
    .badge { flex: 1; background: #262b36; border: 2px solid #3a4152; border-radius: 16px; padding: 10px 18px 12px; }
    .badge b { display: block; font-size: 58px; line-height: 1.1; }
    .badge span { font-size: 26px; color: #aab3c5; }
    .row { font-size: 27px; line-height: 1.3; padding: 5px 30px; color: #dde3ee; white-space: nowrap; }
    .row span { color: #8f9ab0; margin-right: 10px; }
    .pick { margin-top: auto; background: #262b36; border-top: 2px solid #3a4152; padding: 16px 30px 20px;
            font-size: 29px; line-height: 1.25; font-weight: 600; }
    .pick span { display: block; font-size: 22px; font-weight: 400; color: #8f9ab0; margin-bottom: 2px; }
  </style></head><body><div class="card">
    <div class="head"><div class="model" style="font-size: ${card.model.length > 12 ? 50 : 62}px">${escape(card.model)}</div><div class="variant">${escape(card.variant)}</div></div>
    <div class="badges">${badges}</div>
    ${row("runs", card.speed)}${row("shot", card.shot)}${row("needs", card.files)}
    <div class="pick"><span>pick it for</span>${escape(card.pick)}</div>
  </div></body></html>`;
}

/** Every template's card image, `<title>.jpg` in `outDir`; returns [{title, file, bytes, overflow}]. */
export async function writeCards(context, workflowsDir, outDir) {
  const page = await context.newPage();
  const written = [];
  try {
    await page.setViewportSize({ width: PIXELS, height: PIXELS });
    for (const name of fs.readdirSync(workflowsDir).filter((f) => f.endsWith(".json")).sort()) {
      const ui = JSON.parse(fs.readFileSync(path.join(workflowsDir, name), "utf8"));
      const card = ui.extra?.vidmem?.card;
      if (!card) continue;
      await page.setContent(cardHtml(card), { waitUntil: "load" });
      // Text that does not fit its line or the card would be cut: report it.
      const overflow = await page.evaluate(() => [...document.querySelectorAll(".model, .variant, .badge, .row, .pick")]
        .filter((e) => e.scrollWidth > e.clientWidth + 1 || e.getBoundingClientRect().bottom > document.body.getBoundingClientRect().bottom + 1)
        .map((e) => e.textContent.trim()));
      const file = path.join(outDir, `${name.slice(0, -5)}.jpg`);
      await page.screenshot({ path: file, type: "jpeg", quality: 80, clip: { x: 0, y: 0, width: PIXELS, height: PIXELS } });
      written.push({ title: name.slice(0, -5), file, bytes: fs.statSync(file).size, overflow });
    }
  } finally {
    await page.close();
  }
  return written;
}

if (process.argv[1] === fileURLToPath(import.meta.url)) {
  const { values: args } = parseArgs({ options: { browser: { type: "string" }, workflows: { type: "string" }, out: { type: "string" } } });
  const require = createRequire(import.meta.url);
  const { chromium } = require("playwright-core"); // resolved through NODE_PATH (not a repo dependency)
  const browser = await chromium.launch({ executablePath: args.browser, headless: true, args: ["--no-sandbox", "--disable-gpu"] });
  const context = await browser.newContext();
  const written = await writeCards(context, args.workflows, args.out ?? args.workflows);
  await browser.close();
  console.log(JSON.stringify(written, null, 1));
  process.exit(written.some((w) => w.overflow.length) ? 1 : 0);
}
