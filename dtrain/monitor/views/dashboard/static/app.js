// The dashboard page: polls the JSON API every 2 s, appends new samples, redraws with plotly.js.
"use strict";

const NODE_CHARTS = [
  { id: "cpu", title: "CPU %", group: "nodes", y: (s, i) => pct(s.cpu[i]) },
  { id: "mem", title: "memory used GB", group: "nodes", y: (s, i) => div(s.mem_used[i], 1e9) },
  { id: "net_rx", title: "network in MB/s", group: "nodes", y: (s, i) => div(s.net_rx_bps[i], 1e6) },
  { id: "net_tx", title: "network out MB/s", group: "nodes", y: (s, i) => div(s.net_tx_bps[i], 1e6) },
  { id: "disk_r", title: "disk read MB/s", group: "nodes", y: (s, i) => div(s.disk_read_bps[i], 1e6) },
  { id: "disk_w", title: "disk write MB/s", group: "nodes", y: (s, i) => div(s.disk_write_bps[i], 1e6) },
  { id: "gpu_util", title: "GPU %", group: "gpus", y: (s, i) => pct(s.util[i]) },
  { id: "gpu_mem", title: "GPU memory GB", group: "gpus", y: (s, i) => div(s.mem_used[i], 1e9) },
];
const RANK_CHARTS = [
  { id: "step_time", title: "step time s", group: "ranks", y: (s, i) => (s.steps[i] ? s.step_time[i] : null) },
  { id: "samples", title: "samples/s", group: "ranks", y: (s, i) => s.samples_per_s[i] },
  { id: "loss", title: "training loss", group: "ranks", y: (s, i) => s.loss[i] },
  { id: "data_wait", title: "data wait % of step", group: "ranks",
    y: (s, i) => (s.steps[i] && s.step_time[i] ? pct(s.data_wait[i] / s.step_time[i]) : null) },
];

const state = { job: null, last: 0, data: null, logFile: null, busy: false };

function pct(v) { return v == null ? null : 100 * v; }
function div(v, d) { return v == null ? null : v / d; }
function el(tag, attrs, text) {
  const e = document.createElement(tag);
  Object.assign(e, attrs || {});
  if (text != null) e.textContent = text;
  return e;
}

async function getJSON(url) {
  const r = await fetch(url, { cache: "no-store" });
  if (!r.ok) throw new Error(url + ": " + r.status);
  return r.json();
}

async function loadJobs() {
  const jobs = await getJSON("/api/jobs");
  const ul = document.getElementById("jobs");
  ul.replaceChildren();
  if (!jobs.length) ul.append(el("li", { className: "dim" }, "no jobs with metrics yet"));
  for (const j of jobs) {
    const li = el("li", { title: j.dir }, j.name ? `${j.name} (${j.id})` : j.id);
    li.dataset.job = j.id;
    li.append(el("span", { className: "state" }, j.state));
    li.onclick = () => { location.hash = "job=" + encodeURIComponent(j.id); };
    ul.append(li);
  }
  const fromHash = decodeURIComponent((location.hash.match(/job=([^&]+)/) || [])[1] || "");
  const want = jobs.some((j) => j.id === fromHash) ? fromHash : jobs.length ? jobs[0].id : null;
  if (want && want !== state.job) selectJob(want);
}

function selectJob(id) {
  state.job = id;
  state.last = 0;
  state.data = null;
  state.logFile = null;
  for (const li of document.querySelectorAll("#jobs li")) li.classList.toggle("selected", li.dataset.job === id);
  buildCharts("node-charts", NODE_CHARTS);
  buildCharts("rank-charts", RANK_CHARTS);
  refresh();
}

function buildCharts(containerId, charts) {
  const box = document.getElementById(containerId);
  box.replaceChildren();
  for (const c of charts) box.append(el("div", { id: "chart-" + c.id, className: "chart" }));
}

function merge(into, fresh) {
  for (const group of ["nodes", "gpus", "ranks"]) {
    into[group] = into[group] || {};
    for (const [key, cols] of Object.entries(fresh[group] || {})) {
      const have = into[group][key];
      if (!have) { into[group][key] = cols; continue; }
      for (const [col, vals] of Object.entries(cols)) {
        if (Array.isArray(vals)) have[col] = (have[col] || []).concat(vals);
        else have[col] = vals;
      }
    }
  }
  into.job = fresh.job;
  into.states = fresh.states;
  into.findings = fresh.findings;
  into.cost = fresh.cost;
}

