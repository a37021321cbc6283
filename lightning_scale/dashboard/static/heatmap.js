// Heatmap: nodes (rows, execution order) x tracked steps (columns), colour = the picked
// statistic (log2 std by default), forward and backward side by side. Rows are grouped in
// blocks (a band with the block's name: click it to fold the block), every row carries its
// label, and each block's cells are drawn on a canvas (a few elements a block, not one per
// cell). For magnitudes (log2) the colour scale changes hue at the format edges; other
// statistics (FP8 SNR in dB, fractions) get one sequential scale over their range.
// Clicking a cell opens that node's series over the steps in a panel kept in view.
import { get, TABLE, esc, fmt, sci, ticks, textWidth, edges, stackLabels } from './api.js';

const ROW = 12;
const collapsed = new Set();

// Hue bands split at the format edges that matter (the server's table: FP16/E5M2 smallest
// normal, E4M3's, E4M3's max, FP16's max).
export function colour(v) {
  if (v === null || v === undefined) return '#eeeeee';
  for (const [lo, hi, a, b] of TABLE.bands) {
    if (v < hi) {
      const l = Number.isFinite(lo) ? lo : hi - 10, h = Number.isFinite(hi) ? hi : lo + 10;
      const t = Math.min(1, Math.max(0, (v - l) / (h - l)));
      return `rgb(${a.map((c, i) => Math.round(c + (b[i] - c) * t)).join(',')})`;
    }
  }
  return '#000';
}

// Light to dark over [lo, hi]; grey for missing values.
export function linearColour(v, lo, hi) {
  if (v === null || v === undefined) return '#eeeeee';
  const t = hi > lo ? Math.min(1, Math.max(0, (v - lo) / (hi - lo))) : 0.5;
  const [a, b] = [[255, 245, 200], [120, 20, 70]];
  return `rgb(${a.map((c, i) => Math.round(c + (b[i] - c) * t)).join(',')})`;
}

function range(data) {
  let lo = Infinity, hi = -Infinity;
  for (const d of ['fwd', 'bwd']) for (const row of data[d]) for (const v of row) if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  return Number.isFinite(lo) ? [lo, hi] : [0, 1];
}

function linearLegend(lo, hi, stat) {
  const stops = [];
  for (let i = 0; i <= 40; i++) stops.push(`<rect x="${i * 8}" y="0" width="8" height="12" fill="${linearColour(lo + ((hi - lo) * i) / 40, lo, hi)}"/>`);
  return `<svg class="colourbar" width="420" height="30">${stops.join('')}<text class="tick" x="0" y="26">${sci(lo)}</text><text class="tick" x="328" y="26" text-anchor="end">${sci(hi)}</text></svg> ${esc(stat)} (grey: not logged or not finite, e.g. SNR +inf: exact)`;
}

// The colour bar of log2 values with the format edges marked: each label sits right of its
// tick, on the first row where it crosses no other label and no other tick.
function legend(what) {
  const S = 14, L = -24, H = 20, x = (v) => (v - L) * S;
  const stops = [];
  for (let v = L; v < H; v += 0.5) stops.push(`<rect x="${x(v)}" y="0" width="${S / 2 + 0.5}" height="12" fill="${colour(v + 0.25)}"/>`);
  const items = edges(L, H).reverse().map((e) => {  // right to left: a tick never meets a label placed before it
    const text = `${e.names.join(' · ')} ${e.kind} (${fmt(e.v, 1)})`;
    const a = x(e.v);
    return { text, a, span: [a, a + 3 + textWidth(text, '10px Roboto, Arial, sans-serif')] };
  });
  const placed = stackLabels(items, true);
  const rows = Array.from({ length: Math.max(0, ...placed.map((p) => p.row + 1)) });
  const right = Math.max(x(H) + 10, ...placed.map((p) => p.span[1] + 4));
  const marks = placed.map((p) => `<line x1="${p.a}" x2="${p.a}" y1="0" y2="${14 + p.row * 12}" stroke="#000"/><text class="tick" x="${p.a + 3}" y="${23 + p.row * 12}">${esc(p.text)}</text>`).join('');
  const ends = `<text class="tick" x="0" y="${26 + rows.length * 12}">${L}</text><text class="tick" x="${x(H)}" y="${26 + rows.length * 12}" text-anchor="end">${H}</text>`;
  return `<svg class="colourbar" width="${right}" height="${30 + rows.length * 12}">${stops.join('')}${marks}${ends}</svg> ${esc(what)} (grey: not logged)`;
}

// Contiguous runs of rows of one block, in execution order.
function blocks(data) {
  const out = [];
  data.labels.forEach((label, i) => {
    const g = data.groups[i];
    if (!out.length || out[out.length - 1].group !== g) out.push({ group: g, first: i, rows: [] });
    out[out.length - 1].rows.push(i);
  });
  return out;
}

