// Profile at a step: every node in execution order, log2 std forward and backward on one
// axis, absmax markers, parameters marked, format ranges labelled, collapsible by block.
// Another statistic can be picked: magnitudes stay on the log2 axis with the format edges,
// the others (FP8 SNR in dB, fractions) get a linear axis over their range.
import { FORMATS, esc, fmt, sci } from './api.js';

const ROW = 14, LABEL_W = 330, PLOT_W = 620, TOP = 44;
const collapsed = new Set();

const LOG2_STATS = ['std', 'absmax', 'rms', 'min_nonzero'];

function log2(v) { return v > 0 && Number.isFinite(v) ? Math.log2(v) : null; }
const finite = (v) => (v !== null && v !== undefined && Number.isFinite(v) ? v : null);

// The plotted value of a node direction: log2 for magnitudes, as logged otherwise.
function plotted(n, d, stat) { return LOG2_STATS.includes(stat) ? log2(n[d][stat]) : finite(n[d][stat]); }

function xRange(nodes, stat) {
  const log = LOG2_STATS.includes(stat);
  let lo = Infinity, hi = -Infinity;
  for (const n of nodes) for (const d of ['fwd', 'bwd']) {
    for (const v of [plotted(n, d, stat), stat === 'std' ? log2(n[d].absmax) : null]) if (v !== null) { lo = Math.min(lo, v); hi = Math.max(hi, v); }
  }
  if (log) return [Math.max(Math.min(-20, Math.floor(lo) - 1), -140), Math.min(Math.max(18, Math.ceil(hi) + 1), 140)];
  if (!Number.isFinite(lo)) return [0, 1];
  const pad = (hi - lo) * 0.05 || Math.abs(hi) * 0.05 || 1;
  return [lo - pad, hi + pad];
}

function formatMarks(x, lo, hi, height) {
  let out = '';
  const offsets = { fp16: 0, e5m2: 10, e4m3: 20, bf16: 30 };
  for (const [name, f] of Object.entries(FORMATS)) {
    for (const [edge, what] of [[f.min, 'min normal'], [f.max, 'max']]) {
      if (edge < lo || edge > hi) continue;
      const px = x(edge);
      out += `<line class="edge" x1="${px}" x2="${px}" y1="${TOP - 4}" y2="${height}" stroke="${f.colour}" stroke-dasharray="${name === 'e5m2' ? '2,3' : '5,3'}"><title>${name} ${what} 2^${fmt(edge)}</title></line>`;
      out += `<text class="edge-label" x="${px + 2}" y="${offsets[name] + 10}" fill="${f.colour}">${name} ${what === 'max' ? '▸max' : 'min◂'}</text>`;
    }
  }
  return out;
}

// A 1, 2 or 5 times a power of ten near span / 8: about eight ticks on a linear axis.
function niceStep(span) {
  const p = 10 ** Math.floor(Math.log10(span / 8));
  return [1, 2, 5, 10].map((m) => m * p).find((s) => span / s <= 10);
}

function axis(x, lo, hi, height, step = 4) {
  let out = '';
  for (let t = Math.ceil(lo / step) * step; t <= hi; t += step) {
    out += `<line x1="${x(t)}" x2="${x(t)}" y1="${TOP}" y2="${height}" class="grid"/><text class="tick" x="${x(t)}" y="${TOP - 2}">${+t.toPrecision(6)}</text>`;
  }
  return out;
}

function tooltip(n) {
  const rows = ['fwd', 'bwd'].map((d) => Object.entries(n[d]).map(([k, v]) => `<tr><td>${d}</td><td>${esc(k)}</td><td>${sci(v)}</td><td>${k === 'std' || k === 'absmax' ? 'log2 ' + fmt(log2(v)) : ''}</td></tr>`).join('')).join('');
  return `<b>${esc(n.label)}</b> ${n.param ? '(parameter)' : '(activation)'}<table>${rows}</table>`;
}

export function drawProfile(root, data, stat = 'std') {
  const nodes = data.nodes;
  const log = LOG2_STATS.includes(stat);
  const [lo, hi] = xRange(nodes, stat);
  const x = (v) => LABEL_W + ((v - lo) / (hi - lo)) * PLOT_W;
  let y = TOP, body = '', group = null;
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
    body += `<g class="node${n.param ? ' param' : ''}" data-index="${visible.length - 1}" data-label="${esc(n.label)}" data-fwd="${f ?? ''}" data-bwd="${b ?? ''}" transform="translate(0,${y})">`;
    body += `<rect class="hit" x="0" y="0" width="${LABEL_W + PLOT_W}" height="${ROW}"/>`;
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
  const what = log ? `x: log2 ${esc(stat)}${stat === 'std' ? ' · | absmax' : ''}` : `x: ${esc(stat)} (missing or not finite, e.g. SNR +inf: not drawn)`;
  const bf16 = log && lo > FORMATS.bf16.min && hi < FORMATS.bf16.max ? ' · bf16 normal range 2^-126..2^128 spans the whole axis' : '';
  root.innerHTML = `<div class="legend"><span class="fwd">● forward</span> <span class="bwd">● backward</span> ◆/■ parameter · ${what} · step ${data.step}${bf16}</div>
    <svg class="profile" data-stat="${esc(stat)}" width="${LABEL_W + PLOT_W + 20}" height="${height}">${axis(x, lo, hi, height, log ? 4 : niceStep(hi - lo))}${log ? formatMarks(x, lo, hi, height) : ''}${body}</svg><div class="tip" hidden></div>`;
  const tip = root.querySelector('.tip');
  const svg = root.querySelector('svg');
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
    drawProfile(root, data, stat);
  });
}

export function drawRatios(root, ratios) {
  const entries = Object.entries(ratios || {});
  if (!entries.length) { root.innerHTML = ''; return; }
  root.innerHTML = `<h4>Update / weight ratio</h4><table class="ratios">${entries.map(([p, v]) => `<tr><td>${esc(p)}</td><td>${sci(v)}</td><td>log2 ${fmt(log2(v))}</td></tr>`).join('')}</table>`;
}
