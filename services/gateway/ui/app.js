// marlaas's dashboard: the tenant's jobs and their curves, from the same HTTP API the CLI uses
// (/v1/jobs with the tenant's bearer token). The token stays in this tab (sessionStorage). A
// selected job is followed live through its server-sent events; the list is refreshed every 3 s.
// A selected job's samples (a version's kept rollouts) are loaded again when it commits a version
// or another version is chosen, not at every refresh.
"use strict";

const TOOL_SUCCESS = "tool/success_rate";
const $ = (selector) => document.querySelector(selector);
let token = sessionStorage.getItem("marlaas-token") || "";
let selected = null;   // the job whose curves are shown
let following = null;  // the AbortController of its event stream

class ApiError extends Error {
  constructor(status, message) { super(message); this.status = status; }
}

async function api(path, options = {}) {
  const response = await fetch(path, {
    ...options, headers: { ...(options.headers || {}), Authorization: `Bearer ${token}` },
  });
  if (!response.ok) {
    const body = await response.json().catch(() => ({ error: response.statusText }));
    throw new ApiError(response.status, body.error || response.statusText);
  }
  return response;
}

const fmt = (value, digits = 2) => (value === null || value === undefined ? "–" : Number(value).toFixed(digits));
const last = (values) => (values && values.length ? values[values.length - 1] : null);

function element(tag, text, className) {
  const node = document.createElement(tag);
  if (text !== undefined) node.textContent = text;  // text, never HTML: job names are the tenant's
  if (className) node.className = className;
  return node;
}

// --- sign in ---------------------------------------------------------------------------------

async function signIn(candidate) {
  token = candidate;
  try {
    await api("/v1/jobs");
  } catch (error) {
    token = "";
    sessionStorage.removeItem("marlaas-token");
    $("#signin-error").textContent = error.status === 401
      ? `That token was not accepted: ${error.message}` : `The gateway did not answer: ${error.message}`;
    return false;
  }
  sessionStorage.setItem("marlaas-token", token);
  $("#signin").hidden = true;
  $("#app").hidden = false;
  $("#signout").hidden = false;
  $("#who").textContent = `tenant ${token.slice(4, token.lastIndexOf("_"))}`;
  await refresh();
  return true;
}

function signOut() {
  sessionStorage.removeItem("marlaas-token");
  location.reload();
}

// --- the job list ----------------------------------------------------------------------------

async function refresh() {
  try {
    const jobs = await (await api("/v1/jobs")).json();
    renderJobs(jobs);
    refreshUsage();
    $("#app-error").textContent = "";
    if (selected) renderDetail(jobs.find((job) => job.id === selected));
  } catch (error) {
    $("#app-error").textContent = `Could not list your jobs: ${error.message}`;
  }
}

// what the tenant's jobs used (GET /v1/usage: metering, docs/tenants.md), one row per job
const USAGE_COLUMNS = [["generated_tokens", 0], ["prefill_tokens", 0], ["train_s", 1], ["train_tokens", 0],
  ["tool_calls", 0], ["tool_s", 1]];

async function refreshUsage() {
  try {
    const report = await (await api("/v1/usage")).json();
    const body = $("#usage tbody");
    body.replaceChildren();
    for (const row of [...report.by_job, { key: "total", counters: report.total }]) {
      const line = element("tr");
      line.append(element("td", row.key));
      for (const [name, digits] of USAGE_COLUMNS) line.append(element("td", fmt(row.counters[name], digits)));
      body.append(line);
    }
  } catch (error) { /* usage is a side panel: the job list reports what is wrong */ }
}

