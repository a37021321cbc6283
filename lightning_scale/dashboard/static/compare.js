// Compare: run A (the toolbar's run) against run B (picked beside it), node by node, at a pair
// of steps the server aligns (/compare). The profile draws both runs on each matched node's
// row (A a ring, B a dot, a line between them where apart; forward blue, backward orange) on the axis of
// the Profile view, format edges kept, with B − A beside each row; node directions whose
// log2 std differs by more than the threshold are shaded and the first divergence is marked.
// The side panel ranks the node directions by |B − A|. "Difference over steps" draws B − A at
// every step both runs tracked with the Heatmap view's drawing (a diverging colour scale).
import { esc, fmt, sci, edges, textWidth } from './api.js';
import { header, axisTicks } from './profile.js';
import { drawHeatmap } from './heatmap.js';

const ROW = 14, PLOT_W = 480, DIFF_W = 130;
const DIRS = ['fwd', 'bwd'];
const collapsed = new Set();

const finite = (v) => v !== null && v !== undefined && Number.isFinite(v);
const signed = (v) => (finite(v) ? `${v > 0 ? '+' : v < 0 ? '−' : '±'}${Math.abs(v).toFixed(2)}` : '–');
const dirName = (d) => (d === 'fwd' ? 'forward' : 'backward');

// The x range over both runs' values: the Profile view's rule on a log2 axis, 5% padding otherwise.
function xRange(nodes, log) {
  let lo = Infinity, hi = -Infinity;
  for (const n of nodes) for (const d of DIRS) for (const v of n[d].slice(0, 2)) if (finite(v)) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  if (log) return [Math.max(Math.min(-20, Math.floor(lo) - 1), -140), Math.min(Math.max(18, Math.ceil(hi) + 1), 140)];
  if (!Number.isFinite(lo)) return [0, 1];
  const pad = (hi - lo) * 0.05 || Math.abs(hi) * 0.05 || 1;
  return [lo - pad, hi + pad];
}

function summary(data) {
  const div = data.first_divergence;
  const only = (who, labels) => (labels.length ? `<span class="only" title="${esc(labels.join('\n'))}">${labels.length} only in ${who}</span>` : `0 only in ${who}`);
  const stats = [data.only_a_stats.length ? `only A logged ${data.only_a_stats.map(esc).join(', ')}` : '', data.only_b_stats.length ? `only B logged ${data.only_b_stats.map(esc).join(', ')}` : ''].filter(Boolean).join('; ');
  const first = div
    ? `first divergence: <b class="first-divergence" data-label="${esc(div.node)}" data-dir="${div.direction}">${esc(div.node)}</b> ${dirName(div.direction)}, Δ log2 std ${signed(div.difference)}`
    : `no divergence: every matched node's |Δ log2 std| ≤ ${data.threshold}`;
  return `<div class="legend compare-legend"><span class="run-a">○ A</span> <b>${esc(data.run)}</b> at step ${data.step_a} · <span class="run-b">● B</span> <b>${esc(data.other)}</b> at step ${data.step_b} (${esc(data.how)})
    · <span class="fwd">forward</span>, <span class="bwd">backward</span><br><span class="matched">${data.matched} nodes matched</span>, ${only('A', data.only_a)}, ${only('B', data.only_b)}${stats ? ` · ${stats}` : ''}
    · <span class="divergence-note">${first}</span> <span class="note">(threshold ${data.threshold} octaves of std: forward in execution order, then backward)</span></div>`;
}

function row(n, x, width, first, y, index) {
  let out = '';
  for (const d of DIRS) {
    const [a, b] = n[d];
    if (finite(a) && finite(b) && Math.abs(x(a) - x(b)) >= 2) out += `<line class="gap ${d}" x1="${x(a)}" x2="${x(b)}" y1="7" y2="7"/>`;
    if (finite(a)) out += `<circle class="run-a ${d}" cx="${x(a)}" cy="7" r="4"/>`;
    if (finite(b)) out += `<circle class="run-b ${d}" cx="${x(b)}" cy="7" r="3"/>`;
  }
  const diverges = n.diverges.some(Boolean);
  const classes = `cmp-node${n.param ? ' param' : ''}${diverges ? ' diverges' : ''}${first ? ' first' : ''}`;
  return `<g class="${classes}" transform="translate(0,${y})" data-index="${index}" data-label="${esc(n.label)}" data-fwd-a="${n.fwd[0] ?? ''}" data-fwd-b="${n.fwd[1] ?? ''}" data-bwd-a="${n.bwd[0] ?? ''}" data-bwd-b="${n.bwd[1] ?? ''}" data-fwd-diff="${n.fwd[2] ?? ''}" data-bwd-diff="${n.bwd[2] ?? ''}">
    <rect class="hit" x="0" y="0" width="${width}" height="${ROW}"/><text class="label" x="14" y="11">${first ? '▶ ' : ''}${n.param ? '◆ ' : ''}${esc(n.label)}</text>${out}<text class="diff" x="${width - DIFF_W + 8}" y="11">${signed(n.fwd[2])} ${signed(n.bwd[2])}</text></g>`;
}

function tooltip(n, data) {
  const unit = data.log2 ? `log2 ${esc(data.stat)}` : esc(data.stat);
  const rows = DIRS.map((d) => `<tr><td class="${d}">${d}</td><td>${fmt(n[d][0], 3)}</td><td>${fmt(n[d][1], 3)}</td><td>${signed(n[d][2])}</td></tr>`).join('');
  return `<b>${esc(n.label)}</b><table><tr><th></th><th>A ${unit}</th><th>B ${unit}</th><th>B − A</th></tr>${rows}</table>`;
}

