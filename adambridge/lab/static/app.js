// adambridge-lab page: start and cancel runs, follow the current one, read and compare reports.
// Plain JavaScript, no build step. Report text is always set with textContent, never as HTML.
"use strict";

const TOKEN = new URLSearchParams(location.search).get("token") || "";
const $ = (id) => document.getElementById(id);
let lastRunning = false;

async function api(path, options = {}) {
  const headers = Object.assign({ "X-Lab-Token": TOKEN }, options.headers || {});
  const reply = await fetch(path, Object.assign({}, options, { headers }));
  const body = await reply.json().catch(() => ({ error: `HTTP ${reply.status}` }));
  if (!reply.ok) throw new Error(body.error || `HTTP ${reply.status}`);
  return body;
}

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (key === "text") node.textContent = value;
    else if (key === "class") node.className = value;
    else node.setAttribute(key, value);
  }
  for (const child of children) node.append(child);
  return node;
}

function say(text, kind = "error") {
  const box = $("message");
  box.textContent = text;
  box.className = kind;
  box.hidden = !text;
}

// ------------------------------------------------------------------ presets and runs

let presets = [];

async function loadPresets() {
  const data = await api("api/presets");
  presets = data.presets;
  const select = $("preset");
  select.replaceChildren(...presets.map((p) => el("option", { value: p.name, text: p.name })));
  const box = $("options");
  box.replaceChildren(...Object.entries(data.options).map(([name, help]) =>
    el("label", { title: help }, `${name} `, el("input", { name, "data-option": name }), ` ${help}`)));
  select.addEventListener("change", showPreset);
  showPreset();
}

function showPreset() {
  const preset = presets.find((p) => p.name === $("preset").value);
  if (!preset) return;
  $("preset-description").textContent = `${preset.description} (phases: ${preset.phases.join(", ")})`;
  for (const input of document.querySelectorAll("[data-option]")) {
    const value = preset.defaults[input.dataset.option];
    input.placeholder = value === undefined ? "default" : String(value);
  }
}

async function startRun(event) {
  event.preventDefault();
  const options = {};
  for (const input of document.querySelectorAll("[data-option]")) {
    if (input.value.trim()) options[input.dataset.option] = input.value.trim();
  }
  try {
    const status = await api("api/runs", {
      method: "POST", headers: { "Content-Type": "application/json" },
      body: JSON.stringify({ preset: $("preset").value, options }),
    });
    say("");
    showStatus(status);
  } catch (err) {
    say(`Could not start the run: ${err.message}`);
  }
}

async function cancelRun() {
  try {
    showStatus(await api("api/runs/cancel", { method: "POST" }));
    say("The run was cancelled; its finished phases are in its report.", "info");
  } catch (err) {
    say(`Could not cancel: ${err.message}`);
  }
}

function showStatus(status) {
  const run = status.run;
  if (!run) return;
  $("run-name").textContent = run.name;
  $("state").textContent = run.state;
  $("state").className = `status-${run.state}`;
  $("phase").textContent = phaseText(run);
  $("phase-message").textContent = run.message || "";
  $("progress").value = run.fraction || 0;
  const log = $("log");
  const atEnd = log.scrollTop + log.clientHeight >= log.scrollHeight - 4;
  log.textContent = run.log_tail;
  if (atEnd) log.scrollTop = log.scrollHeight;
  $("cancel").disabled = !run.running;
  $("start").disabled = run.running;
  if (lastRunning && !run.running) loadReports();
  lastRunning = run.running;
}

// Running: the phase it is in. Finished: every phase done, or the one it stopped in (never the
// last phase it reported while running, which would read as if it were still there).
function phaseText(run) {
  const count = run.phases.length;
  if (!run.phase) return run.running ? "-" : `all ${count} done`;
  const where = `${run.phase_index + 1}/${count} ${run.phase}`;
  return run.running ? where : `${where} (${run.state} there)`;
}

async function poll() {
  try {
    showStatus(await api("api/status"));
  } catch (err) {
    say(`Lost the server: ${err.message}`);
  }
  setTimeout(poll, 500);
}

// ------------------------------------------------------------------ reports

async function loadReports() {
  const data = await api("api/reports");
  const rows = data.reports.map((r) => {
    const open = el("a", { href: "#", class: "open-report", "data-name": r.name, text: r.name });
    open.addEventListener("click", (e) => { e.preventDefault(); showReports([r.name]); });
    const tick = el("input", { type: "checkbox", class: "pick", "data-name": r.name });
    tick.addEventListener("change", () => {
      $("compare").disabled = document.querySelectorAll(".pick:checked").length !== 2;
    });
    return el("tr", {}, el("td", {}, tick), el("td", {}, open), el("td", { text: r.preset || "" }),
      el("td", { class: `status-${r.status}`, text: r.status || "" }),
      el("td", { text: r.wall_seconds == null ? "" : String(r.wall_seconds) }),
      el("td", { text: (r.sections || []).join(", ") }));
  });
  document.querySelector("#reports tbody").replaceChildren(...rows);
  $("compare").disabled = true;
}

