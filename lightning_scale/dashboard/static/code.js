// The annotated code logged at a step: scales in an aligned column, out-of-range lines flagged.
import { esc } from './api.js';

export function drawCode(root, data) {
  if (!data.lines.length) {
    root.innerHTML = '<p class="note">No annotated code was logged (ScaleMonitor(code=True) writes it).</p>';
    return;
  }
  const flagged = data.lines.filter((l) => l.flag).length;
  root.innerHTML = `<p class="note">step ${data.step}: ${flagged} lines flagged (!&lt; std below the FP16 smallest normal, !&gt; above its max)</p>
    <pre class="code">${data.lines.map((l) => `<span class="line${l.flag ? ' flag' : ''}">${esc(l.text) || ' '}</span>`).join('')}</pre>`;
}
