// The dashboard's pages: the runs list, and one run fed by Server-Sent Events.
// window.rlc says what the page has received (the browser tests read it):
// updates, last position, steps drawn, and the latency of each live event
// (its arrival here minus the ts the controller stamped right before appending it).
"use strict";

window.rlc = { updates: 0, position: 0, steps: 0, latenciesMs: [], error: null };

const TIMELINE_STEPS = 30;
const TABLE_ROWS = 300;

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
  for (const c of children) node.append(c);
  return node;
}

function iso(ts) {
  return ts ? new Date(ts * 1000).toISOString().replace("T", " ").slice(0, 23) : "-";
}

async function rlcIndex() {
  const body = document.querySelector("#runs tbody");
  const answer = await (await fetch("/api/runs")).json();
  if (answer.error) { body.append(el("tr", {}, el("td", { colspan: "4" }, answer.error))); return; }
  if (answer.default) { location.replace("/run/" + encodeURIComponent(answer.default)); return; }
  for (const r of answer.runs) {
    const link = el("a", { href: "/run/" + encodeURIComponent(r.run_id) }, r.run_id);
    body.append(el("tr", {}, el("td", {}, link), el("td", {}, String(r.events)),
      el("td", {}, String(r.epoch)), el("td", {}, r.finished ? "finished" : "running or stopped")));
  }
  document.getElementById("runs-empty").hidden = answer.runs.length > 0;
}

// -- one run ------------------------------------------------------------------------

const LAYOUT = { margin: { l: 45, r: 45, t: 10, b: 35 }, legend: { orientation: "h", y: 1.15 },
  font: { size: 11 } };
const CONFIG = { displayModeBar: false, responsive: true };

function rlcRun(runId) {
  document.getElementById("run-id").textContent = runId;
  document.title = "rl-controller " + runId;
  document.getElementById("trace-link").href = "/run/" + encodeURIComponent(runId) + "/trace";
  initCharts();
  initFilters(runId);
  const source = new EventSource("/api/runs/" + encodeURIComponent(runId) + "/stream");
  const live = document.getElementById("live");
  source.onmessage = (msg) => {
    const data = JSON.parse(msg.data);
    if (data.kind === "error") { window.rlc.error = data.text; live.textContent = "stopped: " + data.text; live.className = "badge bad"; source.close(); return; }
    receive(data);
  };
  source.onerror = () => { live.textContent = "reconnecting"; live.className = "badge"; };
}

function initCharts() {
  Plotly.newPlot("chart-steps", [
    { name: "reward (mean)", x: [], y: [], mode: "lines+markers", line: { color: "#2b6cb0" } },
    { name: "lag mean", x: [], y: [], mode: "lines", yaxis: "y2", line: { color: "#dd6b20" } },
    { name: "lag max", x: [], y: [], mode: "lines", yaxis: "y2", line: { color: "#dd6b20", dash: "dot" } },
  ], { ...LAYOUT, xaxis: { title: "step" }, yaxis: { title: "reward" },
    yaxis2: { title: "lag (versions)", overlaying: "y", side: "right", rangemode: "tozero" } }, CONFIG);
  Plotly.newPlot("chart-buffer", [
    { name: "buffered", x: [], y: [], mode: "lines", line: { shape: "hv", color: "#2f855a" } },
    { name: "in flight", x: [], y: [], mode: "lines", line: { shape: "hv", color: "#805ad5" } },
  ], { ...LAYOUT, xaxis: { type: "date" }, yaxis: { title: "groups", rangemode: "tozero" } }, CONFIG);
  Plotly.newPlot("chart-timeline", [], { ...LAYOUT, barmode: "overlay", xaxis: { type: "date" },
    yaxis: { title: "step", autorange: "reversed" }, showlegend: false }, CONFIG);
}

let allSteps = [];
let series = [];
let openStep = null;
let lastTs = 0;
let chartsDue = null;

// Each message is taken in at once (status, table, data); the charts are redrawn from
// the data at most every CHART_EVERY_MS, so a burst of updates never queues redraws
// (the page keeps up with the stream, and the latency measured is the stream's).
const CHART_EVERY_MS = 250;

function receive(data) {
  const rlc = window.rlc;
  const now = Date.now();
  const snapshot = data.kind === "snapshot";
  if (!snapshot) {
    for (const row of data.events) if (row.ts) rlc.latenciesMs.push(now - row.ts * 1000);
    if (rlc.latenciesMs.length > 1000) rlc.latenciesMs.splice(0, rlc.latenciesMs.length - 1000);
  }
  if (snapshot) { allSteps = []; series = []; }
  allSteps.push(...data.steps);
  series.push(...data.series);
  if (series.length > 2000) series.splice(0, series.length - 2000);
  openStep = data.open_step;
  lastTs = data.last_ts;
  addEvents(snapshot, data.events);
  showStatus(data);
  if (chartsDue === null) chartsDue = setTimeout(drawCharts, snapshot ? 0 : CHART_EVERY_MS);
  rlc.updates += 1;
  rlc.position = data.position;
}

