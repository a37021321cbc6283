"""Record: tensors become statistics records.

In: tensors (a node's output in the forward pass, its gradient in the backward pass, a
parameter's update). Out: one float64 record per tensor, ``[len(stats.FIELDS)]`` (count,
moments, range, zeros, non-finite values, format bounds, fp8 what-if sums), kept on the
tensor's device until the step's records are assembled; a tracked step reads them back
once.

``recorder`` decides which tensors of a step are recorded and batches the short ones
(``short_records``); ``stats`` computes the fields (host path, device path, formats, fp8)
and merges records exactly; ``native`` is the host kernel (one read per tensor),
``triton_stats`` the accelerator's (one fused read per tensor, in Triton; its device
functions for the block what-ifs in ``triton_blocks``, for a tile's moments in
``triton_moments``) and ``kernels``
the switch between it and torch's kernels (``LIGHTNING_SCALE_KERNEL``); ``updates`` the
update/weight ratio rows. Knows nothing of capture or reporting.
"""