function renderJobs(jobs) {
  const body = $("#jobs tbody");
  body.replaceChildren();
  $("#no-jobs").hidden = jobs.length > 0;
  for (const job of jobs) {
    const row = element("tr");
    row.dataset.job = job.id;
    if (job.id === selected) row.classList.add("selected");
    const tools = last((job.metrics || {})[TOOL_SUCCESS]);
    const cells = [job.id, job.task, job.state, `${Math.max(job.version, 0)} / ${job.target_steps}`,
      fmt(last(job.rewards)), tools === null ? "–" : `${Math.round(100 * tools)} %`, fmt(job.tpts_s),
      job.queue_position ?? "–"];
    cells.forEach((text, i) => row.append(element("td", String(text), i === 2 ? `state-${job.state}` : "")));
    const actions = element("td");
    if (job.state === "queued" || job.state === "running") {
      const cancel = element("button", "cancel");
      cancel.addEventListener("click", (event) => { event.stopPropagation(); cancelJob(job.id); });
      actions.append(cancel);
    }
    if (job.version >= 0) {
      const download = element("button", "download");
      download.addEventListener("click", (event) => { event.stopPropagation(); downloadAdapter(job.id); });
      actions.append(download);
    }
    row.append(actions);
    row.addEventListener("click", () => select(job.id));
    body.append(row);
  }
}

async function cancelJob(id) {
  try { await api(`/v1/jobs/${encodeURIComponent(id)}/cancel`, { method: "POST" }); }
  catch (error) { $("#app-error").textContent = `Could not cancel ${id}: ${error.message}`; }
  await refresh();
}

async function downloadAdapter(id) {
  try {
    const blob = await (await api(`/v1/jobs/${encodeURIComponent(id)}/adapter`)).blob();
    const link = element("a");
    link.href = URL.createObjectURL(blob);
    link.download = `${id}-adapter.tar.gz`;
    link.click();
    URL.revokeObjectURL(link.href);
  } catch (error) {
    $("#app-error").textContent = `Could not download ${id}'s adapter: ${error.message}`;
  }
}

// --- one job: curves, timeline, live ---------------------------------------------------------

async function select(id) {
  selected = id;
  if (following) following.abort();
  following = new AbortController();
  await refresh();
  follow(id, following.signal);
}

async function renderDetail(job) {
  if (!job) { $("#detail").hidden = true; return; }
  $("#detail").hidden = false;
  $("#detail-title").textContent = job.id;
  $("#detail-state").textContent = `${job.task}: ${job.state}${job.reason ? ` (${job.reason})` : ""}, `
    + `version ${Math.max(job.version, 0)} of ${job.target_steps}`;
  line($("#chart-reward"), job.rewards.map((value, version) => [version, value]), [0, 1]);
  line($("#chart-eval"), (job.evals || []).map((e) => [e.version, e.score]), [0, 1],
    "not evaluated (a job's eval_every sets it)");
  line($("#chart-tools"), ((job.metrics || {})[TOOL_SUCCESS] || []).map((value, version) => [version, value]), [0, 1],
    "no tool calls (not an agentic job)");
  showSamples(job);
  try {
    const versions = await (await api(`/v1/jobs/${encodeURIComponent(job.id)}/versions`)).json();
    const steps = versions.slice(1).map((v, i) => [v.version, v.committed_at - versions[i].committed_at]);
    bars($("#chart-timeline"), steps);
    const spans = await (await api(`/v1/jobs/${encodeURIComponent(job.id)}/timeline`)).json();
    phases($("#chart-phases"), spans);
  } catch (error) { /* the job may be gone; the list says so */ }
}

async function follow(id, signal) {
  // EventSource cannot send a bearer token: read the stream with fetch; each event redraws
  try {
    const response = await api(`/v1/jobs/${encodeURIComponent(id)}/events`, { signal });
    const reader = response.body.getReader();
    const decoder = new TextDecoder();
    let pending = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      pending += decoder.decode(value, { stream: true });
      if (pending.includes("\n\n")) { pending = pending.slice(pending.lastIndexOf("\n\n") + 2); refresh(); }
    }
  } catch (error) { /* aborted, or the stream ended: the 3 s refresh goes on */ }
}

// --- one job's samples: a version's kept rollouts (GET /v1/jobs/{id}/samples) ------------------

let samplesDrawn = "";  // the job, its version and the version chosen of the table drawn
let samplesJob = null;  // the job whose samples are shown

function showSamples(job, force = false) {
  samplesJob = job;
  const select = $("#samples-version");
  const choice = select.dataset.job === job.id ? select.value : "";  // "": the newest
  const key = `${job.id}|${job.version}|${choice}`;
  if (key === samplesDrawn && !force) return;
  samplesDrawn = key;
  loadSamples(job.id, choice);
}