function drawCharts() {
  chartsDue = null;
  const done = allSteps.filter((s) => s.status === "finished");
  const x = done.map((s) => s.step);
  Plotly.restyle("chart-steps", { x: [x, x, x], y: [done.map((s) => s.reward),
    done.map((s) => s.lag_mean), done.map((s) => s.lag_max)] }, [0, 1, 2]);
  const t = series.map((p) => new Date(p[0] * 1000));
  Plotly.restyle("chart-buffer", { x: [t, t], y: [series.map((p) => p[1]), series.map((p) => p[2])] }, [0, 1]);
  drawTimeline(lastTs);
  window.rlc.steps = x.length;
}

function drawTimeline(lastTs) {
  const recent = allSteps.slice(-TIMELINE_STEPS);
  const bars = recent.map((s) => ({ step: s.step, begun: s.begun_ts, ended: s.ended_ts,
    color: s.status === "finished" ? "#2f855a" : "#c0392b",
    text: s.status === "finished" ? `v${s.trainer_version}` : `aborted: ${s.abort_reason}` }));
  if (openStep) bars.push({ step: openStep.step, begun: openStep.begun_ts,
    ended: Math.max(lastTs, openStep.begun_ts), color: "#2b6cb0",
    text: `open, ${openStep.microbatches} microbatch(es)` });
  Plotly.react("chart-timeline", [{
    type: "bar", orientation: "h", y: bars.map((b) => b.step),
    base: bars.map((b) => new Date(b.begun * 1000)),
    x: bars.map((b) => Math.max(1, (b.ended - b.begun) * 1000)),
    marker: { color: bars.map((b) => b.color) }, hovertext: bars.map((b) => b.text),
  }], { ...LAYOUT, xaxis: { type: "date" }, yaxis: { title: "step", autorange: "reversed" },
    showlegend: false }, CONFIG);
}

function eventRow(r) {
  const tr = el("tr", { "data-position": String(r.position), "data-type": r.type },
    el("td", {}, String(r.position)), el("td", {}, iso(r.ts)),
    el("td", {}, r.epoch === null ? "-" : String(r.epoch)), el("td", {}, r.type),
    el("td", { class: "details" }, r.details));
  if (r.type === "malformed") tr.className = "malformed";
  return tr;
}

let filter = { type: "", group: "", step: "" };

function matches(r) {
  if (filter.type && r.type !== filter.type) return false;
  if (filter.group && r.group !== filter.group && !r.details.includes(filter.group)) return false;
  return !filter.step || String(r.step) === filter.step;
}

function addEvents(reset, rows) {
  const body = document.querySelector("#events tbody");
  if (reset && !filtered()) body.replaceChildren();
  for (const r of rows) if (matches(r)) body.prepend(eventRow(r));
  while (body.children.length > TABLE_ROWS) body.lastChild.remove();
}

function filtered() { return Boolean(filter.type || filter.group || filter.step); }

function initFilters(runId) {
  const form = document.getElementById("filters");
  const select = form.elements.type;
  fetch("/api/runs").then((r) => r.json()).then((answer) => {
    for (const t of answer.event_types || []) select.append(el("option", { value: t }, t));
  });
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    filter = { type: select.value, group: form.elements.group.value.trim(),
      step: form.elements.step.value.trim() };
    const q = new URLSearchParams({ ...filter, limit: "200" });
    const answer = await (await fetch(`/api/runs/${encodeURIComponent(runId)}/events?${q}`)).json();
    const note = document.getElementById("filter-note");
    if (answer.error) { note.textContent = answer.error; return; }
    const body = document.querySelector("#events tbody");
    body.replaceChildren(...answer.events.map(eventRow));
    note.textContent = `${answer.events.length} match(es) in positions ${answer.scanned_from}..${answer.end}`;
  });
}

function showStatus(d) {
  const facts = [["trainer version", d.trainer_version], ["weights at generators", d.weight_version],
    ["buffered", d.buffer], ["in flight", d.in_flight], ["events", d.position], ["epoch", d.epoch],
    ["window", d.window_versions],
    ["open step", d.open_step ? `${d.open_step.step} (${d.open_step.microbatches} mb)` : "-"]];
  document.getElementById("status").replaceChildren(...facts.map(([k, v]) =>
    el("div", { "data-fact": k }, el("b", {}, String(v)), k)));
  const live = document.getElementById("live");
  live.textContent = d.finished ? "finished" : "live";
  live.className = "badge " + (d.finished ? "ok" : "live");
  const audit = document.getElementById("audit");
  audit.textContent = (d.audit.ok ? "audit: ok" : "audit: PROBLEM") + " — " + d.audit.text;
  audit.className = "badge " + (d.audit.ok ? "ok" : "bad");
}
