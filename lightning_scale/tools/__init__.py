"""Tools built on the package: one-off analysis of a module (``analyse``), the
coordinate check (``coord_check``), the demo model and run (``models``, ``demo``) and
synthetic dashboard logs (``synthetic``). They may import anything below them; nothing
in the package imports them.
"""
