// The annotated code logged at a step: scales in an aligned column, out-of-range lines flagged.
import { esc } from './api.js';

export function drawCode(root, data) {
  if (!data.lines.length) {
    root.innerHTML = '<p class="note">No annotated code was logged (ScaleMonitor(code=True) writes it).</p>';
    return;
  }
  const flagged = data.lines.filter((l) => l.flag).length;
  // a long line wraps under its own code, not under the scales column: the hanging indent
  // is where the code starts (the column of `def forward`)
  const start = data.lines.map((l) => l.text.indexOf('def forward')).find((i) => i >= 0) ?? 4;
  const indent = Math.min(Math.max(start, 4), 100);
  root.innerHTML = `<p class="note">step ${data.step}: ${flagged} lines flagged (!&lt; std below the FP16 smallest normal, !&gt; above its max)</p>
    <pre class="code" style="--indent:${indent}ch">${data.lines.map((l) => `<span class="line${l.flag ? ' flag' : ''}">${esc(l.text) || ' '}</span>`).join('')}</pre>`;
}
