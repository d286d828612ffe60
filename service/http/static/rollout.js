// The rollout page: every figure comes from the admin API, called with the token the operator
// typed (kept in this closure only: no storage, no cookie). Data is written with textContent
// only, since the texts shown are whatever clients sent to /predict.
"use strict";
(() => {
  let token = null;
  let state = null;
  let timer = null;
  let worstShown = null;
  let manifests = null;  // GET /admin/manifests: the bundles, A against B and the shadow
  let bundlesShown = null;  // the bundle ids the manifests were read for
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
    manifests = null;
    bundlesShown = null;
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
    await refreshManifests();
    refreshAgreement();
    refreshLive();
    timer = setInterval(() => {
      refreshState().then(() => { if (bundlesNow() !== bundlesShown) refreshManifests(); }).catch(() => {});
      refreshAgreement();
      refreshLive();
    }, 5000);
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

  // ------------------------------------------------------------------ bundles side by side

  const bundlesNow = () => (state ? `${state.variants.A.bundle_id} ${state.variants.B.bundle_id}` : null);

  async function refreshManifests() {
    try {
      manifests = await api("GET", "/admin/manifests");
      bundlesShown = bundlesNow();
    } catch (err) {
      $("scores-note").textContent = err.message;
      return;
    }
    renderManifests();
    renderDashboards();
  }

  // Whether A's scores and the other side's compare, and why (not): [comparable, why].
  function scoresAgainst(other) {
    const pair = manifests && manifests.against_a[other];
    if (!pair) return [false, `no ${other === "B" ? "candidate" : "shadow"} bundle to compare scores with`];
    return [pair.scores_comparable, pair.why];
  }

  // An ISO date as "2026-11-26 06:04" in UTC (the page's readers may be anywhere).
  const utc = (iso) => { const d = new Date(iso); return isNaN(d) ? iso : d.toISOString().slice(0, 16).replace("T", " "); };
  const shown = (value) => (value === null || value === undefined || value === "" ? "–" : String(value));

  function renderManifests() {
    if (!manifests) return;
    const against = $("against").value;
    const a = manifests.variants.A, other = manifests.variants[against], pair = manifests.against_a[against];
    const name = against === "B" ? "B" : "shadow";
    const table = $("manifest-table");
    if (!other || other.error || !pair) {
      const why = !other ? (against === "B" ? "B has no bundle loaded" : "no shadow configured (XMCSERVE_SHADOW_URL)") : other.error;
      table.replaceChildren(el("tr", {}, el("td", { class: "muted" }, why)));
      $("scores-note").textContent = "";
    } else {
      const rows = pair.rows.filter((row) => row.differs || !$("only-differences").checked);
      table.replaceChildren(
        el("tr", {}, el("th", {}, "manifest field"), el("th", {}, `A · ${a.bundle_id}`), el("th", {}, `${name} · ${other.bundle_id}`)),
        ...rows.map((row) => el("tr", { class: row.differs ? "differs" : "same" },
          el("td", {}, el("span", { class: "mark" }, row.differs ? "≠ " : "= "), row.field),
          el("td", {}, shown(row.a)), el("td", {}, shown(row.b)))));
      if (!rows.length) table.append(el("tr", {}, el("td", { class: "muted" }, "the two manifests agree on every field")));
      const [comparable, why] = scoresAgainst(against);
      $("scores-note").textContent = comparable ? `Scores comparable: ${why}.` : `Score deltas not shown: ${why}.`;
      $("scores-note").className = comparable ? "note ok" : "note warn";
    }
    renderQuality();
  }

  function renderQuality() {
    const metrics = ["P@1", "P@5", "nDCG@5", "PSP@5", "R@100"];
    const head = el("tr", {}, ...["variant", "bundle", "split", "evaluated (UTC)"].map((h) => el("th", {}, h)),
      ...metrics.map((m) => el("th", { class: "num" }, m)), el("th", {}, ""));
    const rows = [];
    for (const name of ["A", "B", "shadow"]) {
      const bundle = manifests.variants[name];
      if (!bundle || bundle.error) continue;
      if (bundle.evaluations === null) {
        rows.push(el("tr", {}, el("td", {}, name), el("td", { class: "id" }, bundle.bundle_id),
          el("td", { colspan: String(metrics.length + 3), class: "muted" }, "evaluated on the shadow's machine, beside its bundle: not readable from here")));
        continue;
      }
      if (!bundle.evaluations.length) {
        rows.push(el("tr", {}, el("td", {}, name), el("td", { class: "id" }, bundle.bundle_id),
          el("td", { colspan: String(metrics.length + 3), class: "muted" }, `no evaluation stored beside ${bundle.path}: make evaluate BUNDLE=${bundle.path}`)));
        continue;
      }
      for (const ev of bundle.evaluations) {
        const note = ev.stale ? `measured ${ev.bundle_id}, not the loaded build` : `${ev.instances || "?"} instances`;
        rows.push(el("tr", { class: ev.stale ? "stale" : "" }, el("td", {}, name), el("td", { class: "id" }, bundle.bundle_id),
          el("td", {}, shown(ev.split)), el("td", { title: `${ev.date} (${ev.dated_by}), ${ev.file}` }, utc(ev.date)),
          ...metrics.map((m) => el("td", { class: "num" }, ev.metrics[m] === undefined ? "–" : fmt(ev.metrics[m], 2))),
          el("td", { class: ev.stale ? "warn" : "muted" }, note)));
      }
    }
    $("quality-table").replaceChildren(head, ...rows);
  }

  function renderDashboards() {
    const links = manifests ? manifests.dashboards : [];
    if (!links.length) {
      $("dashboards").replaceChildren("Grafana dashboards: no URL configured (XMCSERVE_GRAFANA_URL).");
      return;
    }
    const items = [];
    for (const link of links) {
      if (items.length) items.push(" · ");
      items.push(el("a", { href: link.url, target: "_blank", rel: "noopener noreferrer" }, link.uid), ` (${link.title})`);
    }
    $("dashboards").replaceChildren("Grafana dashboards: ", ...items);
  }

  // ------------------------------------------------------------------ live traffic per variant

  const VARIANT_CLASS = { A: "series-a", B: "series-b" };

  async function refreshLive() {
    const windowS = Number($("live-window").value);
    let data;
    try {
      data = await api("GET", `/admin/live?window_s=${windowS}`);
    } catch (err) {
      $("live-split").textContent = err.message;
      return;
    }
    $("live-split").textContent = `split to B ${data.split_b}: ${Math.round((1 - data.split_b) * 100)} % of requests to A, ${Math.round(data.split_b * 100)} % to B`;
    const names = Object.keys(data.variants).sort();
    const head = el("tr", {}, el("th", {}, "variant"),
      ...["requests", "QPS", "p50 ms", "p99 ms", "failed"].map((h) => el("th", { class: "num" }, h)));
    const rows = names.map((name) => {
      const v = data.variants[name];
      return el("tr", {}, el("td", {}, el("span", { class: `swatch ${VARIANT_CLASS[name] || ""}` }), ` ${name}`),
        el("td", { class: "num" }, String(v.requests)), el("td", { class: "num" }, fmt(v.qps, 2)),
        el("td", { class: "num" }, fmt(v.p50_ms, 1)), el("td", { class: "num" }, fmt(v.p99_ms, 1)),
        el("td", { class: "num" }, v.failed_share === null ? "–" : `${fmt(100 * v.failed_share, 1)} % (${v.failed})`));
    });
    if (!rows.length) rows.push(el("tr", {}, el("td", { colspan: "6", class: "muted" }, "no /predict answered in this window")));
    $("live-table").replaceChildren(head, ...rows);
    const span = fitted(Object.values(data.series).flat(), data.now - windowS, data.now, data.interval_s);
    const lines = (column) => names.map((name) => ({
      name, cls: VARIANT_CLASS[name] || "", points: (data.series[name] || []).filter((p) => p[column] !== null).map((p) => [p[0], p[column]]),
    }));
    $("live-charts").replaceChildren(
      chart("QPS", lines(1), { ...span, min: 0, lines: true }),
      chart("p99 latency, ms", lines(3), { ...span, min: 0, lines: true }),
      chart("failed share", lines(4), { ...span, min: 0, max: 1, lines: true }));
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
      refreshManifests();
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
      refreshManifests();
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
    const comparable = result.scores.comparable;
    $("compare-scores").textContent = comparable ? "" : `Score deltas not shown: ${result.scores.why}.`;
    $("compare-scores").className = comparable ? "note" : "note warn";
    const blocks = result.texts.map((text, i) => {
      const a = result.sides.A, b = result.sides.B;
      const agreement = result.agreement[i];
      const delta = comparable ? ` · mean |score Δ| ${fmt(agreement && agreement.score_delta, 4)}` : "";
      const summary = agreement
        ? `overlap@${result.k} ${fmt(agreement.overlap, 2)} · rank correlation (τ) ${fmt(agreement.kendall_tau, 2)}${delta}`
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

  // The time span a plot shows: from its first point (less one sampling interval, so a lone point
  // is not on the axis) or the window's start, whichever is later, to now; the whole window when empty.
  function fitted(points, windowFrom, now, interval) {
    if (!points.length) return { from: windowFrom, to: now };
    const first = Math.min(...points.map((p) => p[0]));
    return { from: Math.max(windowFrom, Math.min(first - interval, now - 60)), to: now };
  }

  // Tick marks every 10 s, 30 s, 1, 2, 5, 10 or 15 min: the first that gives at most 6 over the span.
  function timeTicks(from, to) {
    const span = to - from;
    const step = [10, 30, 60, 120, 300, 600, 900, 1800].find((s) => span / s <= 6) || 3600;
    const ticks = [];
    for (let t = to; t >= from - 1e-6; t -= step) ticks.push(t);
    const label = (t) => {
      const ago = Math.round(to - t);
      if (ago === 0) return "now";
      return ago < 60 ? `−${ago} s` : `−${+(ago / 60).toFixed(1)} min`;
    };
    return ticks.map((t) => [t, label(t)]);
  }

  // One small plot of one or more series of [time, value] points as inline SVG: dots (or bars), or
  // dots joined by lines; a legend when there are several series.
  function chart(title, series, { from, to, min, max, bars = false, lines = false }) {
    const W = 320, H = 130, L = 40, R = 6, T = 18, B = 18;
    if (!Array.isArray(series) || (series.length && !series[0].points)) series = [{ name: "", cls: "", points: series }];
    const values = series.flatMap((s) => s.points.map((p) => p[1]));
    if (min === undefined) min = Math.min(0, ...values);
    if (max === undefined) max = Math.max(min + 1e-9, ...values);
    const x = (t) => L + ((t - from) / (to - from || 1)) * (W - L - R);
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
    const count = series.reduce((n, s) => n + s.points.length, 0);
    add("text", { x: L, y: 12, class: "title" }, `${title} (${count})`);
    if (series.length > 1) {
      let lx = W - R;
      for (const s of [...series].reverse()) {
        const label = add("text", { x: lx, y: 12, class: `legend ${s.cls}`, "text-anchor": "end" }, `● ${s.name}`);
        lx -= 8 * (s.name.length + 3);
        label.setAttribute("data-series", s.name);
      }
    }
    add("line", { x1: L, y1: T, x2: L, y2: H - B, class: "axis" });
    add("line", { x1: L, y1: H - B, x2: W - R, y2: H - B, class: "axis" });
    const digits = Math.max(Math.abs(min), Math.abs(max)) >= 10 ? 0 : 2;
    add("text", { x: L - 4, y: T + 4, class: "tick", "text-anchor": "end" }, fmt(max, digits));
    add("text", { x: L - 4, y: H - B, class: "tick", "text-anchor": "end" }, fmt(min, digits));
    if (min < 0 && max > 0) add("line", { x1: L, y1: y(0), x2: W - R, y2: y(0), class: "zero" });
    for (const [t, label] of timeTicks(from, to)) {
      add("line", { x1: x(t), y1: H - B, x2: x(t), y2: H - B + 3, class: "axis" });
      const anchor = x(t) > W - R - 12 ? "end" : x(t) < L + 12 ? "start" : "middle";
      add("text", { x: x(t), y: H - 4, class: "tick", "text-anchor": anchor }, label);
    }
    if (!count) add("text", { x: (L + W - R) / 2, y: (T + H - B) / 2, class: "tick", "text-anchor": "middle" }, "no points in this window");
    for (const s of series) {
      if (lines && s.points.length > 1) {
        add("polyline", { points: s.points.map(([t, v]) => `${x(t)},${y(v)}`).join(" "), class: `line ${s.cls}` });
      }
      for (const [t, v] of s.points) {
        if (bars) add("rect", { x: x(t) - 2, y: y(v), width: 4, height: H - B - y(v), class: "point bar" });
        else add("circle", { cx: x(t), cy: y(v), r: 2.5, class: `point ${s.cls}` });
      }
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
    const series = (column) => data.compared.filter((c) => c[column] !== null).map((c) => [c[0], c[column]]);
    const { from, to } = fitted([...data.compared, ...data.dropped], data.now - windowS, data.now, 5);
    const bucket = (to - from) / 60;  // drops summed over 60 bins of the span shown
    const binned = new Map();
    for (const [second, , copies] of data.dropped) {
      const bin = from + (Math.floor((second - from) / bucket) + 0.5) * bucket;
      binned.set(bin, (binned.get(bin) || 0) + copies);
    }
    const [comparable, why] = scoresAgainst("shadow");
    const overlaps = series(1);
    const mean = overlaps.length ? overlaps.reduce((s, p) => s + p[1], 0) / overlaps.length : null;
    $("agreement-summary").textContent = data.shadow.target
      ? `A against the shadow ${data.shadow.target} (fraction ${data.shadow.fraction}): ${overlaps.length} texts compared, mean overlap@k ${fmt(mean, 3)}; the last ${data.capacity} comparisons are kept`
      : "no shadow configured (XMCSERVE_SHADOW_URL): nothing is compared";
    const charts = [
      chart("overlap@k", overlaps, { from, to, min: 0, max: 1 }),
      chart("rank correlation (τ)", series(2), { from, to, min: -1, max: 1 }),
      chart("latency Δ shadow − A, ms", series(4), { from, to }),
      chart("dropped copies", [...binned.entries()], { from, to, min: 0, max: Math.max(1, ...binned.values()), bars: true }),
    ];
    if (comparable) charts.splice(2, 0, chart("mean |score Δ|", series(3), { from, to }));
    $("charts").replaceChildren(...charts);
    $("agreement-scores").textContent = data.shadow.target && !comparable ? `Mean |score Δ| not plotted: ${why}.` : "";
    $("agreement-scores").className = "note warn";
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
    $("live-window").addEventListener("change", refreshLive);
    $("against").addEventListener("change", renderManifests);
    $("only-differences").addEventListener("change", renderManifests);
  });
})();
