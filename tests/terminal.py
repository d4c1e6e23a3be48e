"""A command run in a real terminal (tmux, a private server), its screen captured as a person would see it while it
runs: what `raybench run`'s live view looks like is checked on the screen tmux draws from its output, not on the
bytes it writes."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

CAPTURE_EVERY_S = 0.25


@dataclass(frozen=True)
class Screens:
    exit_code: int
    screens: list[str]  # each distinct screen seen while the command ran, in order
    final: str  # the screen once it exited


def have_tmux() -> bool:
    return shutil.which("tmux") is not None


def run_in_tmux(argv: list[str], workdir: Path, env: dict[str, str] | None = None, width: int = 110,
                height: int = 32, timeout_s: float = 600) -> Screens:
    """Run argv in a width x height tmux window, capturing the screen every CAPTURE_EVERY_S until it exits."""
    server = f"raybench-test-{uuid.uuid4().hex[:8]}"  # a private server: no user's session is touched
    done = workdir / f"{server}.exit"
    script = f"{shlex.join(argv)}; echo $? > {shlex.quote(str(done))}; sleep 600"  # the pane stays for the last look
    tmux = ["tmux", "-L", server, "-f", "/dev/null"]
    environment = {**os.environ, **(env or {}), "TERM": "xterm-256color"}
    environment.pop("TMUX", None)
    subprocess.run([*tmux, "new-session", "-d", "-x", str(width), "-y", str(height), "-c", str(workdir),
                    "bash", "-c", script], env=environment, check=True)
    screens: list[str] = []
    try:
        deadline = time.monotonic() + timeout_s
        while not done.exists():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{shlex.join(argv)} still ran after {timeout_s:g} s; its screen:\n{screens[-1:]}")
            screen = _capture(tmux)
            if not screens or screen != screens[-1]:
                screens.append(screen)
            time.sleep(CAPTURE_EVERY_S)
        final = _capture(tmux)
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)
    return Screens(int(done.read_text()), screens, final)


def _capture(tmux: list[str]) -> str:
    return subprocess.run([*tmux, "capture-pane", "-p", "-J"], capture_output=True, text=True, check=True).stdout
