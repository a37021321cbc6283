"""The ``scales`` TensorBoard dashboard: the plugin, what the writer stores for it, and the
headroom maths both share. ``plugin.py`` imports TensorBoard's server code; the rest is plain."""
