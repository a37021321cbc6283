// Profile at a step: every node in execution order, log2 std forward and backward on one
// axis, absmax markers, parameters marked, format edges labelled, collapsible by block.
// The x axis and the edge labels stay in view (a sticky header); nodes outside the picked
// format's normal range (the server says which) are shaded, and can be shown alone.
// Another statistic can be picked: magnitudes stay on the log2 axis with the format edges,
// the others (FP8 SNR in dB, fractions) get a linear axis over their range.
import { esc, fmt, sci, edges, ticks, textWidth, stackLabels, isLog2, firstFormat, FORMATS } from './api.js';

const ROW = 14, PLOT_W = 620, PAD = 16;
const collapsed = new Set();

function log2(v) { return v > 0 && Number.isFinite(v) ? Math.log2(v) : null; }
const finite = (v) => (v !== null && v !== undefined && Number.isFinite(v) ? v : null);

// The plotted value of a node direction: log2 for magnitudes, as logged otherwise.
function plotted(n, d, stat) { return isLog2(stat) ? log2(n[d][stat]) : finite(n[d][stat]); }

export const outsideOf = (n, format) => n.fwd_out.includes(format) || n.bwd_out.includes(format);

function xRange(nodes, stat) {
  const log = isLog2(stat);
  let lo = Infinity, hi = -Infinity;
  for (const n of nodes) for (const d of ['fwd', 'bwd']) {
    for (const v of [plotted(n, d, stat), stat === 'std' ? log2(n[d].absmax) : null]) if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  }
  if (log) return [Math.max(Math.min(-20, Math.floor(lo) - 1), -140), Math.min(Math.max(18, Math.ceil(hi) + 1), 140)];
  if (!Number.isFinite(lo)) return [0, 1];
  const pad = (hi - lo) * 0.05 || Math.abs(hi) * 0.05 || 1;
  return [lo - pad, hi + pad];
}

// Edge labels ("fp16 · e5m2 min◂" right of its line, "◂" pointing at it; "▸max" left of
// it), each on the first row where it overlaps no other label and stays inside the plot.
function edgeLabels(x, lo, hi, left, right) {
  const items = edges(lo, hi).map((e) => {
    const text = e.kind === 'min' ? `${e.names.join(' · ')} min◂` : `▸${e.names.join(' · ')} max`;
    const w = textWidth(text, '10px Roboto, Arial, sans-serif') + 2;
    const px = x(e.v);
    const start = Math.min(Math.max(e.kind === 'min' ? px + 3 : px - 3 - w, left), right - w);
    return { ...e, text, px, a: px, start, span: [start, start + w] };
  });
  // min labels lie right of their line, max labels left of it: placing each kind from its
  // line outwards keeps a later label's line out of the earlier labels
  const order = [...items.filter((e) => e.kind === 'min'), ...items.filter((e) => e.kind === 'max').reverse()];
  const labels = stackLabels(order, false);
  return { labels, rows: Math.max(0, ...labels.map((l) => l.row + 1)) };
}

export function header(x, lo, hi, log, stat, width, labelW) {
  const marks = log ? edgeLabels(x, lo, hi, labelW, width) : { labels: [], rows: 0 };
  const height = marks.rows * 12 + 20;
  let svg = '';
  for (const e of marks.labels) {
    const y = e.row * 12 + 10;
    svg += `<line x1="${e.px}" x2="${e.px}" y1="${y + 2}" y2="${height - 14}" stroke="${e.colour}" stroke-dasharray="2,2"/>`;
    svg += `<g><title>${e.names.join(', ')} ${e.kind === 'min' ? 'smallest normal' : 'largest finite value'}: 2^${fmt(e.v)}</title><text class="edge-label" x="${e.start}" y="${y}" fill="${e.colour}">${esc(e.text)}</text></g>`;
  }
  for (const t of axisTicks(lo, hi, log)) {
    svg += `<text class="tick axis" x="${x(t)}" y="${height - 3}">${+t.toPrecision(6)}</text>`;
  }
  svg += `<text class="axis-title" x="4" y="${height - 3}">${log ? 'log2 ' : ''}${esc(stat)} →</text>`;
  return { svg: `<svg class="profile-axis" width="${width}" height="${height}">${svg}</svg>`, height };
}

