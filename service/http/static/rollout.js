// The rollout page: every figure comes from the admin API, called with the token the operator
// typed (kept in this closure only: no storage, no cookie). Data is written with textContent
// only, since the texts shown are whatever clients sent to /predict.
"use strict";
(() => {
  let token = null;
  let state = null;
  let timer = null;
  let worstShown = null;
  const $ = (id) => document.getElementById(id);
  const SVG = "http://www.w3.org/2000/svg";

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, value);
    for (const child of children) node.append(child);
    return node;
  }

  // The API's error in words: FastAPI's detail is a string or a list of validation errors.
  function describe(status, body) {
    let detail = body && body.detail !== undefined ? body.detail : body;
    if (Array.isArray(detail)) detail = detail.map((e) => `${(e.loc || []).slice(1).join(".")}: ${e.msg}`).join("; ");
    return `${status}: ${typeof detail === "string" ? detail : JSON.stringify(detail)}`;
  }

  async function api(method, path, body) {
    const headers = { "X-Admin-Token": token };
    if (body !== undefined) headers["Content-Type"] = "application/json";
    let response;
    try {
      response = await fetch(path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    } catch (err) {
      throw new Error(`the server did not answer (${err.message})`);
    }
    const text = await response.text();
    let parsed = text;
    try { parsed = JSON.parse(text); } catch (_) { /* not JSON: keep the text */ }
    if (response.status === 401 || response.status === 403) lock(describe(response.status, parsed));
    if (!response.ok) throw new Error(describe(response.status, parsed));
    return parsed;
  }

  function lock(message) {
    token = null;
    state = null;
    worstShown = null;
    clearInterval(timer);
    $("main").hidden = true;
    $("gate").hidden = false;
    $("gate-error").textContent = message || "";
    $("who").textContent = "";
  }

  async function unlock(event) {
    event.preventDefault();
    token = $("token").value;
    $("token").value = "";
    try {
      await refreshState();
    } catch (err) {
      lock(err.message);
      return;
    }
    $("gate").hidden = true;
    $("main").hidden = false;
    $("gate-error").textContent = "";
    $("who").textContent = "unlocked";
    loadBundles().catch((err) => show("action-result", err.message, true));
    refreshAgreement();
    timer = setInterval(() => { refreshState().catch(() => {}); refreshAgreement(); }, 5000);
  }

  function show(id, message, isError) {
    const node = $(id);
    node.textContent = message;
    node.className = isError ? "result error" : "result ok";
  }

  async function refreshState() {
    state = await api("GET", "/admin/state");
    for (const name of ["A", "B"]) {
      const variant = state.variants[name];
      $(`${name.toLowerCase()}-bundle`).textContent = variant.bundle_id || "no bundle loaded";
      $(`${name.toLowerCase()}-source`).textContent = variant.source || "";
    }
    const shadow = state.shadow;
    $("shadow-target").textContent = shadow.target ? `${shadow.target} (fraction ${shadow.fraction})` : "no shadow configured";
    $("shadow-depth").textContent = shadow.target ? `${shadow.queue_depth} copies outstanding` : "";
    if (document.activeElement !== $("split")) $("split").value = state.split_b;
    if (document.activeElement !== $("fraction")) $("fraction").value = shadow.fraction;
    $("promote").disabled = !state.variants.B.bundle_id;
    $("rollback").disabled = !state.previous.bundle_id;
  }

  async function loadBundles() {
    const { bundles } = await api("GET", "/admin/bundles");
    $("bundle").replaceChildren(...bundles.map((b) => el("option", { value: b.name }, `${b.name} (${b.bundle_id || "no bundle id"})`)));
  }

  async function applyConfig(event) {
    event.preventDefault();
    const body = {};
    if (state === null || Number($("split").value) !== state.split_b) body.split_b = Number($("split").value);
    if (state === null || Number($("fraction").value) !== state.shadow.fraction) body.shadow_fraction = Number($("fraction").value);
    try {
      const after = await api("POST", "/admin/config", body);
      show("config-result", `split to B ${after.split_b}, shadow fraction ${after.shadow.fraction}`);
      await refreshState();
    } catch (err) {
      show("config-result", err.message, true);
    }
  }

  async function reloadB(event) {
    event.preventDefault();
    const bundle = $("bundle").value;
    show("action-result", `loading ${bundle} into B (verified and warmed first)…`);
    try {
      const r = await api("POST", "/admin/reload", { variant: "B", bundle });
      show("action-result", `B now serves ${r.bundle_id}` + (r.previous_bundle_id ? ` (was ${r.previous_bundle_id})` : ""));
      await refreshState();
    } catch (err) {
      show("action-result", err.message, true);
    }
  }

  function askPromote() {
    const a = state.variants.A.bundle_id, b = state.variants.B.bundle_id;
    $("promote-text").textContent = `Promote B (${b}) to A? A's bundle ${a} stops serving, all traffic goes to ${b} and the split resets to 0.`;
    $("promote-dialog").showModal();
  }

  async function promote() {
    if ($("promote-dialog").returnValue !== "confirm") return;
    try {
      const r = await api("POST", "/admin/promote");
      show("action-result", `promoted: A now serves ${r.promoted_bundle_id} (was ${r.previous_bundle_id})`);
      await refreshState();
    } catch (err) {
      show("action-result", err.message, true);
    }
  }

  function askRollback() {
    const a = state.variants.A.bundle_id, back = state.previous.bundle_id;
    $("rollback-text").textContent = `Roll A back to ${back}? A's bundle ${a} stops serving and is kept as the previous one; B and the split are unchanged.`;
    $("rollback-dialog").showModal();
  }

  async function rollback() {
    if ($("rollback-dialog").returnValue !== "confirm") return;
    try {
      const r = await api("POST", "/admin/rollback");
      show("action-result", `rolled back: A now serves ${r.restored_bundle_id} (was ${r.previous_bundle_id})`);
      await refreshState();
    } catch (err) {
      show("action-result", err.message, true);
    }
  }

  // ------------------------------------------------------------------ compare

  async function runCompare(event) {
    if (event) event.preventDefault();
    const texts = $("texts").value.split("\n").map((t) => t.trim()).filter((t) => t);
    const exclude = $("exclude").value.split(",").map((u) => u.trim()).filter((u) => u);
    const body = { texts, k: Number($("k").value), exclude };
    $("compare-error").textContent = "";
    try {
      renderCompare(await api("POST", "/admin/compare", body));
    } catch (err) {
      $("compare-error").textContent = err.message;
      $("compare-result").replaceChildren();
    }
  }

  const fmt = (x, digits = 3) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));

  function sideColumn(side, labels) {
    const head = el("div", { class: "side-head" }, el("strong", {}, side.variant), ` ${side.bundle_id || "no bundle"}`);
    if (side.latency_ms !== null && side.latency_ms !== undefined) head.append(el("span", { class: "latency" }, ` · ${fmt(side.latency_ms, 1)} ms`));
    const column = el("div", { class: `side side-${side.variant}` }, head);
    if (side.error) {
      column.append(el("p", { class: "error" }, side.error));
      return column;
    }
    const table = el("table", {}, el("tr", {}, el("th", {}, "#"), el("th", {}, "label"), el("th", {}, "score")));
    labels.forEach((label, rank) => {
      const row = el("tr", { class: label.shared ? "shared" : "only" },
        el("td", {}, String(rank + 1)),
        el("td", { title: label.uid }, el("span", { class: "mark" }, label.shared ? "● " : "○ "), label.text),
        el("td", { class: "num" }, fmt(label.score, 4)));
      table.append(row);
    });
    column.append(table);
    return column;
  }

  function renderCompare(result) {
    const blocks = result.texts.map((text, i) => {
      const a = result.sides.A, b = result.sides.B;
      const agreement = result.agreement[i];
      const summary = agreement
        ? `overlap@${result.k} ${fmt(agreement.overlap, 2)} · rank correlation (τ) ${fmt(agreement.kendall_tau, 2)} · mean |score Δ| ${fmt(agreement.score_delta, 4)}`
        : "no agreement: one side did not answer";
      return el("div", { class: "query" },
        el("h3", {}, text),
        el("p", { class: "agreement" }, summary),
        el("div", { class: "pair" }, sideColumn(a, a.results ? a.results[i] : []), sideColumn(b, b.results ? b.results[i] : [])));
    });
    $("compare-result").replaceChildren(...blocks);
  }

  function openInCompare(item) {
    $("texts").value = item.text;
    $("k").value = item.k;
    $("exclude").value = "";
    $("compare-panel").scrollIntoView();
    runCompare();
  }

  // ------------------------------------------------------------------ agreement over time

  // One small scatter plot (or bars) of [time, value] points as inline SVG.
  function chart(title, points, { from, to, min, max, bars = false }) {
    const W = 320, H = 130, L = 40, R = 6, T = 18, B = 18;
    const values = points.map((p) => p[1]);
    if (min === undefined) min = Math.min(0, ...values);
    if (max === undefined) max = Math.max(min + 1e-9, ...values);
    const x = (t) => L + ((t - from) / (to - from)) * (W - L - R);
    const y = (v) => T + (1 - (v - min) / (max - min || 1)) * (H - T - B);
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("viewBox", `0 0 ${W} ${H}`);
    svg.setAttribute("class", "chart");
    const add = (tag, attrs, text) => {
      const node = document.createElementNS(SVG, tag);
      for (const [key, value] of Object.entries(attrs)) node.setAttribute(key, value);
      if (text !== undefined) node.textContent = text;
      svg.append(node);
      return node;
    };
    add("text", { x: L, y: 12, class: "title" }, `${title} (${points.length})`);
    add("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" });
    add("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" });
    const digits = Math.max(Math.abs(min), Math.abs(max)) >= 10 ? 0 : 2;
    add("text", { x: L - 4, y: T + 4, class: "tick", "text-anchor": "end" }, fmt(max, digits));
    add("text", { x: L - 4, y: H - B, class: "tick", "text-anchor": "end" }, fmt(min, digits));
    if (min < 0 && max > 0) add("line", { x1: L, y1: y(0), x2: W - R, y2: y(0), class: "zero" });
    add("text", { x: L, y: H - 4, class: "tick" }, `−${Math.round((to - from) / 60)} min`);
    add("text", { x: W - R, y: H - 4, class: "tick", "text-anchor": "end" }, "now");
    for (const [t, v] of points) {
      if (bars) add("rect", { x: x(t) - 2, y: y(v), width: 4, height: H - B - y(v), class: "point bar" });
      else add("circle", { cx: x(t), cy: y(v), r: 2.5, class: "point" });
    }
    return svg;
  }

  async function refreshAgreement() {
    const windowS = Number($("window").value);
    let data;
    try {
      data = await api("GET", `/admin/agreement?window_s=${windowS}&worst=10`);
    } catch (err) {
      $("agreement-summary").textContent = err.message;
      return;
    }
    const to = data.now, from = to - windowS;
    const series = (column) => data.compared.filter((c) => c[column] !== null).map((c) => [c[0], c[column]]);
    const bucket = windowS / 60;  // drops summed over 60 bins
    const binned = new Map();
    for (const [second, , copies] of data.dropped) {
      const bin = from + (Math.floor((second - from) / bucket) + 0.5) * bucket;
      binned.set(bin, (binned.get(bin) || 0) + copies);
    }
    const overlaps = series(1);
    const mean = overlaps.length ? overlaps.reduce((s, p) => s + p[1], 0) / overlaps.length : null;
    $("agreement-summary").textContent = data.shadow.target
      ? `A against the shadow ${data.shadow.target} (fraction ${data.shadow.fraction}): ${overlaps.length} texts compared, mean overlap@k ${fmt(mean, 3)}; the last ${data.capacity} comparisons are kept`
      : "no shadow configured (XMCSERVE_SHADOW_URL): nothing is compared";
    $("charts").replaceChildren(
      chart("overlap@k", overlaps, { from, to, min: 0, max: 1 }),
      chart("rank correlation (τ)", series(2), { from, to, min: -1, max: 1 }),
      chart("mean |score Δ|", series(3), { from, to }),
      chart("latency Δ shadow − A, ms", series(4), { from, to }),
      chart("dropped copies", [...binned.entries()], { from, to, min: 0, max: Math.max(1, ...binned.values()), bars: true }));
    const worstNow = JSON.stringify(data.worst.map((item) => [item.text, item.k, item.overlap, item.kendall_tau]));
    if (worstNow === worstShown) return;  // unchanged: the list stays still under the pointer
    worstShown = worstNow;
    $("worst").replaceChildren(...data.worst.map((item) => {
      const button = el("button", { type: "button", class: "link" }, item.text);
      button.addEventListener("click", () => openInCompare(item));
      return el("li", {}, button, el("span", { class: "muted" }, ` overlap@${item.k} ${fmt(item.overlap, 2)}, τ ${fmt(item.kendall_tau, 2)}`));
    }));
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("gate").addEventListener("submit", unlock);
    $("config-form").addEventListener("submit", applyConfig);
    $("reload-form").addEventListener("submit", reloadB);
    $("promote").addEventListener("click", askPromote);
    $("promote-dialog").addEventListener("close", promote);
    $("rollback").addEventListener("click", askRollback);
    $("rollback-dialog").addEventListener("close", rollback);
    $("compare-form").addEventListener("submit", runCompare);
    $("window").addEventListener("change", refreshAgreement);
  });
})();