function draw(charts) {
  const d = state.data;
  for (const c of charts) {
    const div = document.getElementById("chart-" + c.id);
    if (!div) continue;
    const traces = [];
    let points = 0;
    const keys = Object.keys(d[c.group] || {}).sort((a, b) => a.localeCompare(b, undefined, { numeric: true }));
    for (const key of keys) {
      const s = d[c.group][key];
      const x = [], y = [];
      for (let i = 0; i < s.t.length; i++) {
        const v = c.y(s, i);
        if (v == null) continue;
        x.push(new Date(s.t[i] * 1000));
        y.push(v);
      }
      points += y.length;
      const name = c.group === "ranks" ? `rank ${key} (${s.node})` : key;
      traces.push({ x, y, name, type: "scatter", mode: "lines", line: { width: 1.5 } });
    }
    // a node without GPUs has no GPU series: no empty chart for it
    div.style.display = traces.length ? "" : "none";
    if (!traces.length) continue;
    const layout = {
      title: { text: c.title, font: { size: 13 } }, margin: { l: 45, r: 10, t: 30, b: 30 },
      showlegend: true, legend: { orientation: "h", y: -0.15 }, uirevision: state.job,
      xaxis: { tickformat: "%H:%M:%S" },
    };
    Plotly.react(div, traces, layout, { displaylogo: false, responsive: true });
    div.dataset.points = String(points);
    div.dataset.traces = String(traces.length);
  }
}

function drawStatus() {
  const d = state.data;
  const job = d.job || {};
  document.getElementById("title").textContent =
    `job ${job.id}${job.name ? " (" + job.name + ")" : ""} — ${job.state}`;
  const nodes = document.getElementById("nodes");
  nodes.replaceChildren();
  for (const n of d.states || []) {
    nodes.append(el("span", { className: "badge " + n.state }, `${n.node}: ${n.state.replace("_", " ")}`));
  }
  const c = d.cost;  // a rented cluster's (dtrain.cluster.providers.cost); null on owned nodes
  if (c) {
    const usd = (v) => (v === null ? "cost unknown" : `$${v.toFixed(2)}`);
    nodes.append(el("div", { id: "cost" },
      `${c.cluster} (${c.instance_type}): this job ${c.node_hours.toFixed(3)} node-hours, ${usd(c.cost)}; ` +
      `the cluster ${c.cluster_node_hours.toFixed(3)} node-hours, ${usd(c.cluster_cost)}, ` +
      `${c.idle_node_hours.toFixed(3)} idle`));
  }
  const ul = document.getElementById("findings");
  ul.replaceChildren();
  if (!(d.findings || []).length) ul.append(el("li", { className: "dim" }, "none"));
  for (const f of d.findings || []) ul.append(el("li", {}, f.message));
}

async function refreshLogs() {
  const logs = await getJSON(`/api/jobs/${encodeURIComponent(state.job)}/logs?lines=200`);
  const select = document.getElementById("log-file");
  const names = Object.keys(logs);
  if (select.options.length !== names.length) {
    select.replaceChildren(...names.map((n) => el("option", { value: n }, n)));
    select.onchange = () => { state.logFile = select.value; refreshLogs(); };
  }
  if (!state.logFile || !names.includes(state.logFile)) state.logFile = names[0] || null;
  select.value = state.logFile || "";
  const pre = document.getElementById("log");
  pre.textContent = state.logFile ? logs[state.logFile].join("\n") : "(no logs)";
  pre.scrollTop = pre.scrollHeight;
}

async function refresh() {
  if (!state.job || state.busy) return;
  state.busy = true;
  const job = state.job;
  try {
    const fresh = await getJSON(`/api/jobs/${encodeURIComponent(job)}/series?since=${state.last}`);
    if (job !== state.job) return;
    state.data = state.data || {};
    merge(state.data, fresh);
    state.last = fresh.last;
    drawStatus();
    draw(NODE_CHARTS);
    draw(RANK_CHARTS);
    document.body.dataset.rendered = String(document.querySelectorAll(".chart[data-points]").length);
    await refreshLogs();
  } catch (err) {
    document.getElementById("title").textContent = String(err);
  } finally {
    state.busy = false;
  }
}

window.addEventListener("hashchange", loadJobs);
loadJobs();
setInterval(refresh, 2000);
setInterval(loadJobs, 15000);
