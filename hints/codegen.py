"""Regenerate, or check, the committed protobuf/gRPC stubs for ``hints/engine.proto``.

Usage, from anywhere (the repository root is found from this file's location)::

    python -m hints.codegen          # rewrite hints/engine_pb2.py, engine_pb2_grpc.py, engine_pb2.pyi
    python -m hints.codegen --check  # exit 1, naming the stale files, if the committed stubs differ

The stubs are committed so that an engine node or orchestrator runs without grpcio-tools installed;
``--check`` (run by the test suite) keeps them from drifting away from the ``.proto``.

Why it is deterministic: protoc runs from the repository root with ``-I .`` on the relative path
``hints/engine.proto``, so the descriptor and the import line in ``engine_pb2_grpc.py``
(``from hints import engine_pb2``) do not depend on where the checkout lives; output goes to a fresh temp
dir and is compared byte for byte. What is left depends only on the generator versions (grpcio-tools and
mypy-protobuf write theirs into the files); when only those lines differ, ``--check`` says so.

This module must not import the rest of ``hints`` at module level, and ``hints/__init__`` loads its
exports lazily, so that ``python -m hints.codegen`` still works when the stubs are missing or were made
by a protobuf newer than the installed runtime.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from pathlib import Path

PROTO = "hints/engine.proto"
"""The contract, relative to the repository root (the same string ends up inside the stubs)."""

GENERATED = ("hints/engine_pb2.py", "hints/engine_pb2_grpc.py", "hints/engine_pb2.pyi")
"""Every file protoc writes for :data:`PROTO`, relative to the repository root."""

_VERSION_MARKERS = ("# Protobuf Python Version:", "GRPC_GENERATED_VERSION =")
"""Lines in which a generator records its own version: a difference only there is a toolchain mismatch."""

_DIFF_LINES = 20


class CodegenError(RuntimeError):
    """The generator could not run (tool missing, protoc failed); distinct from 'stubs are stale'."""


def repo_root() -> Path:
    """The directory holding ``hints/``: resolved from this file, so cwd does not matter."""
    return Path(__file__).resolve().parent.parent


def _mypy_plugin() -> str:
    """Path of mypy-protobuf's ``protoc-gen-mypy``, preferring the one beside this interpreter.

    protoc finds plugins on PATH by default; naming the one that belongs to ``sys.executable`` keeps a
    stray install elsewhere on PATH from producing different ``.pyi`` output.
    """
    if importlib.util.find_spec("mypy_protobuf") is None:
        raise CodegenError(
            "mypy-protobuf is not installed (it is in the 'dev' extra: pip install -e '.[dev]')"
        )
    exe = "protoc-gen-mypy.exe" if os.name == "nt" else "protoc-gen-mypy"
    candidates = [Path(sysconfig.get_path("scripts")) / exe, Path(sys.executable).parent / exe]
    for candidate in candidates:
        if candidate.is_file():
            return str(candidate)
    found = shutil.which("protoc-gen-mypy")
    if found is None:
        raise CodegenError("mypy-protobuf is installed but its protoc-gen-mypy script is not on PATH")
    return found


def generate(root: Path, out_dir: Path) -> dict[str, bytes]:
    """Run protoc on ``root/hints/engine.proto`` into ``out_dir``; return {relative path: content}."""
    if importlib.util.find_spec("grpc_tools") is None:
        raise CodegenError(
            "grpcio-tools is not installed (it is in the 'dev' extra: pip install -e '.[dev]')"
        )
    if not (root / PROTO).is_file():
        raise CodegenError(f"{root / PROTO} not found")
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        "-I",
        ".",
        f"--plugin=protoc-gen-mypy={_mypy_plugin()}",
        f"--python_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        f"--mypy_out={out_dir}",
        PROTO,
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise CodegenError(f"protoc failed (exit {proc.returncode}):\n{proc.stderr.strip()}")
    result: dict[str, bytes] = {}
    for rel in GENERATED:
        path = out_dir / rel
        if not path.is_file():
            raise CodegenError(f"protoc did not produce {rel}")
        result[rel] = path.read_bytes()
    return result


def _explain(rel: str, old: bytes, new: bytes) -> str:
    """A short unified diff, or a note that only the generator versions differ."""
    old_lines = old.decode("utf-8", "replace").splitlines()
    new_lines = new.decode("utf-8", "replace").splitlines()
    diff = list(
        difflib.unified_diff(old_lines, new_lines, f"committed/{rel}", f"fresh/{rel}", lineterm="", n=1)
    )
    changed = [ln for ln in diff[2:] if ln[:1] in "+-"]
    if changed and all(any(m in ln for m in _VERSION_MARKERS) for ln in changed):
        versions = "; ".join(ln for ln in changed)
        return f"  {rel}: only the generator version differs ({versions}); regenerate or match grpcio-tools"
    shown = diff[:_DIFF_LINES] + (
        [f"  ... ({len(diff) - _DIFF_LINES} more diff lines)"] if len(diff) > _DIFF_LINES else []
    )
    return "\n".join(f"  {ln}" for ln in shown)


def check(root: Path) -> list[str]:
    """Regenerate into a temp dir; return the stale (differing or missing) files and print why."""
    with tempfile.TemporaryDirectory(prefix="hints-codegen-") as tmp:
        fresh = generate(root, Path(tmp))
    stale: list[str] = []
    details: list[str] = []
    for rel, content in fresh.items():
        path = root / rel
        if not path.is_file():
            stale.append(rel)
            details.append(f"  {rel}: missing")
            continue
        committed = path.read_bytes()
        if committed != content:
            stale.append(rel)
            details.append(_explain(rel, committed, content))
    if stale:
        print(
            f"hints.codegen: stale generated stubs: {', '.join(stale)}\n"
            f"  they differ from what {PROTO} generates; run `python -m hints.codegen` and commit the result.",
            file=sys.stderr,
        )
        print("\n".join(details), file=sys.stderr)
    return stale


def write(root: Path) -> list[str]:
    """Regenerate the stubs in place; touch only files whose content changed. Return those files."""
    with tempfile.TemporaryDirectory(prefix="hints-codegen-") as tmp:
        fresh = generate(root, Path(tmp))
    changed: list[str] = []
    for rel, content in fresh.items():
        path = root / rel
        if not path.is_file() or path.read_bytes() != content:
            path.write_bytes(content)
            changed.append(rel)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point: 0 = up to date / written, 1 = stale (``--check``), 2 = generator failure."""
    parser = argparse.ArgumentParser(
        prog="python -m hints.codegen", description="Regenerate or check the committed engine.proto stubs."
    )
    parser.add_argument(
        "--check", action="store_true", help="do not write; exit 1 if the committed stubs are stale"
    )
    args = parser.parse_args(argv)
    root = repo_root()
    try:
        if args.check:
            return 1 if check(root) else 0
        changed = write(root)
    except CodegenError as exc:
        print(f"hints.codegen: {exc}", file=sys.stderr)
        return 2
    print(
        f"hints.codegen: updated {', '.join(changed)}"
        if changed
        else "hints.codegen: stubs already up to date"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