// One report, or two: [A, B] with A the earlier, their difference above them side by side.
async function showReports(names) {
  const view = $("report-view");
  try {
    const reports = await Promise.all(names.map((n) => api(`api/reports/${encodeURIComponent(n)}`)));
    const panels = reports.map(renderReport);
    if (names.length === 1) {
      view.replaceChildren(panels[0]);
    } else {
      const diff = await api(`api/compare/${names.map(encodeURIComponent).join("/")}`);
      panels.forEach((panel, i) => panel.prepend(el("p", { class: "side", text: "AB"[i] })));
      view.replaceChildren(renderDifference(diff), el("div", { class: "compare" }, ...panels));
    }
    view.scrollIntoView();
  } catch (err) {
    say(`Could not open the report: ${err.message}`);
  }
}

const NUMBER = /^[+-]?\d[\d,.]*\s*(%|x|MiB|GiB|s)?$/;  // right-aligned, as in report.md
const DIFFERENCE = /^[+-]\d/;                            // a cell of B - A

function table(columns, rows, numeric = (text) => NUMBER.test(text)) {
  return el("table", {}, el("thead", {}, el("tr", {}, ...columns.map((c) => el("th", { text: c })))),
    el("tbody", {}, ...rows.map((row) => el("tr", {}, ...row.map((c) =>
      el("td", { text: String(c), class: numeric(String(c)) ? "num" : "" }))))));
}

// The server's comparison (adambridge/lab/compare.py): what differs in the setup, then each
// section both reports have as a table of B - A.
function renderDifference(diff) {
  const box = el("div", { class: "difference" },
    el("h2", { text: `B - A: ${diff.b} against ${diff.a}` }), el("p", { text: diff.note }));
  box.append(diff.facts.length ? table(["setup", "A", "B"], diff.facts)
    : el("p", { text: "Same CPU, backend, threads, versions and options." }));
  for (const note of diff.notes) box.append(el("p", { class: "diff-note", text: note }));
  for (const s of diff.sections) {
    box.append(el("h3", { text: s.title }), table(s.columns, s.rows, (text) => DIFFERENCE.test(text)));
    for (const note of s.notes) box.append(el("p", { class: "diff-note", text: note }));
  }
  return box;
}

function fileUrl(name, file) {
  return `reports/${encodeURIComponent(name)}/${encodeURIComponent(file)}?token=${encodeURIComponent(TOKEN)}`;
}

function renderReport(report) {
  const facts = [["cpu", `${report.machine.cpu} (${report.machine.cpus} CPUs)`],
    ["backend", report.isa.backend || "?"], ["isa", report.isa["isa active"] || "-"],
    ["threads", `${report.threads.native} native, ${report.threads.torch} torch`],
    ["versions", `adambridge ${report.versions.adambridge}, torch ${report.versions.torch}`],
    ["created", report.created], ["status", report.status],
    ["options", Object.entries(report.options || {}).filter(([, v]) => v !== null)
      .map(([k, v]) => `${k}=${Array.isArray(v) ? v.join(",") : v}`).join("  ")]];
  const box = el("div", { class: "report", "data-name": report.name },
    el("h2", { text: `${report.name}: ${report.title}` }), table(["fact", "value"], facts));
  const links = ["report.md", "report.json", "log.txt"].filter((f) => (report.files || []).includes(f));
  box.append(el("p", {}, ...links.flatMap((f) => [el("a", { href: fileUrl(report.name, f), target: "_blank", text: f }), " "])));
  for (const s of report.sections) {
    box.append(el("h3", { text: s.title }), el("p", { class: `status-${s.status}`, text: s.error ? `${s.status}: ${s.error}` : s.status }));
    if (s.conclusion) box.append(el("p", { class: "conclusion", text: s.conclusion }));
    for (const w of s.warnings || []) box.append(el("p", { class: "warning", role: "alert", text: w }));
    if (s.setup) box.append(el("p", { text: s.setup }));
    if (s.columns.length) box.append(table(s.columns, s.rows));
    if (s.notes.length) box.append(el("ul", {}, ...s.notes.map((n) => el("li", { text: n }))));
    for (const plot of s.plots) {
      box.append(el("p", {}, el("img", { src: fileUrl(report.name, plot), alt: `${s.name} plot`, class: "plot" })));
    }
  }
  return box;
}

function compareTicked() {
  // A is the earlier: a report's name starts with its date and time, so names sort by them.
  const names = [...document.querySelectorAll(".pick:checked")].map((t) => t.dataset.name).sort();
  if (names.length === 2) showReports(names);
}

window.addEventListener("DOMContentLoaded", async () => {
  $("run-form").addEventListener("submit", startRun);
  $("cancel").addEventListener("click", cancelRun);
  $("compare").addEventListener("click", compareTicked);
  $("refresh").addEventListener("click", loadReports);
  try {
    await loadPresets();
    await loadReports();
  } catch (err) {
    say(`Could not load the page's data: ${err.message}`);
  }
  poll();
});
