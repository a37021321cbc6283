"""``python -m lightning_scale.demo``: the demo (:mod:`lightning_scale.tools.demo`)."""

import sys

from lightning_scale.tools import demo as _demo

if __name__ == "__main__":
    _demo.main()
else:
    sys.modules[__name__] = _demo
