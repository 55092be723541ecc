"""The GPU machine's Python packages, seen from this machine: for ``bench/gpu_check.sh --cpu``.

The GPU machine has Python, torch with its own dependencies (Triton, the CUDA libraries, sympy, ...) and
nothing else but the wheels gpu_check.sh carries to it (``WHEEL_PINS``, installed there with ``--no-deps``).
A step that imports anything more (matplotlib, say) runs here and fails there, in a GPU window of a few
minutes. So ``--cpu`` runs its steps in a view of this machine's environment that holds only those packages:

    python bench/gpu_machine_env.py DEST megatron-core==0.19.2 numpy==2.5.5 ...

writes ``DEST/site`` (a symbolic link per top-level module and ``.dist-info`` folder of torch, of its
requirements taken recursively with their markers and extras, and of the pinned distributions themselves,
not of their requirements) and ``DEST/python``, which starts this Python without its site-packages (``-S``)
and with ``DEST/site`` (and whatever ``PYTHONPATH`` says, e.g. the repository) on the path. A folder that
several distributions share (a namespace package: ``nvidia/``, ``cuda/``) is made a real folder holding
links to the parts of the chosen ones. Prints the wrapper's path, and on stderr each pin that is not
installed here or at another version (the view then lacks it or differs from the GPU machine there).
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import stat
import sys
from importlib import metadata

from packaging.markers import default_environment
from packaging.requirements import Requirement


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions ``roots`` name, with their requirements (markers evaluated for this
    interpreter, extras followed), recursively: {normalised name: distribution}. What is not installed
    here is left out: the view can then only lack more than the GPU machine does, never hide a package
    it lacks."""
    found: dict[str, metadata.Distribution] = {}
    extras_seen: dict[str, set] = {}
    todo = [Requirement(spec) for spec in roots]
    environment = default_environment()
    while todo:
        requirement = todo.pop()
        key, extras = _key(requirement.name), set(requirement.extras)
        if key in found and extras <= extras_seen[key]:
            continue
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            continue
        found[key], extras_seen[key] = dist, extras_seen.get(key, set()) | extras
        for child in map(Requirement, dist.requires or []):
            if child.marker is None or any(child.marker.evaluate(dict(environment, extra=extra))
                                           for extra in extras | {""}):
                todo.append(child)
    return found


def pinned(pins: list[str]) -> tuple[dict[str, metadata.Distribution], list[str]]:
    """({name: distribution} of the pins installed here, [a line for each pin missing or at another version])."""
    found, notes = {}, []
    for pin in pins:
        requirement = Requirement(pin)
        try:
            dist = metadata.distribution(requirement.name)
        except metadata.PackageNotFoundError:
            notes.append(f"{pin}: not installed here; the view lacks it")
            continue
        if requirement.specifier and dist.version not in requirement.specifier:
            notes.append(f"{pin}: {dist.version} installed here; the view has that version")
        found[_key(requirement.name)] = dist
    return found, notes


def _files(dist: metadata.Distribution) -> list:
    if dist.files is None:
        raise SystemExit(f"gpu_machine_env: {dist.metadata['Name']} lists no files (no RECORD): its modules cannot "
                         "be told apart from others'; reinstall it with pip")
    return [path for path in dist.files if path.parts[0] not in ("..", "__pycache__")
            and not path.parts[0].endswith(".pth")]


def build(dest: str, pins: list[str]) -> tuple[str, list[str]]:
    """Write the view into ``dest`` (replacing an earlier one); (the wrapper's path, notes on the pins)."""
    site = os.path.join(dest, "site")
    shutil.rmtree(site, ignore_errors=True)
    os.makedirs(site)
    extra, notes = pinned(pins)
    chosen = {**closure(["torch"]), **extra}
    files = {key: _files(dist) for key, dist in chosen.items()}
    owners: dict[str, set] = {}  # top-level entry -> distributions that have files under it
    for key, paths in files.items():
        for path in paths:
            owners.setdefault(path.parts[0], set()).add(key)
    shared = {entry for entry, keys in owners.items() if len(keys) > 1}
    for key, dist in chosen.items():
        base = str(dist.locate_file(""))
        for path in files[key]:
            # a shared folder is entered one level: only the chosen distributions' parts of it appear
            parts = path.parts[:2] if path.parts[0] in shared and len(path.parts) > 1 else path.parts[:1]
            source, link = os.path.join(base, *parts), os.path.join(site, *parts)
            if os.path.lexists(link) or not os.path.exists(source):
                continue
            os.makedirs(os.path.dirname(link), exist_ok=True)
            os.symlink(source, link)
    wrapper = os.path.join(dest, "python")
    with open(wrapper, "w") as f:
        f.write("#!/bin/sh\n# this machine's Python with the GPU machine's packages only (bench/gpu_machine_env.py)\n"
                f'PYTHONPATH={shlex.quote(site)}"${{PYTHONPATH:+:$PYTHONPATH}}" exec {shlex.quote(sys.executable)} -S "$@"\n')
    os.chmod(wrapper, os.stat(wrapper).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return wrapper, notes


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit("usage: gpu_machine_env.py DEST [DISTRIBUTION==VERSION ...]")
    wrapper, notes = build(sys.argv[1], sys.argv[2:])
    for note in notes:
        print(f"gpu_machine_env: {note}", file=sys.stderr)
    print(wrapper)
