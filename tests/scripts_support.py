"""Loading the command-line scripts in ``scripts/`` (not a package) for their tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str) -> ModuleType:
    """Execute ``scripts/<name>.py`` as the module ``name`` and return it.

    ``scripts/`` goes on ``sys.path`` because some scripts import a sibling (``vllm_predict`` imports
    ``mirror_turns``), and the module is registered in ``sys.modules`` before it runs because dataclasses
    look their module up while the class is built.
    """
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    if spec is None or spec.loader is None:
        raise ImportError(f"no script {name!r} in {SCRIPTS}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
