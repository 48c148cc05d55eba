"""On ``PYTHONPATH`` while ``SHARDGEN_TEST_SMALL_ROWS`` is on (tests/conftest.py): a process the
tests launch (``shardgen run``, torchrun's ranks, example scripts) gets the small-row kernels of
tests/helpers/rounding.py as soon as it has imported torch. A process that never imports torch pays
nothing."""

import importlib.abc
import importlib.machinery
import os
import sys

_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _AfterTorch(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the loader of ``torch`` so that its import ends with the patch."""

    def find_spec(self, name, path=None, target=None):
        if name != "torch":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            if _TESTS not in sys.path:
                sys.path.append(_TESTS)
            import rounding

            rounding.install()

        spec.loader.exec_module = exec_module
        return spec


if os.environ.get("SHARDGEN_TEST_SMALL_ROWS", "") not in ("", "0"):
    sys.meta_path.insert(0, _AfterTorch())
