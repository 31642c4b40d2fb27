"""The dashboard page: one HTML document with its CSS and JS inline.

Nothing is loaded from anywhere but this server (the machines it runs on are often offline, and
the page's Content-Security-Policy forbids it anyway). The script opens `events` (server-sent
events), and redraws the racks from each `state` document; store text is only ever inserted as
text, never as HTML.
"""

from __future__ import annotations

PAGE_HTML = r"""<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>ComputeDomains</title>
<style>
:root {
  --bg: #0e1217; --panel: #161c23; --line: #27313c; --text: #e3e9ef; --muted: #8a97a4;
  --free: #222b35; --ok: #2fa36b; --warn: #e8a33d; --bad: #e5484d;
  font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
}
* { box-sizing: border-box; }
body { margin: 0; background: var(--bg); color: var(--text); font-size: 13px; }
header { display: flex; align-items: center; gap: 18px; padding: 10px 18px; border-bottom: 1px solid var(--line); background: var(--panel); }
header h1 { font-size: 17px; margin: 0; font-weight: 600; }
#summary { display: flex; gap: 14px; color: var(--muted); }
#summary b { color: var(--text); }
.conn { margin-left: auto; padding: 2px 10px; border-radius: 10px; font-size: 12px; border: 1px solid var(--line); }
.conn.live { color: var(--ok); border-color: var(--ok); }
.conn.wait { color: var(--warn); border-color: var(--warn); }
main { display: flex; align-items: flex-start; gap: 18px; padding: 16px 18px; }
#racks { display: flex; flex-wrap: wrap; gap: 16px; flex: 1; }
aside { width: 360px; flex: none; display: flex; flex-direction: column; gap: 6px; }
aside h2 { font-size: 12px; text-transform: uppercase; letter-spacing: .06em; color: var(--muted); margin: 10px 0 2px; font-weight: 600; }
.rack { width: 250px; background: var(--panel); border: 1px solid var(--line); border-radius: 8px; padding: 8px; }
.rack-head { display: flex; justify-content: space-between; align-items: baseline; margin-bottom: 2px; }
.rack-head b { font-size: 14px; }
.rack-sub { color: var(--muted); font-size: 11px; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; margin-bottom: 6px; }
.trays { display: flex; flex-direction: column; gap: 3px; }
.tray { display: grid; grid-template-columns: 26px 1fr auto; align-items: center; gap: 6px; height: 24px; padding: 0 6px;
  border-radius: 4px; background: var(--free); color: var(--muted); cursor: pointer; border: 2px solid transparent; }
.tray .tno { font-variant-numeric: tabular-nums; opacity: .8; font-size: 11px; }
.tray .what { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.tray .what small { opacity: .8; }
.tray .badge { font-size: 10px; font-weight: 700; letter-spacing: .03em; padding: 1px 5px; border-radius: 3px; background: rgba(0,0,0,.25); }
.tray.member { background: var(--c); color: var(--ink); }
.tray.member .badge { background: rgba(0,0,0,.28); color: #fff; }
.tray.down { background: repeating-linear-gradient(135deg, #1a1f25 0 5px, #232a32 5px 10px); color: var(--muted); border-color: #3a4450; border-style: dashed; }
.tray.member.down { background: repeating-linear-gradient(135deg, var(--c) 0 5px, #232a32 5px 10px); color: var(--ink); }
.tray.lost .badge, .tray.failed .badge { background: var(--bad); color: #fff; }
.tray.failed { border-color: var(--bad); }
.tray.waiting .badge { background: var(--warn); color: #111; animation: pulse 1.2s ease-in-out infinite; }
.tray.selected { outline: 2px solid #fff; outline-offset: 1px; }
.tray.dim { opacity: .25; }
@keyframes pulse { 50% { opacity: .45; } }
.switches { margin: 3px 0; padding: 3px 0; text-align: center; font-size: 10px; color: var(--muted); letter-spacing: .05em;
  border: 1px dashed var(--line); border-radius: 4px; }
.domain { background: var(--panel); border: 1px solid var(--line); border-radius: 6px; padding: 7px 9px; cursor: pointer; }
.domain:hover, .domain.focused { border-color: var(--muted); }
.domain .top { display: flex; align-items: center; gap: 8px; }
.swatch { width: 14px; height: 14px; border-radius: 3px; flex: none; }
.domain .name { font-weight: 600; overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
.pill { margin-left: auto; font-size: 11px; font-weight: 700; padding: 1px 8px; border-radius: 9px; flex: none; }
.pill.Ready { background: var(--ok); color: #fff; }
.pill.NotReady { background: var(--warn); color: #111; }
.pill.bad { background: var(--bad); color: #fff; }
.pill.Deleting { background: #555f6b; color: #fff; }
.domain .sub { color: var(--muted); margin-top: 3px; }
.domain .why { margin-top: 3px; }
.domain .why b { color: var(--warn); }
.domain .why.bad b { color: var(--bad); }
.empty { color: var(--muted); font-style: italic; }
#detail { background: var(--panel); border: 1px solid var(--line); border-radius: 6px; padding: 8px 10px; }
#detail dl { display: grid; grid-template-columns: 92px 1fr; gap: 2px 8px; margin: 0; }
#detail dt { color: var(--muted); }
#detail dd { margin: 0; overflow-wrap: anywhere; }
#detail pre { margin: 6px 0 0; max-height: 140px; overflow: auto; font-size: 11px; background: #0b0f13; padding: 6px; border-radius: 4px; white-space: pre-wrap; }
#recent { list-style: none; margin: 0; padding: 0; max-height: 260px; overflow: auto; }
#recent li { padding: 2px 0; border-bottom: 1px solid var(--line); }
#recent time { color: var(--muted); margin-right: 6px; font-variant-numeric: tabular-nums; }
#recent li.warning { color: var(--warn); }
#recent li.error { color: var(--bad); }
.legend { display: grid; grid-template-columns: auto 1fr; gap: 4px 8px; align-items: center; color: var(--muted); }
.legend .tray { width: 92px; height: 20px; cursor: default; grid-template-columns: 1fr; justify-items: end; }
</style>
</head>
<body>
<header>
  <h1 id="title">ComputeDomains</h1>
  <div id="summary"></div>
  <div id="conn" class="conn wait">connecting&hellip;</div>
</header>
<main>
  <section id="racks"><div class="empty">Waiting for the first update&hellip;</div></section>
  <aside>
    <h2>ComputeDomains</h2>
    <div id="domains"></div>
    <h2>Tray</h2>
    <div id="detail"><span class="empty">Click a tray for its details.</span></div>
    <h2>Recent</h2>
    <ol id="recent"></ol>
    <h2>Legend</h2>
    <div class="legend">
      <div class="tray"></div><span>free tray</span>
      <div class="tray member" style="--c:#4e79a7;--ink:#fff"></div><span>in a domain (colour = domain)</span>
      <div class="tray down"></div><span>node agent down / node record gone</span>
      <div class="tray member waiting" style="--c:#4e79a7;--ink:#fff"><span class="badge">STARTING</span></div><span>IMEX daemon not ready yet</span>
      <div class="tray member failed" style="--c:#4e79a7;--ink:#fff"><span class="badge">FAILED</span></div><span>IMEX daemon failing, or node lost</span>
    </div>
  </aside>
</main>
<script>
"use strict";
const $ = (id) => document.getElementById(id);
let current = null;
let selected = null;
let focused = null;

function el(tag, props, ...kids) {
  const node = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") node.className = value;
    else if (key === "text") node.textContent = value;
    else if (key === "vars") for (const [name, v] of Object.entries(value)) node.style.setProperty(name, v);
    else if (key.startsWith("on")) node.addEventListener(key.slice(2), value);
    else node.setAttribute(key, value === true ? "" : String(value));
  }
  for (const kid of kids) if (kid !== null && kid !== undefined) node.append(kid);
  return node;
}

function clock(ms) { return ms ? new Date(ms).toLocaleTimeString() : ""; }

function trayState(t) {
  // What the badge says and how the tray is drawn, most urgent first.
  if (t.member === "LOST") return { badge: "NodeLost", cls: "lost" };
  if (t.domain && !t.up) return { badge: "AGENT DOWN", cls: "failed" };
  if (!t.domain) return { badge: "", cls: "" };
  if (t.index === -1) return { badge: "NO FABRIC", cls: "" };
  if (t.daemon === "FAILED") return { badge: "FAILED", cls: "failed" };
  if (t.daemon === "READY") return { badge: "READY", cls: "" };
  return { badge: t.daemon || "JOINING", cls: "waiting" };
}

function renderTray(t, domains) {
  const d = t.domain ? domains.get(t.domain) : null;
  const s = trayState(t);
  const classes = ["tray"];
  if (d) classes.push("member");
  if (!t.up) classes.push("down");
  if (s.cls) classes.push(s.cls);
  if (t.node === selected) classes.push("selected");
  if (focused && t.domain !== focused) classes.push("dim");
  let label = t.up ? "free" : "agent down";
  if (d) label = d.name;
  else if (t.domain) label = t.domain.slice(0, 8);
  const index = d && t.index !== null && t.index >= 0 ? el("small", { text: " #" + t.index }) : null;
  const tip = [t.node, t.address, d ? d.namespace + "/" + d.name : "free", t.daemon ? "IMEX " + t.daemon : "",
               t.daemon_error].filter(Boolean).join(" · ");
  return el("div", {
      class: classes.join(" "), "data-node": t.node, "data-domain": t.domain, "data-daemon": t.daemon,
      "data-member": t.member, "data-up": String(t.up), title: tip,
      vars: d ? { "--c": d.colour, "--ink": d.ink } : null,
      onclick: () => { selected = selected === t.node ? null : t.node; render(current); },
    },
    el("span", { class: "tno", text: String(t.tray).padStart(2, "0") }),
    el("span", { class: "what" }, label, index),
    s.badge ? el("span", { class: "badge", text: s.badge }) : el("span"));
}

function renderRacks(doc, domains) {
  const racks = $("racks");
  racks.replaceChildren();
  if (!doc.racks.length) racks.append(el("div", { class: "empty", text: "No nodes known yet." }));
  for (const rack of doc.racks) {
    const used = rack.trays.filter((t) => t.domain).length;
    const up = rack.trays.filter((t) => t.up).length;
    const trays = el("div", { class: "trays" });
    rack.trays.forEach((t, i) => {
      // An NVL72 rack holds 10 compute trays above its 9 NVLink switch trays and 8 below.
      if (rack.trays.length === 18 && i === 10) trays.append(el("div", { class: "switches", text: "NVLink switch trays" }));
      trays.append(renderTray(t, domains));
    });
    racks.append(el("div", { class: "rack", "data-rack": rack.name },
      el("div", { class: "rack-head" }, el("b", { text: rack.name }),
         el("span", { class: "rack-sub", text: used + "/" + rack.trays.length + " in use" + (up < rack.trays.length ? ", " + (rack.trays.length - up) + " down" : "") })),
      el("div", { class: "rack-sub", title: rack.cliques.join(", "), text: rack.cliques.length ? "clique " + rack.cliques.join(", ") : "no clique" }),
      trays));
  }
}

function renderDomains(doc) {
  const list = $("domains");
  list.replaceChildren();
  if (!doc.domains.length) list.append(el("div", { class: "empty", text: "No ComputeDomains." }));
  for (const d of doc.domains) {
    const bad = d.reason === "NodeLost" || d.reason === "PeerUnreachable" || d.reason === "ImexDaemonFailed";
    const pill = d.deleting ? "Deleting" : d.status;
    const why = d.status !== "Ready" && d.reason
      ? el("div", { class: "why" + (bad ? " bad" : "") }, el("b", { text: d.reason }), ": " + d.message) : null;
    const wanted = d.num_nodes > 0 ? " (numNodes " + d.num_nodes + ")" : "";
    list.append(el("div", {
        class: "domain" + (focused === d.uid ? " focused" : ""), "data-uid": d.uid, "data-status": d.status,
        "data-reason": d.reason,
        onclick: () => { focused = focused === d.uid ? null : d.uid; render(current); },
      },
      el("div", { class: "top" }, el("span", { class: "swatch", vars: { background: d.colour } }),
         el("span", { class: "name", text: d.namespace + "/" + d.name }),
         el("span", { class: "pill " + pill + (bad && !d.deleting ? " bad" : ""), text: pill })),
      el("div", { class: "sub", text: d.ready_members + "/" + d.members + " nodes ready" + wanted }),
      why));
  }
}

function renderDetail(doc, domains) {
  const box = $("detail");
  const t = selected && doc.racks.flatMap((r) => r.trays).find((x) => x.node === selected);
  if (!t) { box.replaceChildren(el("span", { class: "empty", text: "Click a tray for its details." })); return; }
  const d = t.domain ? domains.get(t.domain) : null;
  const rows = [
    ["node", t.node], ["address", t.address], ["clique", t.clique || "-"],
    ["node agent", t.up ? "up (" + t.health + ")" : "down: no node record"],
    ["fabric", t.fabric_message || ""],
    ["domain", d ? d.namespace + "/" + d.name : (t.domain || "none")],
    ["index", t.domain ? String(t.index) : ""], ["member", t.member],
    ["IMEX daemon", t.daemon ? t.daemon + (t.restarts ? " (" + t.restarts + " restarts)" : "")
                    + (t.up ? "" : " (last reported by the agent)") : ""],
    ["last error", t.daemon_error],
  ].filter(([, v]) => v);
  const dl = el("dl");
  for (const [k, v] of rows) dl.append(el("dt", { text: k }), el("dd", { text: v }));
  box.replaceChildren(dl);
  if (t.daemon_log.length) box.append(el("pre", { text: t.daemon_log.join("\n") }));
}

function renderRecent(doc) {
  const list = $("recent");
  list.replaceChildren();
  for (const r of doc.recent) {
    list.append(el("li", { class: r.severity }, el("time", { text: clock(r.at_unix_ms) }), r.text));
  }
  if (!doc.recent.length) list.append(el("li", { class: "empty", text: "Nothing yet." }));
}

function render(doc) {
  if (!doc) return;
  current = doc;
  document.title = doc.title;
  $("title").textContent = doc.title;
  const s = doc.summary;
  $("summary").replaceChildren(
    el("span", {}, el("b", { text: s.nodes_up + "/" + s.nodes }), " node agents up"),
    el("span", {}, el("b", { text: String(s.nodes_in_domains) }), " trays in domains"),
    el("span", {}, el("b", { text: s.domains_ready + "/" + s.domains }), " domains Ready"),
    el("span", { id: "updated", "data-version": doc.version, text: "updated " + new Date().toLocaleTimeString() }));
  const domains = new Map(doc.domains.map((d) => [d.uid, d]));
  if (focused && !domains.has(focused)) focused = null;
  renderRacks(doc, domains);
  renderDomains(doc);
  renderDetail(doc, domains);
  renderRecent(doc);
}

function connect() {
  const conn = $("conn");
  const source = new EventSource("events");
  source.addEventListener("open", () => { conn.className = "conn live"; conn.textContent = "live"; });
  source.addEventListener("error", () => { conn.className = "conn wait"; conn.textContent = "reconnecting\u2026"; });
  source.addEventListener("state", (event) => render(JSON.parse(event.data)));
}
connect();
</script>
</body>
</html>
"""