// Every 4 octaves on the log2 axis; round numbers on a linear one.
export function axisTicks(lo, hi, log) {
  if (!log) return ticks(lo, hi, 8);
  const out = [];
  for (let t = Math.ceil(lo / 4) * 4; t <= hi; t += 4) out.push(t);
  return out;
}

function tooltip(n) {
  const rows = ['fwd', 'bwd'].map((d) => Object.entries(n[d]).map(([k, v]) => `<tr><td>${d}</td><td>${esc(k)}</td><td>${sci(v)}</td><td>${isLog2(k) ? 'log2 ' + fmt(log2(v)) : ''}</td></tr>`).join('')).join('');
  const out = ['fwd', 'bwd'].filter((d) => n[`${d}_out`].length).map((d) => `${d} outside ${n[`${d}_out`].join(', ')}`).join('; ');
  const alias = n.alias_of ? `<br>the same tensor as <code>${esc(n.alias_of)}</code>` : '';
  return `<b>${esc(n.label)}</b> ${n.param ? '(parameter)' : '(activation)'}${alias}${out ? `<br><span class="out-note">${esc(out)}</span>` : ''}<table>${rows}</table>`;
}

// opts: { format: the range to highlight, only: show only the nodes outside it }.
export function drawProfile(root, data, stat = 'std', opts = { format: null, only: false }) {
  const format = opts.format || firstFormat();
  const nodes = opts.only ? data.nodes.filter((n) => outsideOf(n, format)) : data.nodes;
  const log = isLog2(stat);
  const [lo, hi] = xRange(data.nodes, stat);
  const labelW = Math.ceil(Math.max(160, ...data.nodes.map((n) => textWidth(`${n.param ? '◆ ' : ''}${n.label}`))) + 24);
  const width = labelW + PLOT_W + PAD;
  const x = (v) => labelW + ((v - lo) / (hi - lo)) * PLOT_W;
  let y = 4, body = '', group = null;
  const visible = [];
  for (const n of nodes) {
    if (n.group !== group) {
      group = n.group;
      const c = collapsed.has(group);
      body += `<text class="group" data-group="${esc(group)}" x="2" y="${y + 11}">${c ? '▸' : '▾'} ${esc(group)}</text>`;
      y += ROW;
    }
    if (collapsed.has(group)) continue;
    visible.push(n);
    const f = plotted(n, 'fwd', stat), b = plotted(n, 'bwd', stat);
    const out = outsideOf(n, format);
    body += `<g class="node${n.param ? ' param' : ''}${out ? ' out' : ''}" data-index="${visible.length - 1}" data-label="${esc(n.label)}" data-fwd="${f ?? ''}" data-bwd="${b ?? ''}" data-out="${[...n.fwd_out.map((o) => `fwd:${o}`), ...n.bwd_out.map((o) => `bwd:${o}`)].join(' ')}" transform="translate(0,${y})">`;
    body += `<rect class="hit" x="0" y="0" width="${width}" height="${ROW}"/>`;
    body += `<text class="label" x="14" y="11">${n.param ? '◆ ' : ''}${esc(n.label)}</text>`;
    for (const [d, v] of [['fwd', f], ['bwd', b]]) {
      const a = stat === 'std' ? log2(n[d].absmax) : null;
      if (a !== null) body += `<path class="absmax ${d}" d="M${x(a)},2 v10"/>`;
      if (v !== null) body += n.param ? `<rect class="pt ${d}" x="${x(v) - 4}" y="3" width="8" height="8"/>` : `<circle class="pt ${d}" cx="${x(v)}" cy="7" r="4"/>`;
    }
    body += '</g>';
    y += ROW;
  }
  const height = y + 10;
  const grid = axisTicks(lo, hi, log).map((t) => `<line x1="${x(t)}" x2="${x(t)}" y1="0" y2="${height}" class="grid"/>`).join('');
  const lines = log ? edges(lo, hi).map((e) => `<line class="edge" x1="${x(e.v)}" x2="${x(e.v)}" y1="0" y2="${height}" stroke="${e.colour}" stroke-dasharray="${e.dash}"/>`).join('') : '';
  const head = header(x, lo, hi, log, stat, width, labelW);
  const outCount = data.nodes.filter((n) => outsideOf(n, format)).length;
  const hasParams = data.nodes.some((n) => n.param);
  const absmax = stat === 'std' && data.stats.includes('absmax') ? ' · <span class="tick-key">|</span> absmax' : '';
  const what = log ? `x: log2 ${esc(stat)}${absmax}` : `x: ${esc(stat)} (missing or not finite, e.g. SNR +inf: not drawn)`;
  // edges several formats share (FP16 and E5M2's smallest normal), and ranges wider than the axis (BF16's)
  const shared = log ? edges(lo, hi).filter((e) => e.names.length > 1).map((e) => ` · ${e.names.join(' and ')} share the ${e.kind === 'min' ? 'smallest normal' : 'largest value'} 2^${Number.isInteger(e.v) ? e.v : fmt(e.v)}`).join('') : '';
  const wide = log ? Object.entries(FORMATS).filter(([, f]) => f.min < lo && f.max > hi).map(([name, f]) => ` · ${name} normal range 2^${fmt(f.min, 0)}..2^${fmt(f.max, 0)} spans the whole axis`).join('') : '';
  const shown = opts.only ? `showing the ${nodes.length} nodes outside ${format}` : `<span class="out-key">■</span> ${outCount} of ${data.nodes.length} nodes outside ${format}`;
  root.innerHTML = `<div class="legend"><span class="fwd">● forward</span> <span class="bwd">● backward</span>${hasParams ? ' · ◆/■ parameter' : ''} · ${what} · step ${data.step} · ${shown}${shared}${wide}</div>
    <div class="profile-head">${head.svg}</div>
    ${nodes.length ? '' : `<p class="note">No node is outside the ${esc(format)} range at step ${data.step}.</p>`}
    <svg class="profile" data-stat="${esc(stat)}" width="${width}" height="${height}">${grid}${lines}${body}</svg><div class="tip" hidden></div>`;
  const bar = document.querySelector('.toolbar');
  root.querySelector('.profile-head').style.top = `${bar ? bar.offsetHeight : 0}px`;
  const tip = root.querySelector('.tip');
  const svg = root.querySelector('svg.profile');
  svg.addEventListener('mousemove', (e) => {
    const g = e.target.closest('g.node');
    if (!g) { tip.hidden = true; return; }
    tip.innerHTML = tooltip(visible[+g.dataset.index]);
    tip.hidden = false;
    tip.style.left = `${e.pageX + 12}px`;
    tip.style.top = `${e.pageY + 12}px`;
  });
  svg.addEventListener('mouseleave', () => { tip.hidden = true; });
  svg.addEventListener('click', (e) => {
    const t = e.target.closest('text.group');
    if (!t) return;
    const g = t.dataset.group;
    if (collapsed.has(g)) collapsed.delete(g); else collapsed.add(g);
    drawProfile(root, data, stat, opts);
  });
}

export function drawRatios(root, ratios) {
  const entries = Object.entries(ratios || {});
  if (!entries.length) { root.innerHTML = ''; return; }
  root.innerHTML = `<h4>Update / weight ratio</h4><table class="ratios">${entries.map(([p, v]) => `<tr><td>${esc(p)}</td><td>${sci(v)}</td><td>log2 ${fmt(log2(v))}</td></tr>`).join('')}</table>`;
}
