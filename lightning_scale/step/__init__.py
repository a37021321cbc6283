"""Step: when a training step is tracked and what a tracked step swaps in.

In: the trainer's step numbers, losses and the user's choices (``every_n_steps``,
``include``/``exclude``, anomaly triggers). Out: the decision to track a step
(``schedule``, ``anomaly``), the nodes to record (``selection``), the tracked forward
installed for the step and removed after it (``tracked_step``), and the capture check's
outcome (``verification.CaptureCheck``) that the callback acts on. Imports ``capture``,
``record`` and ``report``; only ``callback`` imports it.
"""