function paint(canvas, data, d, rows, cw, colourOf) {
  const ctx = canvas.getContext('2d');
  rows.forEach((i, r) => data[d][i].forEach((v, j) => {
    ctx.fillStyle = colourOf(v);
    ctx.fillRect(j * cw, r * ROW, cw - 1, ROW - 1);
  }));
}

function stepAxis(data, cw) {
  const widest = Math.max(...data.steps.map((s) => textWidth(String(s), '10px Roboto, Arial, sans-serif')), 1);
  const every = Math.max(1, Math.ceil((widest + 8) / cw));
  return data.steps.map((s, j) => (j % every === 0 ? `<span class="step-tick" style="left:${j * cw}px">${s}</span>` : '')).join('');
}

// One node's picked statistic over the tracked steps (log2 for magnitudes): x and y axes
// with ticks and titles, the format edges in range, and a table of every statistic.
export function drawSeries(root, s, stat = 'std', log2 = true) {
  const W = 560, H = 230, L = 52, R = 12, T = 12, B = 36;
  const scaled = (u) => (u === null || u === undefined ? null : log2 ? (u > 0 ? Math.log2(u) : null) : u);
  const lines = Object.entries(s.series).filter(([k]) => k === `${stat}/fwd` || k === `${stat}/bwd`);
  const vals = lines.flatMap(([, v]) => v.map(scaled).filter((u) => u !== null));
  let lo = vals.length ? Math.min(...vals) : 0, hi = vals.length ? Math.max(...vals) : 1;
  const pad = (hi - lo) * 0.1 || Math.abs(hi) * 0.1 || 1;
  lo -= pad; hi += pad;
  const n = Math.max(s.steps.length - 1, 1);
  const x = (j) => L + (s.steps.length > 1 ? (j / n) * (W - L - R) : (W - L - R) / 2), y = (v) => T + (1 - (v - lo) / (hi - lo)) * (H - T - B);
  let axes = `<line class="axis-line" x1="${L}" x2="${L}" y1="${T}" y2="${H - B}"/><line class="axis-line" x1="${L}" x2="${W - R}" y1="${H - B}" y2="${H - B}"/>`;
  for (const t of ticks(lo, hi, 5)) axes += `<line class="grid" x1="${L}" x2="${W - R}" y1="${y(t)}" y2="${y(t)}"/><text class="tick y" x="${L - 4}" y="${y(t) + 3}">${+t.toPrecision(4)}</text>`;
  const every = Math.ceil(s.steps.length / 8);
  s.steps.forEach((st, j) => { if (j % every === 0) axes += `<line class="axis-line" x1="${x(j)}" x2="${x(j)}" y1="${H - B}" y2="${H - B + 4}"/><text class="tick x" x="${x(j)}" y="${H - B + 15}">${st}</text>`; });
  axes += `<text class="axis-title" x="${(L + W - R) / 2}" y="${H - 4}" text-anchor="middle">step</text><text class="axis-title" transform="translate(12,${(T + H - B) / 2}) rotate(-90)" text-anchor="middle">${log2 ? 'log2 ' : ''}${esc(stat)}</text>`;
  if (log2) for (const e of edges(lo, hi)) axes += `<line class="edge" x1="${L}" x2="${W - R}" y1="${y(e.v)}" y2="${y(e.v)}" stroke="${e.colour}" stroke-dasharray="5,3"/><text class="edge-label" x="${W - R - 2}" y="${y(e.v) - 2}" text-anchor="end" fill="${e.colour}">${esc(e.names.join(' · '))} ${e.kind}</text>`;
  const paths = lines.map(([k, v]) => {
    const d = k.endsWith('fwd') ? 'fwd' : 'bwd';
    const pts = v.map((u, j) => (scaled(u) !== null ? [x(j), y(scaled(u))] : null)).filter(Boolean);
    return `<polyline class="series ${d}" points="${pts.map((p) => p.join(',')).join(' ')}"/>${pts.map(([a, b]) => `<circle class="pt ${d}" cx="${a}" cy="${b}" r="2.5"/>`).join('')}`;
  }).join('');
  const rows = Object.entries(s.series).map(([k, v]) => `<tr><td>${esc(k)}</td>${v.map((u) => `<td>${u === null ? '–' : Number(u).toPrecision(3)}</td>`).join('')}</tr>`).join('');
  root.innerHTML = `<button class="close" title="close">×</button><h4>${esc(s.label)} over steps (${log2 ? 'log2 ' : ''}${esc(stat)}: <span class="fwd">fwd</span>, <span class="bwd">bwd</span>)</h4>
    <svg class="series-chart" width="${W}" height="${H}">${axes}${paths}</svg>
    <div class="series-table-box"><table class="series-table"><tr><th>statistic</th>${s.steps.map((st) => `<th>${st}</th>`).join('')}</tr>${rows}</table></div>`;
  root.hidden = false;
  root.querySelector('.close').addEventListener('click', () => { root.hidden = true; });
}

