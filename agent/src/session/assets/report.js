// Draws report.html from the JSON the agent embedded (#report-data). Every
// number is computed by the agent; this script only lays it out. No network,
// no libraries.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const SVG = "http://www.w3.org/2000/svg";

  function el(tag, attrs, text) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    if (text !== undefined) node.textContent = text;
    return node;
  }
  function svgEl(tag, attrs, title) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, String(v));
    if (title) {
      const t = document.createElementNS(SVG, "title");
      t.textContent = title;
      node.appendChild(t);
    }
    return node;
  }
  function fmt(v, unit) {
    if (v === null || v === undefined) return "–";
    const n = Math.abs(v) >= 100 ? v.toFixed(0) : v.toFixed(1);
    return unit ? n + " " + unit : n;
  }
  // `wrap`: indexes of columns whose text may wrap (long free text).
  function table(headers, rows, wrap) {
    const t = el("table");
    const head = el("tr");
    headers.forEach((h) => head.appendChild(el("th", {}, h)));
    t.appendChild(head);
    rows.forEach((r) => {
      const tr = el("tr");
      r.forEach((c, i) => {
        const attrs = i === 0 ? { class: "label", title: String(c) } : (wrap || []).includes(i) ? { class: "wrap" } : {};
        tr.appendChild(el("td", attrs, String(c)));
      });
      t.appendChild(tr);
    });
    return t;
  }
  // A round step for axis ticks, about `count` of them up to `max`.
  function step(max, count) {
    const raw = Math.max(max / count, 1e-3);
    const mag = Math.pow(10, Math.floor(Math.log10(raw)));
    return [1, 2, 5, 10].map((m) => m * mag).find((s) => s >= raw);
  }

  // ---- header
  const m = data.meta;
  document.getElementById("meta").textContent =
    `${m.host} · ${m.selector} · started ${m.start} · ${m.duration_s} s · ` +
    (m.profile_hz > 0 ? `CPU sampled at ${m.profile_hz} Hz` : "no CPU sampling") +
    ` · tokentrace ${m.version}`;
  const c = data.counters;
  const losses = [];
  if (c.events_dropped > 0) losses.push(`${c.events_dropped} events dropped (session queue full)`);
  if (c.samples_dropped > 0) losses.push(`${c.samples_dropped} CPU samples dropped`);
  if (c.thread_slices_dropped > 0) losses.push(`${c.thread_slices_dropped} syscalls not kept for thread tracks`);
  if (c.truncated_writes > 0) losses.push(`${c.truncated_writes} writes longer than the capture limit`);
  if (losses.length) {
    const p = document.getElementById("losses");
    p.textContent = "Incomplete data: " + losses.join(", ") + ".";
    p.hidden = false;
  }

  // ---- summary
  const s = data.summary;
  const summary = document.getElementById("summary");
  const cards = el("div", { class: "cards" });
  [
    ["requests", s.requests],
    ["aborted", s.aborted],
    ["chunks", s.chunks],
    ["chunks / s", s.chunks_per_s],
  ].concat(data.cpu_samples !== null ? [["CPU samples", data.cpu_samples]] : []).forEach(([k, v]) => {
    const card = el("div", { class: "card" });
    card.appendChild(el("b", {}, String(v)));
    card.appendChild(el("span", { class: "muted" }, k));
    cards.appendChild(card);
  });
  summary.appendChild(cards);
  summary.appendChild(
    table(
      ["ms", "count", "p50", "p90", "p95", "p99", "max"],
      s.rows.map((r) => [r.name, r.count, fmt(r.p50), fmt(r.p90), fmt(r.p95), fmt(r.p99), fmt(r.max)])
    )
  );

  // ---- TTFT histogram
  const hist = document.getElementById("histogram");
  if (data.histogram.length === 0) {
    hist.appendChild(el("p", { class: "muted" }, "No request had a first token."));
  } else {
    const W = 1000, H = 220, L = 40, B = 28, T = 8;
    const bins = data.histogram;
    const maxN = Math.max(...bins.map((b) => b.n));
    const lo = bins[0].lo;
    const hi = bins[bins.length - 1].hi;
    const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img" });
    const x = (v) => L + ((W - L - 8) * (v - lo)) / (hi - lo);
    const y = (n) => H - B - ((H - B - T) * n) / maxN;
    bins.forEach((b) => {
      svg.appendChild(
        svgEl(
          "rect",
          { class: "bar", x: x(b.lo) + 0.5, y: y(b.n), width: Math.max(x(b.hi) - x(b.lo) - 1, 1), height: H - B - y(b.n) },
          `${fmt(b.lo)}–${fmt(b.hi)} ms: ${b.n} requests`
        )
      );
    });
    svg.appendChild(svgEl("line", { class: "axis", x1: L, x2: W - 8, y1: H - B, y2: H - B }));
    const xs = step(hi - lo, 10);
    for (let v = Math.ceil(lo / xs - 1e-9) * xs; v <= hi + 1e-9; v += xs) {
      const t = svgEl("text", { x: x(v), y: H - B + 16, "text-anchor": "middle" });
      t.textContent = fmt(v);
      svg.appendChild(t);
    }
    const ys = step(maxN, 4);
    for (let n = 0; n <= maxN; n += Math.max(1, Math.round(ys))) {
      const t = svgEl("text", { x: L - 6, y: y(n) + 4, "text-anchor": "end" });
      t.textContent = String(n);
      svg.appendChild(t);
    }
    const unit = svgEl("text", { x: W - 8, y: H - 2, "text-anchor": "end" });
    unit.textContent = "TTFT (ms)";
    svg.appendChild(unit);
    hist.appendChild(svg);
  }

  // ---- waterfall
  // Opens on the requests' own span (computed by the agent: wf.from_ms →
  // wf.to_ms); "Whole session" puts them back on the session's axis.
  const wf = data.waterfall;
  const wfDiv = document.getElementById("waterfall");
  const detail = document.getElementById("waterfall-detail");
  if (wf.total > wf.rows.length) {
    const note = document.getElementById("waterfall-note");
    note.textContent = `Showing the first ${wf.rows.length} of ${wf.total} requests; the files have them all.`;
    note.hidden = false;
  }
  // Seconds with as many decimals as the tick step needs.
  function seconds(ms, stepMs) {
    const decimals = Math.min(4, Math.max(0, -Math.floor(Math.log10(stepMs / 1000) + 1e-9)));
    return (ms / 1000).toFixed(decimals) + " s";
  }
  function phases(r) {
    const parts = [];
    if (r.rd > r.s) parts.push(["in the socket", r.rd - r.s]);
    parts.push(["reading", r.r - r.rd]);
    if (r.f !== null) {
      parts.push(["to first token", r.f - r.r]);
      parts.push(["streaming", r.e - r.f]);
    } else {
      parts.push([r.aborted ? "until aborted" : "to the end", r.e - r.r]);
    }
    return parts;
  }
  function showDetail(r) {
    detail.textContent = "";
    detail.appendChild(el("b", {}, r.label));
    const line = [`arrived +${seconds(r.s, 1)}`]
      .concat(phases(r).map(([name, ms]) => `${name} ${fmt(ms, "ms")}`))
      .concat([`TTFT ${r.f === null ? "–" : fmt(r.f - r.s, "ms")}`, `E2E ${fmt(r.e - r.s, "ms")}`, `${r.t.length} tokens`]);
    if (r.aborted) line.push("aborted");
    detail.appendChild(el("div", {}, line.join(" · ")));
    detail.appendChild(
      el("div", {}, r.k.length ? `late tokens (#${r.k.map((i) => i + 1).join(", #")}): ${r.c || "cause not seen"}` : "no late tokens")
    );
  }
  function drawWaterfall(from, to) {
    wfDiv.textContent = "";
    const W = 1000, rowH = 14, L = 8, top = 6, axis = 22;
    const H = top + wf.rows.length * rowH + axis;
    const span = Math.max(to - from, 1e-3);
    const x = (t) => L + ((W - 2 * L) * Math.min(Math.max(t - from, 0), span)) / span;
    const svg = svgEl("svg", { viewBox: `0 0 ${W} ${H}`, role: "img", "data-from-ms": from, "data-to-ms": to });
    let selected = null;
    wf.rows.forEach((r, i) => {
      const y = top + i * rowH;
      // a hop sits under the request that caused it: "↳ upstream call #3 …"
      const name = `${r.d ? "  ".repeat(r.d - 1) + "↳ " : ""}${r.kind === "client" ? "upstream call " : ""}${r.label}`;
      const g = svgEl("g", { class: r.d ? "row hop" : "row" }, `${name}\n` + phases(r).map(([name, ms]) => `${name} ${fmt(ms, "ms")}`).join(" · "));
      const seg = (cls, a, b) =>
        g.appendChild(svgEl("rect", { class: cls, x: x(a), y: y + 2, width: Math.max(x(b) - x(a), 0.75), height: rowH - 4 }));
      if (r.rd > r.s) seg("socket", r.s, r.rd);
      seg("receive", r.rd, r.r);
      seg(r.f === null && r.aborted ? "aborted" : "wait", r.r, r.f === null ? r.e : r.f);
      if (r.f !== null) seg(r.aborted ? "aborted" : "stream", r.f, r.e);
      const late = new Set(r.k);
      r.t.forEach((t, j) =>
        g.appendChild(svgEl("line", { class: late.has(j) ? "tick late" : "tick", x1: x(t), x2: x(t), y1: y + 1, y2: y + rowH - 1 }))
      );
      g.addEventListener("mouseenter", () => selected === null && showDetail(r));
      g.addEventListener("click", () => {
        if (selected) selected.classList.remove("selected");
        selected = selected === g ? null : g;
        if (selected) selected.classList.add("selected");
        showDetail(r);
      });
      svg.appendChild(g);
    });
    const base = top + wf.rows.length * rowH;
    svg.appendChild(svgEl("line", { class: "axis", x1: L, x2: W - L, y1: base, y2: base }));
    const xs = step(span, 10);
    for (let v = Math.ceil(from / xs - 1e-9) * xs; v <= to + 1e-9; v += xs) {
      // labels at the ends stay inside the chart
      const anchor = x(v) < L + 24 ? "start" : x(v) > W - L - 24 ? "end" : "middle";
      const t = svgEl("text", { x: x(v), y: base + 15, "text-anchor": anchor });
      t.textContent = seconds(v, xs);
      svg.appendChild(t);
    }
    wfDiv.appendChild(svg);
    document.getElementById("view-range").textContent =
      `${seconds(from, xs)} – ${seconds(to, xs)} of the session's ${seconds(wf.span_ms, 1000)}`;
  }
  if (wf.rows.length === 0) {
    wfDiv.appendChild(el("p", { class: "muted" }, "No requests were seen during the session."));
    document.querySelector(".toolbar").hidden = true;
    detail.hidden = true;
  } else {
    const buttons = { requests: document.getElementById("view-requests"), session: document.getElementById("view-session") };
    const view = (which) => {
      buttons.requests.setAttribute("aria-pressed", String(which === "requests"));
      buttons.session.setAttribute("aria-pressed", String(which === "session"));
      if (which === "requests") drawWaterfall(wf.from_ms, wf.to_ms);
      else drawWaterfall(0, wf.span_ms);
    };
    buttons.requests.addEventListener("click", () => view("requests"));
    buttons.session.addEventListener("click", () => view("session"));
    view("requests");
  }

  // ---- slowest requests
  const slow = document.getElementById("slowest");
  if (data.slowest.length === 0) {
    slow.appendChild(el("p", { class: "muted" }, "No requests."));
  } else {
    const scroll = el("div", { class: "scroll" });
    slow.appendChild(scroll);
    scroll.appendChild(
      table(
        ["request", "TTFT", "in the socket", "to first token", "longest gap", "in that gap", "late-token causes", "E2E", "tokens", "stream", "receive", "accept wait", "TLS handshake", "slow gaps", "slow gap time", "CPU samples", "aborted"],
        data.slowest.map((b) => [
          b.label,
          fmt(b.ttft_ms, "ms"),
          fmt(b.socket_wait_ms, "ms"),
          fmt(b.wait_ms, "ms"),
          b.longest_gap_ms === null ? "–" : `${fmt(b.longest_gap_ms, "ms")} (before #${b.longest_gap_at + 1})`,
          b.longest_gap_cause || "–",
          b.causes || "–",
          fmt(b.e2e_ms, "ms"),
          b.chunks,
          fmt(b.stream_ms, "ms"),
          fmt(b.receive_ms, "ms"),
          fmt(b.accept_wait_ms, "ms"),
          fmt(b.tls_handshake_ms, "ms"),
          b.slow_gaps,
          fmt(b.slow_gap_ms, "ms"),
          b.cpu_samples === null ? "–" : b.cpu_samples,
          b.abort_reason || "",
        ]),
        [5, 6]
      )
    );
  }
})();
