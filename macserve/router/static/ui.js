// macserve router page: live updates over SSE, actions by POST with the CSRF token, a chat
// panel streaming through /ui/chat. No framework; the overview's HTML comes from the server.
"use strict";
const $ = (s, el = document) => el.querySelector(s);
const meta = (n) => (document.querySelector(`meta[name="${n}"]`) || {}).content || "";
const CSRF = meta("csrf");
let names = meta("names").split(",").filter(Boolean);
let colors = meta("colors").split(",");
const WINDOW = 600; // seconds of samples the charts show
const samples = {}; // model -> [{t, tps, ttft_s}]
let lastOverview = "";

function colorOf(name) {
  const i = names.indexOf(name);
  return colors[i >= 0 ? i % colors.length : 0] || "#888";
}

async function post(path, body) {
  const r = await fetch(path, {
    method: "POST",
    headers: { "content-type": "application/json", "x-csrf-token": CSRF },
    body: JSON.stringify(body),
  });
  let d = {};
  try { d = await r.json(); } catch (e) { d = { ok: false, line: `HTTP ${r.status}` }; }
  return d;
}

function outcome(line, ok) {
  const el = $("#outcome");
  el.textContent = line;
  el.className = ok ? "" : "err";
}

// ---- the overview: replaced by each SSE update, unless the user is editing a field ------------
function editing() {
  const a = document.activeElement;
  return a && $("#overview").contains(a) && (a.tagName === "INPUT" || a.tagName === "SELECT");
}

document.addEventListener("click", async (ev) => {
  const b = ev.target.closest("button[data-act]");
  if (!b) return;
  b.disabled = true;
  outcome(`${b.dataset.name}: ${b.dataset.act} …`, true);
  const d = await post("/ui/action", { name: b.dataset.name, action: b.dataset.act });
  outcome(d.line, d.ok);
});

document.addEventListener("submit", async (ev) => {
  const f = ev.target.closest("form.set");
  if (!f) return;
  ev.preventDefault();
  const values = {};
  for (const el of f.querySelectorAll("input, select")) {
    if (el.value !== el.dataset.initial) values[el.name] = el.value;
  }
  if (!Object.keys(values).length) { outcome(`${f.dataset.name}: no change`, true); return; }
  const what = Object.entries(values).map(([k, v]) => `${k}=${v}`).join(" ");
  outcome(`${f.dataset.name}: set ${what} … (restart, health wait)`, true);
  document.activeElement.blur();
  for (const el of f.elements) el.disabled = true;
  const d = await post("/ui/action", { name: f.dataset.name, action: "set", values });
  outcome(d.line, d.ok);
});

// ---- live: SSE ----------------------------------------------------------------------------------
function connect() {
  const es = new EventSource("/ui/events");
  es.onopen = () => { $("#live").textContent = "live"; };
  es.onerror = () => { $("#live").textContent = "reconnecting…"; };
  es.addEventListener("overview", (e) => {
    if (editing() || e.data === lastOverview) return;
    lastOverview = e.data;
    $("#overview").innerHTML = e.data;
    const rows = [...document.querySelectorAll("#profiles tbody tr")];
    names = rows.map((r) => r.dataset.name);
  });
  es.addEventListener("samples", (e) => {
    for (const s of JSON.parse(e.data)) (samples[s.model] = samples[s.model] || []).push(s);
    draw();
  });
  es.addEventListener("logs", (e) => {
    const all = JSON.parse(e.data);
    for (const [name, lines] of Object.entries(all)) {
      let pre = document.getElementById(`log-${name}`);
      if (!pre) {
        const d = document.createElement("details");
        const s = document.createElement("summary");
        s.textContent = name;
        pre = document.createElement("pre");
        pre.id = `log-${name}`;
        d.append(s, pre);
        $("#log-list").append(d);
      }
      const text = (pre.textContent ? pre.textContent + "\n" : "") + lines.join("\n");
      pre.textContent = text.split("\n").slice(-500).join("\n");
      pre.scrollTop = pre.scrollHeight;
    }
  });
}