// opts (the Compare view's difference heatmap): { route: the series route a click fetches,
// colourOf: a colour per value, legend: the legend's HTML }.
export function drawHeatmap(root, data, query, opts = {}) {
  const cw = Math.max(6, Math.min(28, Math.floor(360 / Math.max(data.steps.length, 1))));
  const log2 = data.log2 !== false, stat = data.stat || 'std';
  const [lo, hi] = log2 ? [0, 0] : range(data);
  const colourOf = opts.colourOf || (log2 ? colour : (v) => linearColour(v, lo, hi));
  const what = log2 ? `log2 ${stat}` : stat;
  const params = new Set(data.params);
  const labelW = Math.ceil(Math.max(120, ...data.labels.map((l) => textWidth(`${params.has(l) ? '◆ ' : ''}${l}`, '10px Roboto, Arial, sans-serif'))) + 12);
  const gridW = data.steps.length * cw;
  const parts = blocks(data);
  const html = parts.map((b, k) => {
    const folded = collapsed.has(b.group);
    const labels = b.rows.map((i) => `<div class="row-label${params.has(data.labels[i]) ? ' param' : ''}" data-row="${i}" title="${esc(data.labels[i])}">${params.has(data.labels[i]) ? '◆ ' : ''}${esc(data.labels[i])}</div>`).join('');
    const canvases = ['fwd', 'bwd'].map((d) => `<canvas class="hm-canvas" data-dir="${d}" data-block="${k}" data-cw="${cw}" width="${gridW}" height="${b.rows.length * ROW}"></canvas>`).join('');
    return `<div class="hm-block${k % 2 ? ' odd' : ''}" data-group="${esc(b.group)}"><div class="hm-band" data-group="${esc(b.group)}">${folded ? '▸' : '▾'} ${esc(b.group)} <span class="count">${b.rows.length} node${b.rows.length > 1 ? 's' : ''}</span></div>${folded ? '' : `<div class="hm-rows" style="grid-template-columns:${labelW}px ${gridW}px ${gridW}px;column-gap:12px">${`<div class="hm-labels">${labels}</div>`}${canvases}</div>`}</div>`;
  }).join('');
  const axis = stepAxis(data, cw);
  root.innerHTML = `<div class="legend">${opts.legend || (log2 ? legend(what) : linearLegend(lo, hi, stat))}</div>
    <div class="hm-head" style="grid-template-columns:${labelW}px ${gridW}px ${gridW}px;column-gap:12px"><div class="hm-corner">node · ${data.labels.length} rows, ${parts.length} blocks (click a band to fold it)</div><div class="hm-dir"><b>forward</b><div class="steps">${axis}</div></div><div class="hm-dir"><b>backward</b><div class="steps">${axis}</div></div></div>
    <div class="hm">${html}</div><div class="series-box" hidden></div><div class="tip" hidden></div>`;
  const bar = document.querySelector('.toolbar');
  root.querySelector('.hm-head').style.top = `${bar ? bar.offsetHeight : 0}px`;
  root.querySelectorAll('canvas.hm-canvas').forEach((c) => paint(c, data, c.dataset.dir, parts[+c.dataset.block].rows, cw, colourOf));
  const tip = root.querySelector('.tip');
  const cell = (e) => {
    const c = e.target.closest('canvas.hm-canvas');
    if (!c) return null;
    const rows = parts[+c.dataset.block].rows;
    const r = Math.floor(e.offsetY / ROW), j = Math.floor(e.offsetX / cw);
    if (r < 0 || r >= rows.length || j < 0 || j >= data.steps.length) return null;
    return { i: rows[r], j, d: c.dataset.dir };
  };
  const hm = root.querySelector('.hm');
  hm.addEventListener('mousemove', (e) => {
    const at = cell(e);
    if (!at) { tip.hidden = true; return; }
    const v = data[at.d][at.i][at.j];
    tip.textContent = `${data.labels[at.i]} · ${at.d} · step ${data.steps[at.j]} · ${what} ${v === null ? '–' : log2 ? fmt(v) : sci(v)}`;
    tip.hidden = false;
    tip.style.left = `${e.pageX + 12}px`;
    tip.style.top = `${e.pageY + 12}px`;
  });
  hm.addEventListener('mouseleave', () => { tip.hidden = true; });
  hm.addEventListener('click', async (e) => {
    const band = e.target.closest('.hm-band');
    if (band) {
      const g = band.dataset.group;
      if (collapsed.has(g)) collapsed.delete(g); else collapsed.add(g);
      drawHeatmap(root, data, query, opts);
      return;
    }
    const at = cell(e);
    if (!at) return;
    const s = await get(opts.route || 'series', { ...query, label: data.labels[at.i] });
    drawSeries(root.querySelector('.series-box'), s, stat, log2);
  });
}