async function loadSamples(id, choice) {
  const query = choice ? `?version=${encodeURIComponent(choice)}` : "";
  try {
    const samples = await (await api(`/v1/jobs/${encodeURIComponent(id)}/samples${query}`)).json();
    if (samplesJob && samplesJob.id === id) renderSamples(id, samples, choice);
  } catch (error) {
    $("#samples tbody").replaceChildren();
    $("#samples-note").textContent = error.status === 404 ? error.message : `Could not load the samples: ${error.message}`;
  }
}

function turnText(turn) {
  if (turn.role === "tool") return `[tool] ${turn.text}`;
  const call = turn.tool ? `\n-> ${turn.tool} ${turn.arguments}` : turn.error ? `\n-> (unreadable call: ${turn.error})` : "";
  return `[model] ${turn.text}${call}`;
}

function renderSamples(id, samples, choice) {
  const select = $("#samples-version");
  select.dataset.job = id;
  const newest = element("option", `newest (version ${last(samples.versions)})`);
  newest.value = "";
  select.replaceChildren(newest, ...samples.versions.map((v) => Object.assign(element("option", `version ${v}`),
    { value: String(v) })));
  select.value = choice;
  const episodes = samples.groups.reduce((n, g) => n + g.episodes.length, 0);
  const sampledBy = samples.policy_version >= 0 && samples.policy_version !== samples.version
    ? `, sampled by version ${samples.policy_version}` : "";
  $("#samples-note").textContent = `version ${samples.version}${sampledBy}: ${samples.groups.length} of `
    + `${samples.batch_groups} groups, ${episodes} episodes kept`;
  const body = $("#samples tbody");
  body.replaceChildren();
  for (const group of samples.groups) {
    group.episodes.forEach((episode, i) => {
      const row = element("tr", undefined, i === 0 ? "group-start" : "");
      row.dataset.group = group.group;
      row.append(element("td", String(group.group)), element("td", `${i + 1} of ${group.size}`),
        element("td", fmt(episode.reward, 3)),
        element("td", `${episode.advantage >= 0 ? "+" : ""}${fmt(episode.advantage, 3)}`),
        element("td", i === 0 ? group.prompt : "", "text"),
        element("td", episode.turns.map(turnText).join("\n")
          + (episode.turns_cut ? `\n(${episode.turns_cut} more turns not kept)` : ""), "text"),
        element("td", episode.completion, "text"));
      body.append(row);
    });
  }
}

$("#samples-version").addEventListener("change", () => { if (samplesJob) showSamples(samplesJob, true); });

// --- charts: SVG drawn here (no library, nothing from another host) ---------------------------

const SVG = "http://www.w3.org/2000/svg";
const PAD = { left: 36, right: 10, top: 10, bottom: 22 };

function frame(svg) {
  svg.replaceChildren();
  const { width, height } = svg.getBoundingClientRect();
  return { width: width || 420, height: height || 200 };
}

function axes(svg, size, xMax, [yMin, yMax]) {
  for (const [y, label] of [[yMin, fmt(yMin, 1)], [yMax, fmt(yMax, 1)]]) {
    const text = document.createElementNS(SVG, "text");
    text.setAttribute("x", 4);
    text.setAttribute("y", PAD.top + (size.height - PAD.top - PAD.bottom) * (1 - (y - yMin) / (yMax - yMin || 1)) + 4);
    text.textContent = label;
    svg.append(text);
  }
  const text = document.createElementNS(SVG, "text");
  text.setAttribute("x", size.width - PAD.right - 60);
  text.setAttribute("y", size.height - 6);
  text.textContent = `version ${xMax}`;
  svg.append(text);
}

function empty(svg, size, message) {
  const text = document.createElementNS(SVG, "text");
  text.setAttribute("x", PAD.left);
  text.setAttribute("y", size.height / 2);
  text.textContent = message;
  svg.append(text);
}

