// Worst nodes: ranked by the server (headroom to a format's edges, or drift since the
// first tracked step), filtered by a regex.
import { esc, fmt, sci } from './api.js';

export function drawWorst(root, data) {
  const head = ['#', 'node', 'dir', 'log2 std', 'log2 absmax', 'above min normal', 'below max', 'headroom', 'drift', `underflow ${data.format}`, `below normal ${data.format}`, `overflow ${data.format}`];
  const rows = data.rows.map((r, i) => `<tr class="worst-row${r.headroom !== null && r.headroom < 0 ? ' out' : ''}" data-label="${esc(r.label)}" data-dir="${r.dir}" data-headroom="${r.headroom ?? ''}" data-drift="${r.drift ?? ''}">
    <td>${i + 1}</td><td class="lbl">${r.param ? '◆ ' : ''}${esc(r.label)}</td><td class="${r.dir}">${r.dir}</td><td>${fmt(r.log2_std)}</td><td>${fmt(r.log2_absmax)}</td>
    <td>${fmt(r.under)}</td><td>${fmt(r.over)}</td><td class="room">${fmt(r.headroom)}</td><td>${fmt(r.drift)}</td>
    <td>${sci(r.underflow)}</td><td>${sci(r.below_normal)}</td><td>${sci(r.overflow)}</td></tr>`).join('');
  const what = data.by === 'drift' ? 'largest |change of log2 std| since the first tracked step' : `least headroom (octaves) to the ${data.format} range`;
  root.innerHTML = `<p class="note">step ${data.step}: ${data.rows.length} of ${data.total} node directions, ${what}. Negative = outside the range.</p>
    <table class="worst"><tr>${head.map((h) => `<th>${h}</th>`).join('')}</tr>${rows}</table>`;
}
