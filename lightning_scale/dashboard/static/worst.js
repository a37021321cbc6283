// Worst nodes: ranked by the server (headroom to a format's edges, drift since the first
// tracked step, the FP8 what-if's SNR, or a logged statistic: a block what-if's SNR or
// flushed fraction, kurtosis, the channel outliers), filtered by a regex. One row per tensor (its
// aliases, views and module outputs of the same tensor, listed in it), with since when it
// has been out of the format's range. Columns and signs are the TEXT table `scale_worst`'s.
import { esc, fmt, sci } from './api.js';

const snr = (v) => (v === null || v === undefined ? '–' : Number(v).toFixed(1));
const NAMES = { underflow: 'underflow', below_normal: 'below normal', overflow: 'overflow' };

function since(r) {
  if (r.first_out === null || r.first_out === undefined) return '<td class="first">never</td>';
  return `<td class="first">step ${r.first_out}</td>`;
}

export function drawWorst(root, data) {
  // The FP8 columns appear when the run logged the what-if (E4M3 forward, E5M2 backward).
  const fp8 = data.rows.some((r) => r.fp8_snr_db !== null && r.fp8_snr_db !== undefined);
  const fractions = data.fractions || [];
  const stat = data.stat;  // the statistic ranked by, if any: its own column
  const head = ['#', 'node', 'dir', 'log2 std', 'log2 absmax', 'above min normal', 'below max', 'headroom', `first out of ${data.format} range`, 'out of range (steps)', 'drift',
    ...fractions.map((k) => `${NAMES[k]} ${data.format}`), ...(fp8 ? ['FP8', 'FP8 SNR dB', 'FP8 flushed'] : []), ...(stat ? [esc(stat)] : [])];
  const rows = data.rows.map((r, i) => `<tr class="worst-row${r.headroom !== null && r.headroom < 0 ? ' out' : ''}" data-label="${esc(r.label)}" data-dir="${r.dir}" data-headroom="${r.headroom ?? ''}" data-drift="${r.drift ?? ''}" data-snr="${r.fp8_snr_db ?? ''}" data-first="${r.first_out ?? ''}" data-value="${r.value ?? ''}" data-out-steps="${r.out_steps}" data-tracked="${r.tracked_steps}">
    <td>${i + 1}</td><td class="lbl">${r.param ? '◆ ' : ''}${esc(r.label)}${r.aliases.length ? `<div class="aliases">= ${r.aliases.map(esc).join(', ')}</div>` : ''}</td><td class="${r.dir}">${r.dir}</td><td>${fmt(r.log2_std)}</td><td>${fmt(r.log2_absmax)}</td>
    <td>${fmt(r.under)}</td><td>${fmt(r.over)}</td><td class="room">${fmt(r.headroom)}</td>${since(r)}<td class="count">${r.out_steps} of ${r.tracked_steps}</td><td>${fmt(r.drift)}</td>
    ${fractions.map((k) => `<td>${sci(r[k])}</td>`).join('')}${fp8 ? `<td>${esc(r.fp8_format)}</td><td class="snr">${snr(r.fp8_snr_db)}</td><td>${sci(r.fp8_flushed)}</td>` : ''}${stat ? `<td class="value">${sci(r.value)}</td>` : ''}</tr>`).join('');
  const what = {
    drift: 'largest |change of log2 std| since the first tracked step',
    fp8: 'lowest SNR of the FP8 what-if (E4M3 forward, E5M2 backward; – is +inf, exact)',
  }[data.by] ?? (stat ? `${stat.endsWith('_snr_db') ? 'lowest' : 'highest'} ${esc(stat)} (– is not finite or not logged)` : null) ?? `least headroom (octaves) to the ${data.format} range; positive = inside, negative = outside`;
  const hint = data.fraction_hint
    ? `<p class="note hint">The fractions of values that underflow, fall below the smallest normal or overflow in ${esc(data.format)} were not logged; to see them, log <code>${esc(data.fraction_hint)}</code>.</p>`
    : '';
  root.innerHTML = `<p class="note">step ${data.step}: ${data.rows.length} of ${data.total} tensor directions, ${what}. ${data.steps.length} tracked steps${data.rows.some((r) => r.log2_absmax === null) ? '; where absmax was not logged, the std stands in for it in <i>below max</i>' : ''}.</p>${hint}
    <table class="worst"><tr>${head.map((h) => `<th>${h}</th>`).join('')}</tr>${rows}</table>`;
}
