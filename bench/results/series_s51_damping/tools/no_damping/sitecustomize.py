"""The A/B's "off" arm: every PathController built without flap damping.

    PYTHONPATH=bench/results/series_s51_damping/tools/no_damping python bench/matrix.py ...

Python imports sitecustomize at start-up in every process that inherits the
PYTHONPATH (the ranks too); it turns PathController._flaps off after __init__.
"""
try:
    from mpccs.control import controller as _controller
except ImportError:  # a process without mpccs on its path
    _controller = None

if _controller is not None:
    _init = _controller.PathController.__init__

    def _init_without_damping(self, *args, **kwargs):
        _init(self, *args, **kwargs)
        self._flaps = None

    _controller.PathController.__init__ = _init_without_damping
