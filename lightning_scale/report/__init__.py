"""Report: records go out to the world.

In: a tracked step's records, one row per node and direction, on every rank, with its
value histograms, update statistics (``record.updates.UpdateStats``) and loss scale. Out:
pooled records (``pool``: exact across ranks, by named segment, ``Pooled``; the labels all
ranks share where their graphs differ, ``shared_labels``), written on a background thread
(``worker``) to TensorBoard as scalars, histograms, annotated code and the dashboard's data
(``tensorboard``, ``figure``, ``code``), and to other Lightning loggers; NaN/Inf warnings
per node (``anomalies``). ``reporting.Reporter`` ties these together for the callback.
Imports ``capture`` (labels, graphs), ``record`` and the dashboard's shared formats.
"""
