// Heatmap: nodes (rows, execution order) x tracked steps (columns), colour = the picked
// statistic (log2 std by default), forward and backward side by side. For magnitudes (log2)
// the colour scale changes hue at the format edges; other statistics (FP8 SNR in dB,
// fractions) get one sequential scale over their range. Clicking a cell draws that node's
// series over steps.
import { get, FORMATS, esc, fmt, sci } from './api.js';

// Hue bands split at the edges that matter: FP16/E5M2 smallest normal (-14), E4M3's (-6),
// E4M3's max (~8.8), FP16's max (~16).
const BANDS = [
  [-Infinity, FORMATS.fp16.min, [183, 28, 28], [255, 138, 128]],
  [FORMATS.fp16.min, FORMATS.e4m3.min, [255, 193, 7], [255, 236, 179]],
  [FORMATS.e4m3.min, FORMATS.e4m3.max, [13, 71, 161], [144, 202, 249]],
  [FORMATS.e4m3.max, FORMATS.fp16.max, [106, 27, 154], [206, 147, 216]],
  [FORMATS.fp16.max, Infinity, [62, 39, 35], [141, 110, 99]],
];

export function colour(v) {
  if (v === null || v === undefined) return '#eeeeee';
  for (const [lo, hi, a, b] of BANDS) {
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
  const vals = ['fwd', 'bwd'].flatMap((d) => data[d].flat()).filter((v) => v !== null && v !== undefined);
  return vals.length ? [Math.min(...vals), Math.max(...vals)] : [0, 1];
}

function linearLegend(lo, hi, stat) {
  const stops = [];
  for (let i = 0; i <= 40; i++) stops.push(`<rect x="${i * 8}" y="0" width="8" height="12" fill="${linearColour(lo + ((hi - lo) * i) / 40, lo, hi)}"/>`);
  return `<svg class="colourbar" width="400" height="30">${stops.join('')}<text class="tick" x="0" y="26">${sci(lo)}</text><text class="tick" x="300" y="26">${sci(hi)}</text></svg> ${esc(stat)} (grey: not logged or not finite, e.g. SNR +inf: exact)`;
}

function legend() {
  const stops = [];
  for (let v = -24; v <= 20; v += 0.5) stops.push(`<rect x="${(v + 24) * 8}" y="0" width="4" height="12" fill="${colour(v)}"/>`);
  const marks = [[FORMATS.fp16.min, 'fp16/e5m2 min'], [FORMATS.e4m3.min, 'e4m3 min'], [FORMATS.e4m3.max, 'e4m3 max'], [FORMATS.fp16.max, 'fp16 max']];
  const ticks = marks.map(([v, t], i) => `<line x1="${(v + 24) * 8}" x2="${(v + 24) * 8}" y1="0" y2="${16 + (i % 2) * 10}" stroke="#000"/><text class="tick" x="${(v + 24) * 8 + 2}" y="${24 + (i % 2) * 10}">${t} (${fmt(v, 1)})</text>`).join('');
  return `<svg class="colourbar" width="400" height="40">${stops.join('')}${ticks}</svg> log2 std`;
}

function panel(title, d, data, cw, ch, labelW, paint) {
  let cells = '';
  data[d].forEach((row, i) => row.forEach((v, j) => {
    cells += `<rect class="cell" data-dir="${d}" data-row="${i}" data-col="${j}" data-v="${v ?? ''}" x="${labelW + j * cw}" y="${20 + i * ch}" width="${cw - 1}" height="${Math.max(ch - 1, 1)}" fill="${paint(v)}"/>`;
  }));
  const labels = ch >= 8 ? data.labels.map((l, i) => `<text class="row-label" x="${labelW - 4}" y="${20 + i * ch + ch - 2}">${esc(l)}</text>`).join('') : '';
  const stepLabels = data.steps.map((s, j) => (j % Math.ceil(data.steps.length / 10) === 0 ? `<text class="tick" x="${labelW + j * cw}" y="14">${s}</text>` : '')).join('');
  return `<div class="hm-panel"><h4>${title}</h4><svg class="heatmap" data-dir="${d}" width="${labelW + data.steps.length * cw + 10}" height="${30 + data.labels.length * ch}">${stepLabels}${labels}${cells}</svg></div>`;
}

// One node's picked statistic over the tracked steps (log2 for magnitudes), and a table of all.
export function drawSeries(root, s, stat = 'std', log2 = true) {
  const W = 520, H = 180, L = 40;
  const scaled = (u) => (u === null || u === undefined ? null : log2 ? (u > 0 ? Math.log2(u) : null) : u);
  const lines = Object.entries(s.series).filter(([k]) => k === `${stat}/fwd` || k === `${stat}/bwd`);
  const vals = lines.flatMap(([, v]) => v.map(scaled).filter((x) => x !== null));
  const lo = Math.min(...vals, log2 ? -1 : Infinity), hi = Math.max(...vals, log2 ? 1 : -Infinity);
  const span = hi - lo || 1;
  const n = Math.max(s.steps.length - 1, 1);
  const x = (j) => L + (j / n) * (W - L - 10), y = (v) => H - 20 - ((v - lo) / span) * (H - 40);
  const paths = lines.map(([k, v]) => {
    const pts = v.map((u, j) => (scaled(u) !== null ? `${x(j)},${y(scaled(u))}` : null)).filter(Boolean);
    return `<polyline class="series ${k.endsWith('fwd') ? 'fwd' : 'bwd'}" points="${pts.join(' ')}"/>`;
  }).join('');
  const ticks = vals.length ? `<text class="tick" x="2" y="${y(hi)}">${fmt(hi, 1)}</text><text class="tick" x="2" y="${y(lo)}">${fmt(lo, 1)}</text>` : '';
  const rows = Object.entries(s.series).map(([k, v]) => `<tr><td>${esc(k)}</td>${v.map((u) => `<td>${u === null ? '–' : Number(u).toPrecision(3)}</td>`).join('')}</tr>`).join('');
  root.innerHTML = `<h4>${esc(s.label)} over steps (${log2 ? 'log2 ' : ''}${esc(stat)}: <span class="fwd">fwd</span>, <span class="bwd">bwd</span>)</h4>
    <svg class="series-chart" width="${W}" height="${H}">${ticks}${paths}</svg>
    <table class="series-table"><tr><th>statistic</th>${s.steps.map((st) => `<th>${st}</th>`).join('')}</tr>${rows}</table>`;
}

export function drawHeatmap(root, data, query) {
  const n = data.labels.length;
  const ch = n > 400 ? 3 : n > 150 ? 6 : 12;
  const cw = Math.max(6, Math.min(28, Math.floor(360 / Math.max(data.steps.length, 1))));
  const labelW = ch >= 8 ? 260 : 10;
  const log2 = data.log2 !== false, stat = data.stat || 'std';
  const [lo, hi] = log2 ? [0, 0] : range(data);
  const paint = log2 ? colour : (v) => linearColour(v, lo, hi);
  const what = log2 ? `log2 ${stat}` : stat;
  root.innerHTML = `<div class="legend">${log2 ? legend().replace('log2 std', esc(what)) : linearLegend(lo, hi, stat)}</div><div class="hm">${panel('forward', 'fwd', data, cw, ch, labelW, paint)}${panel('backward', 'bwd', data, cw, ch, labelW, paint)}</div><div class="series-box"></div><div class="tip" hidden></div>`;
  const tip = root.querySelector('.tip');
  root.querySelector('.hm').addEventListener('mousemove', (e) => {
    const c = e.target.closest('rect.cell');
    if (!c) { tip.hidden = true; return; }
    tip.textContent = `${data.labels[+c.dataset.row]} · ${c.dataset.dir} · step ${data.steps[+c.dataset.col]} · ${what} ${c.dataset.v === '' ? '–' : log2 ? fmt(+c.dataset.v) : sci(+c.dataset.v)}`;
    tip.hidden = false;
    tip.style.left = `${e.pageX + 12}px`;
    tip.style.top = `${e.pageY + 12}px`;
  });
  root.querySelector('.hm').addEventListener('click', async (e) => {
    const c = e.target.closest('rect.cell');
    if (!c) return;
    const s = await get('series', { ...query, label: data.labels[+c.dataset.row] });
    drawSeries(root.querySelector('.series-box'), s, stat, log2);
  });
}
