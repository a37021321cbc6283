// Worst nodes: ranked by the server (headroom to a format's edges, drift since the first
// tracked step, or the FP8 what-if's SNR), filtered by a regex.
import { esc, fmt, sci } from './api.js';

const snr = (v) => (v === null || v === undefined ? '–' : Number(v).toFixed(1));

export function drawWorst(root, data) {
  // The FP8 columns appear when the run logged the what-if (E4M3 forward, E5M2 backward).
  const fp8 = data.rows.some((r) => r.fp8_snr_db !== null && r.fp8_snr_db !== undefined);
  const head = ['#', 'node', 'dir', 'log2 std', 'log2 absmax', 'above min normal', 'below max', 'headroom', 'drift', `underflow ${data.format}`, `below normal ${data.format}`, `overflow ${data.format}`, ...(fp8 ? ['FP8', 'FP8 SNR dB', 'FP8 flushed'] : [])];
  const rows = data.rows.map((r, i) => `<tr class="worst-row${r.headroom !== null && r.headroom < 0 ? ' out' : ''}" data-label="${esc(r.label)}" data-dir="${r.dir}" data-headroom="${r.headroom ?? ''}" data-drift="${r.drift ?? ''}" data-snr="${r.fp8_snr_db ?? ''}">
    <td>${i + 1}</td><td class="lbl">${r.param ? '◆ ' : ''}${esc(r.label)}</td><td class="${r.dir}">${r.dir}</td><td>${fmt(r.log2_std)}</td><td>${fmt(r.log2_absmax)}</td>
    <td>${fmt(r.under)}</td><td>${fmt(r.over)}</td><td class="room">${fmt(r.headroom)}</td><td>${fmt(r.drift)}</td>
    <td>${sci(r.underflow)}</td><td>${sci(r.below_normal)}</td><td>${sci(r.overflow)}</td>${fp8 ? `<td>${esc(r.fp8_format)}</td><td class="snr">${snr(r.fp8_snr_db)}</td><td>${sci(r.fp8_flushed)}</td>` : ''}</tr>`).join('');
  const what = {
    drift: 'largest |change of log2 std| since the first tracked step',
    fp8: 'lowest SNR of the FP8 what-if (E4M3 forward, E5M2 backward; – is +inf, exact)',
  }[data.by] ?? `least headroom (octaves) to the ${data.format} range. Negative = outside the range`;
  root.innerHTML = `<p class="note">step ${data.step}: ${data.rows.length} of ${data.total} node directions, ${what}.</p>
    <table class="worst"><tr>${head.map((h) => `<th>${h}</th>`).join('')}</tr>${rows}</table>`;
}
