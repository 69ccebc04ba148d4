// orchid-gateway status page: polls /status.json with the admin key as a bearer header.
// The key lives in this tab's sessionStorage only; values are rendered with textContent.
"use strict";
(function () {
  const KEY = "orchid.status.key";
  const POLL_MS = 2000;
  const SHOWN_DECISIONS = 25; // of the 100 the JSON carries
  const SVG = "http://www.w3.org/2000/svg";
  let timer = null;

  const $ = (id) => document.getElementById(id);
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v; else node.setAttribute(k, v);
    }
    for (const child of children) node.append(child instanceof Node ? child : String(child));
    return node;
  }
  const fmt = (v, digits) => (v === null || v === undefined ? "∞" : Number(v).toFixed(digits));
  const pct = (v) => (v === null || v === undefined ? "–" : (100 * v).toFixed(1) + " %");
  const clock = (t) => new Date(t * 1000).toLocaleTimeString();
  function rows(tbody, items, cells) {
    tbody.replaceChildren(...items.map((item) => {
      const tr = el("tr");
      for (const cell of cells(item)) tr.append(cell instanceof Node ? cell : el("td", {}, cell));
      return tr;
    }));
  }
  function show(which) {
    for (const id of ["signin", "refused", "board"]) $(id).hidden = id !== which;
    $("signout").hidden = which === "signin";
  }

  function chart(history) {
    const w = 600, h = 150, pad = 4;
    const svg = document.createElementNS(SVG, "svg");
    svg.setAttribute("class", "chart");
    svg.setAttribute("viewBox", `0 0 ${w} ${h}`);
    svg.setAttribute("preserveAspectRatio", "none");
    if (history.length < 2) return svg;
    const t0 = history[0][0], t1 = history[history.length - 1][0];
    const top = Math.max(1, ...history.map((p) => Math.max(p[1] || 0, p[2] || 0))) * 1.15;
    const x = (t) => pad + ((w - 2 * pad) * (t - t0)) / Math.max(1, t1 - t0);
    const y = (v) => h - pad - ((h - 2 * pad) * Math.min(v, top)) / top;
    for (const [index, color] of [[2, "#c62828"], [1, "#2563eb"]]) {
      const line = document.createElementNS(SVG, "polyline");
      line.setAttribute("fill", "none");
      line.setAttribute("stroke", color);
      line.setAttribute("stroke-width", index === 2 ? "1.5" : "2");
      if (index === 2) line.setAttribute("stroke-dasharray", "6 4");
      line.setAttribute("points", history.map((p) => `${x(p[0]).toFixed(1)},${y(p[index] === null ? top : p[index]).toFixed(1)}`).join(" "));
      svg.append(line);
    }
    return svg;
  }

  function renderPool(pool) {
    const box = el("div", { class: "pool", "data-pool": pool.name });
    const healthy = pool.healthy_devices === null ? "–" : pool.healthy_devices;
    box.append(el("div", { class: "pool-head" },
      el("h3", {}, pool.name),
      el("span", { class: "figure" }, "ladder step ", el("b", { class: `step step-${pool.step}` }, pool.step), pool.stale ? " (stale evidence)" : ""),
      el("span", { class: "figure" }, "offered ", el("b", { class: "offered" }, fmt(pool.offered_ms_per_s, 1)), " ms/s"),
      el("span", { class: "figure" }, "protected ", el("b", { class: "protected" }, fmt(pool.protected_ms_per_s, 1)), " ms/s"),
      el("span", { class: "figure" }, "utilization ", el("b", { class: "utilization" }, pct(pool.utilization))),
      el("span", { class: "figure" }, "devices healthy ", el("b", { class: "devices" }, `${healthy} / ${pool.devices}`)),
      el("span", { class: "figure" }, "queue ", el("b", { class: "queue-depth" }, pool.queue.depth), ` waiting (${fmt(pool.queue.queued_ms, 1)} ms), ${pool.queue.inflight} bound`),
      el("span", { class: "figure" }, "dwell p95 ", el("b", {}, fmt(pool.queue.dwell_p95_ms, 1)), ` ms (budget ${fmt(pool.queue.dwell_budget_ms, 0)})`),
      el("span", { class: "figure" }, "fallback ", el("b", { class: "fallback-share" }, pct(pool.fallback_share)), " · reduced output ", el("b", { class: "reduced-share" }, pct(pool.reduced_share)))));
    const steps = el("table", { class: "steps" }, el("thead", {}, el("tr", {}, el("th", {}, "time"), el("th", {}, "change"), el("th", {}, "evidence"))));
    const tbody = el("tbody");
    rows(tbody, pool.steps, (s) => [clock(s.at), `${s.from} → ${s.to}`, el("td", { class: "evidence" }, s.evidence)]);
    if (!pool.steps.length) tbody.append(el("tr", {}, el("td", { colspan: "3", class: "muted" }, "no step change yet; now: " + pool.reason)));
    steps.append(tbody);
    box.append(el("div", { class: "pool-body" },
      el("div", {}, chart(pool.history), el("div", { class: "legend" },
        el("span", { class: "offered" }, "— offered accelerator-ms/s"), "  ",
        el("span", { class: "protected" }, "- - protected envelope"), `  (last ${pool.history.length} s)`)),
      el("div", {}, el("h3", {}, "Ladder step history"), steps)));
    return box;
  }

  function render(data) {
    show("board");
    for (const span of document.querySelectorAll(".window")) span.textContent = data.window_s;
    const worst = Math.max(0, ...data.pools.map((p) => p.step));
    $("summary").textContent = `${data.pools.length} pools · highest ladder step ${worst} · policy ${data.policy.version}` + (data.accepting ? "" : " · draining");
    $("updated").textContent = "updated " + clock(data.generated_at);
    $("pools").replaceChildren(...data.pools.map(renderPool));
    if (!data.pools.length) $("pools").append(el("p", { class: "muted" }, "no pool has seen traffic yet"));
    rows($("tenants").tBodies[0], data.tenants, (t) => {
      const quotas = t.quotas.filter((q) => q.metered).map((q) => `${q.class}: ${fmt(q.available_ms, 0)} / ${fmt(q.burst_ms, 0)} ms (+${fmt(q.borrowable_ms, 0)})`);
      const rejections = Object.entries(t.rejections).map(([rule, n]) => `${rule} ${n}`);
      const tr = [el("td", { class: "name" }, t.name + (t.admin ? " (admin)" : "")), pct(t.weight_share), pct(t.share),
        el("td", { class: "charged" }, fmt(t.charged_ms, 1)), quotas.join("; ") || "unmetered", rejections.join(", ") || "–"];
      return tr;
    });
    for (const tr of $("tenants").tBodies[0].rows) tr.setAttribute("data-tenant", tr.cells[0].textContent.replace(" (admin)", ""));
    rows($("refusals").tBodies[0], data.refusals, (r) => [r.status, r.rule || "–", r.count]);
    const p = data.policy, last = p.last_reload;
    $("policy").replaceChildren(
      el("dt", {}, "version"), el("dd", { class: "policy-version" }, `${p.version} (${p.rules} rules, ${p.engine})`),
      el("dt", {}, "last reload"), el("dd", { class: last && last.outcome === "failed" ? "bad" : "ok" },
        last ? `${last.outcome} at ${clock(last.at)}` + (last.diagnostics.length ? ": " + last.diagnostics.join("; ") : "") : "–"),
      el("dt", {}, "rejected reloads"), el("dd", {}, p.failed_reloads),
      el("dt", {}, "fail-opens"), el("dd", { class: Object.keys(p.fail_opens).length ? "bad" : "" },
        Object.entries(p.fail_opens).map(([rule, n]) => `${rule} ${n}`).join(", ") || "none"));
    rows($("backends").tBodies[0], data.backends, (b) => [b.name, b.cell, b.devices,
      el("td", { class: b.healthy ? "ok" : "bad" }, b.healthy ? "ready" : "NOT READY"),
      Object.entries(b.models).map(([m, ready]) => `${m} ${ready ? "✓" : "✗"}`).join("  ")]);
    const ms = (v) => (v === null || v === undefined ? "–" : fmt(v, 1));
    rows($("streams").tBodies[0], data.streams || [], (s) => [s.model, s.streams,
      `${ms(s.first_result_p50_ms)} / ${ms(s.first_result_p95_ms)}`, ms(s.gap_p95_ms),
      pct(s.first_result_met_share), pct(s.gap_met_share)]);
    rows($("prefix").tBodies[0], data.prefix || [], (c) => [c.model, c.requests, pct(c.hit_share),
      pct(c.cached_token_share), ms(c.saved_accelerator_ms), c.spills, ms(c.extra_wait_ms_max)]);
    rows($("decisions").tBodies[0], data.decisions.slice(0, SHOWN_DECISIONS), (d) => [clock(d.at), d.tenant, d.class, d.model,
      el("td", { class: d.verdict === "reject" ? "bad" : d.verdict === "fallback" ? "warn" : "ok" }, d.verdict),
      d.rule || "–", d.route_reason, d.ladder_step]);
  }

  async function poll() {
    const key = sessionStorage.getItem(KEY);
    if (!key) { show("signin"); return; }
    try {
      const reply = await fetch("/status.json", { headers: { Authorization: "Bearer " + key }, cache: "no-store" });
      if (reply.status === 401) {
        sessionStorage.removeItem(KEY);
        show("signin");
        $("signin-error").textContent = "key not recognised (401)";
        $("signin-error").hidden = false;
        return;
      }
      if (reply.status === 403) {
        show("refused");
        $("refused-reason").textContent = "403: this key is not an admin credential; the status page needs one.";
        return;
      }
      if (!reply.ok) throw new Error("HTTP " + reply.status);
      render(await reply.json());
    } catch (error) {
      $("updated").textContent = "update failed: " + error.message;
    }
    timer = setTimeout(poll, POLL_MS);
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("signin-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const key = $("key").value.trim();
      $("key").value = "";
      if (!key) return;
      sessionStorage.setItem(KEY, key);
      $("signin-error").hidden = true;
      clearTimeout(timer);
      poll();
    });
    $("signout").addEventListener("click", () => {
      sessionStorage.removeItem(KEY);
      clearTimeout(timer);
      show("signin");
    });
    poll();
  });
})();