function line(svg, points, range, none = "nothing yet") {
  const size = frame(svg);
  if (points.length === 0) { empty(svg, size, none); return; }
  const xMax = Math.max(1, ...points.map((p) => p[0]));
  const [yMin, yMax] = range;
  const x = (v) => PAD.left + (size.width - PAD.left - PAD.right) * (v / xMax);
  const y = (v) => PAD.top + (size.height - PAD.top - PAD.bottom) * (1 - (v - yMin) / (yMax - yMin));
  const poly = document.createElementNS(SVG, "polyline");
  poly.setAttribute("points", points.map(([a, b]) => `${x(a).toFixed(1)},${y(b).toFixed(1)}`).join(" "));
  svg.append(poly);
  axes(svg, size, xMax, range);
}

function bars(svg, points) {
  const size = frame(svg);
  if (points.length === 0) { empty(svg, size, "no version trained yet"); return; }
  const xMax = Math.max(...points.map((p) => p[0]));
  const yMax = Math.max(...points.map((p) => p[1]), 0.001);
  const width = (size.width - PAD.left - PAD.right) / Math.max(points.length, 1);
  points.forEach(([version, seconds], i) => {
    const rect = document.createElementNS(SVG, "rect");
    const h = (size.height - PAD.top - PAD.bottom) * (seconds / yMax);
    rect.setAttribute("x", PAD.left + i * width);
    rect.setAttribute("y", size.height - PAD.bottom - h);
    rect.setAttribute("width", Math.max(1, width - 1));
    rect.setAttribute("height", h);
    rect.append(Object.assign(document.createElementNS(SVG, "title"), { textContent: `v${version}: ${fmt(seconds)} s` }));
    svg.append(rect);
  });
  axes(svg, size, xMax, [0, yMax]);
}

const PHASES = ["generate", "reward", "train", "commit"];
const SHOWN_VERSIONS = 12;

function phases(svg, spans) {
  // one row per phase, time along x; the last SHOWN_VERSIONS versions (a commit belongs to the
  // version it made, so it is drawn with the version trained before it)
  const size = frame(svg);
  const owner = (s) => (s.phase === "commit" ? s.version - 1 : s.version);
  const drawn = spans.filter((s) => PHASES.includes(s.phase));
  const last = Math.max(-1, ...drawn.map(owner));
  const shown = drawn.filter((s) => owner(s) > last - SHOWN_VERSIONS);
  if (shown.length === 0) { empty(svg, size, "no phase recorded yet"); return; }
  const t0 = Math.min(...shown.map((s) => s.start));
  const span = Math.max(...shown.map((s) => s.end)) - t0 || 1;
  const rowHeight = (size.height - PAD.top - PAD.bottom) / PHASES.length;
  const x = (t) => PAD.left + 30 + (size.width - PAD.left - 30 - PAD.right) * ((t - t0) / span);
  PHASES.forEach((phase, row) => {
    const label = document.createElementNS(SVG, "text");
    label.setAttribute("x", 4);
    label.setAttribute("y", PAD.top + row * rowHeight + rowHeight / 2 + 4);
    label.textContent = phase;
    svg.append(label);
  });
  for (const s of shown) {
    const rect = document.createElementNS(SVG, "rect");
    rect.setAttribute("class", `phase-${s.phase}`);
    rect.setAttribute("x", x(s.start));
    rect.setAttribute("y", PAD.top + PHASES.indexOf(s.phase) * rowHeight + 2);
    rect.setAttribute("width", Math.max(1.5, x(s.end) - x(s.start)));
    rect.setAttribute("height", rowHeight - 4);
    rect.append(Object.assign(document.createElementNS(SVG, "title"),
      { textContent: `v${s.version} ${s.phase} (${s.service}): ${fmt(s.end - s.start)} s` }));
    svg.append(rect);
  }
  const text = document.createElementNS(SVG, "text");
  text.setAttribute("x", size.width - PAD.right - 150);
  text.setAttribute("y", size.height - 6);
  text.textContent = `versions ${Math.max(0, last - SHOWN_VERSIONS + 1)}..${last}, ${fmt(span)} s`;
  svg.append(text);
}

// --- start -----------------------------------------------------------------------------------

$("#signin").addEventListener("submit", (event) => { event.preventDefault(); signIn($("#token").value.trim()); });
$("#signout").addEventListener("click", signOut);
setInterval(() => { if (token && !$("#app").hidden) refresh(); }, 3000);
if (token) signIn(token);