// ---- charts: one polyline per model, the last WINDOW seconds ---------------------------------
function draw() {
  const now = Date.now() / 1000;
  for (const [id, key] of [["tps", "tps"], ["ttft", "ttft_s"]]) {
    const svg = document.getElementById(id);
    const pts = Object.values(samples).flat().filter((s) => s[key] != null && s.t > now - WINDOW);
    const top = Math.max(1e-3, ...pts.map((s) => s[key])) * 1.1;
    const x = (t) => 30 + ((t - (now - WINDOW)) / WINDOW) * 565;
    const y = (v) => 150 - (v / top) * 140;
    let out = `<text x="2" y="14" font-size="11" fill="#6e6e73">${top.toFixed(top < 10 ? 2 : 0)}</text>`;
    out += `<line x1="30" y1="150" x2="595" y2="150" stroke="#d2d2d7"/>`;
    for (const [model, list] of Object.entries(samples)) {
      const p = list.filter((s) => s[key] != null && s.t > now - WINDOW);
      if (!p.length) continue;
      const c = colorOf(model);
      out += `<polyline fill="none" stroke="${c}" stroke-width="2" points="${p.map((s) => `${x(s.t).toFixed(1)},${y(s[key]).toFixed(1)}`).join(" ")}"/>`;
      out += p.map((s) => `<circle cx="${x(s.t).toFixed(1)}" cy="${y(s[key]).toFixed(1)}" r="3" fill="${c}"/>`).join("");
    }
    svg.innerHTML = out; // numbers and our own colours only
  }
  const leg = $("#chart-legend");
  leg.textContent = "";
  for (const [model, list] of Object.entries(samples)) {
    const last = list[list.length - 1];
    const k = document.createElement("span");
    k.className = "key";
    k.innerHTML = `<i style="background:${colorOf(model)}"></i>`;
    const acc = last.draft ? `, MTP ${Math.round((100 * last.draft[0]) / last.draft[1])}%` : "";
    k.append(`${model}: ${last.tps ?? "-"} tok/s (${last.tps_source}), TTFT ${last.ttft_s} s${acc}`);
    leg.append(k);
  }
}

// ---- chat ---------------------------------------------------------------------------------------
let history = [];
let aborter = null;
function chatSetup() {
  const f = $("#chat-form");
  if (!f) return;
  $("#chat-stop").onclick = () => aborter && aborter.abort();
  f.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const model = f.model.value;
    const prompt = f.prompt.value.trim();
    if (!prompt) return;
    history.push({ role: "user", content: prompt });
    f.prompt.value = "";
    const out = $("#chat-out");
    const stats = $("#chat-stats");
    out.textContent += (out.textContent ? "\n\n" : "") + `> ${prompt}\n`;
    stats.textContent = `${model}: waiting…`;
    aborter = new AbortController();
    $("#chat-stop").disabled = false;
    const t0 = performance.now();
    let first = null, n = 0, answer = "", timings = null, err = null;
    try {
      const r = await fetch("/ui/chat", {
        method: "POST",
        signal: aborter.signal,
        headers: { "content-type": "application/json", "x-csrf-token": CSRF },
        body: JSON.stringify({ model, messages: history, stream: true,
          stream_options: { include_usage: true } }),
      });
      if (!r.ok || !(r.headers.get("content-type") || "").startsWith("text/event-stream")) {
        const d = await r.json().catch(() => ({}));
        throw new Error((d.error && d.error.message) || `HTTP ${r.status}`);
      }
      const reader = r.body.getReader();
      const dec = new TextDecoder();
      let buf = "", done = false;
      while (!done) {
        const { value, done: end } = await reader.read();
        if (end) break;
        buf += dec.decode(value, { stream: true });
        let i;
        while ((i = buf.indexOf("\n\n")) >= 0) {
          const ev = buf.slice(0, i); buf = buf.slice(i + 2);
          for (const line of ev.split("\n")) {
            if (!line.startsWith("data:")) continue;
            const data = line.slice(5).trim();
            if (data === "[DONE]") { done = true; break; }
            const d = JSON.parse(data);
            if (d.error) { err = d.error.message; continue; }
            if (d.timings) timings = d.timings;
            const c = d.choices && d.choices[0] && d.choices[0].delta && d.choices[0].delta.content;
            if (c) {
              if (first === null) first = performance.now();
              n += 1; answer += c; out.textContent += c;
            }
          }
        }
      }
      if (done) reader.cancel().catch(() => {}); // the end of the turn: stop reading
    } catch (e) {
      err = e.name === "AbortError" ? "stopped" : e.message;
    } finally {
      aborter = null;
      $("#chat-stop").disabled = true;
    }
    if (answer) history.push({ role: "assistant", content: answer });
    const secs = first ? ((performance.now() - first) / 1000) : 0;
    let tps = timings && timings.predicted_per_second;
    const src = tps ? "server" : "page";
    if (!tps && n > 1 && secs > 0) tps = (n - 1) / secs;
    let line = `${model}: ${timings && timings.predicted_n || n} tokens`;
    if (tps) line += `, ${tps.toFixed(1)} tok/s (${src})`;
    if (first) line += `, first token ${((first - t0) / 1000).toFixed(2)} s`;
    if (timings && timings.draft_n) {
      line += `, MTP acceptance ${Math.round((100 * timings.draft_n_accepted) / timings.draft_n)}% (${timings.draft_n_accepted}/${timings.draft_n})`;
    }
    if (err) line += ` — ${err}`;
    stats.textContent = line;
    stats.className = err && err !== "stopped" ? "err" : "dim";
  });
}

if ($("#overview")) { connect(); chatSetup(); }