function ranking(side, data) {
  const what = data.log2 ? `log2 ${esc(data.stat)}` : esc(data.stat);
  const rows = data.ranked.map((r, i) => `<tr class="ranked-row${r.diverges ? ' diverges' : ''}${r.first ? ' first' : ''}" data-label="${esc(r.label)}" data-dir="${r.dir}" data-difference="${r.difference ?? ''}">
    <td>${i + 1}</td><td class="lbl" title="${esc(r.label)}">${esc(r.label)}</td><td class="${r.dir}">${r.dir}</td><td>${fmt(r.a)}</td><td>${fmt(r.b)}</td><td class="delta">${signed(r.difference)}</td><td class="first-mark">${r.first ? '◀ first' : ''}</td></tr>`).join('');
  side.innerHTML = `<h4>Largest differences (B − A of ${what})</h4><p class="note">${data.ranked.length} of ${data.total} node directions; in red: |Δ log2 std| &gt; ${data.threshold} (a divergence)</p>
    <table class="compare-ranked"><tr><th>#</th><th>node</th><th>dir</th><th>A</th><th>B</th><th>B − A</th><th></th></tr>${rows}</table>`;
}

// data: the /compare route's answer. `side`: where the ranking goes.
export function drawCompare(root, side, data) {
  const log = data.log2;
  const [lo, hi] = xRange(data.nodes, log);
  const labelW = Math.ceil(Math.max(160, ...data.nodes.map((n) => textWidth(`▶ ${n.param ? '◆ ' : ''}${n.label}`))) + 24);
  const width = labelW + PLOT_W + DIFF_W;
  const x = (v) => labelW + ((v - lo) / (hi - lo)) * PLOT_W;
  const div = data.first_divergence;
  let y = 4, body = '', group = null;
  const visible = [];
  for (const n of data.nodes) {
    if (n.group !== group) {
      group = n.group;
      body += `<text class="group" data-group="${esc(group)}" x="2" y="${y + 11}">${collapsed.has(group) ? '▸' : '▾'} ${esc(group)}</text>`;
      y += ROW;
    }
    if (collapsed.has(group)) continue;
    visible.push(n);
    body += row(n, x, width, div && div.node === n.label, y, visible.length - 1);
    y += ROW;
  }
  const height = y + 10;
  const grid = axisTicks(lo, hi, log).map((t) => `<line x1="${x(t)}" x2="${x(t)}" y1="0" y2="${height}" class="grid"/>`).join('');
  const lines = log ? edges(lo, hi).map((e) => `<line class="edge" x1="${x(e.v)}" x2="${x(e.v)}" y1="0" y2="${height}" stroke="${e.colour}" stroke-dasharray="5,3"/>`).join('') : '';
  const head = header(x, lo, hi, log, data.stat, labelW + PLOT_W, labelW);
  root.innerHTML = `${summary(data)}<div class="profile-head">${head.svg}<span class="diff-head">B − A (fwd bwd)</span></div>
    <svg class="compare" width="${width}" height="${height}">${grid}${lines}${body}</svg><div class="tip" hidden></div>`;
  const bar = document.querySelector('.toolbar');
  root.querySelector('.profile-head').style.top = `${bar ? bar.offsetHeight : 0}px`;
  ranking(side, data);
  const tip = root.querySelector('.tip');
  const svg = root.querySelector('svg.compare');
  svg.addEventListener('mousemove', (e) => {
    const g = e.target.closest('g.cmp-node');
    if (!g) { tip.hidden = true; return; }
    tip.innerHTML = tooltip(visible[+g.dataset.index], data);
    Object.assign(tip.style, { left: `${e.pageX + 12}px`, top: `${e.pageY + 12}px` });
    tip.hidden = false;
  });
  svg.addEventListener('mouseleave', () => { tip.hidden = true; });
  svg.addEventListener('click', (e) => {
    const t = e.target.closest('text.group');
    if (!t) return;
    if (collapsed.has(t.dataset.group)) collapsed.delete(t.dataset.group); else collapsed.add(t.dataset.group);
    drawCompare(root, side, data);
  });
}

// Blue where B is below A, white where equal, red where above; grey: logged in one run only.
export function divergingColour(v, limit) {
  if (v === null || v === undefined) return '#eeeeee';
  const t = Math.max(-1, Math.min(1, v / limit));
  const end = t < 0 ? [33, 102, 172] : [178, 24, 43];
  const mid = [247, 247, 247];
  return `rgb(${mid.map((c, i) => Math.round(c + (end[i] - c) * Math.abs(t))).join(',')})`;
}

function divergingLegend(data) {
  const stops = [];
  for (let i = 0; i <= 40; i++) stops.push(`<rect x="${i * 8}" y="0" width="8" height="12" fill="${divergingColour(data.limit * (i / 20 - 1), data.limit)}"/>`);
  const ends = `<text class="tick" x="0" y="26">−${sci(data.limit)}</text><text class="tick" x="164" y="26" text-anchor="middle">0</text><text class="tick" x="328" y="26" text-anchor="end">+${sci(data.limit)}</text>`;
  return `<svg class="colourbar" width="340" height="30">${stops.join('')}${ends}</svg> ${esc(data.stat)}, run B − run A, at each step both runs tracked (blue: B lower, red: B higher; grey: logged in one run only)`;
}

// The /compare_heatmap route's answer, drawn by the Heatmap view; a click shows the node's
// difference over steps (/compare_series).
export function drawCompareHeatmap(root, data, query) {
  drawHeatmap(root, data, query, { route: 'compare_series', colourOf: (v) => divergingColour(v, data.limit), legend: divergingLegend(data) });
}
