"""The agent CLIs as users install them: pinned npm packages, fetched once with npm into a cache
(~/.cache/roseinfer-agent-clis, or $ROSEINFER_AGENT_CLIS_CACHE) keyed by package and version.

Claude Code, Codex and opencode ship a native executable per platform in a package of its own (the
package users install only picks it); that package is fetched directly. Qwen Code is one bundled
JavaScript file run with node."""

from __future__ import annotations

import fcntl
import os
import platform
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(os.environ.get("ROSEINFER_AGENT_CLIS_CACHE", Path.home() / ".cache" / "roseinfer-agent-clis"))


@dataclass(frozen=True)
class AgentCli:
    name: str
    package: str  # the npm package holding the executable (linux-x64)
    version: str
    executable: str  # its path inside the package
    node: bool = False  # a JavaScript file run with node
    min_node: int = 0

    @property
    def spec(self) -> str:
        return f"{self.package}@{self.version}"


CLAUDE = AgentCli("claude", "@anthropic-ai/claude-code-linux-x64", "2.1.332", "claude")
# @openai/codex publishes its platform builds as versions of itself (0.171.0-linux-x64).
CODEX = AgentCli("codex", "@openai/codex", "0.171.0-linux-x64", "vendor/x86_64-unknown-linux-musl/bin/codex")
OPENCODE = AgentCli("opencode", "opencode-linux-x64", "1.18.33", "bin/opencode")
QWEN = AgentCli("qwen", "@qwen-code/qwen-code", "0.24.4", "cli.js", node=True, min_node=20)


def unsupported() -> str | None:
    """Why the pinned executables cannot run here, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"the pinned agent CLIs are the linux-x64 builds, not {platform.system()}-{platform.machine()}"
    return None


def node_major() -> int | None:
    node = shutil.which("node")
    if node is None:
        return None
    out = subprocess.run([node, "--version"], capture_output=True, text=True, check=True).stdout
    return int(out.strip().lstrip("v").split(".")[0])


def install(cli: AgentCli) -> list[str]:
    """The command line that runs `cli` (fetched with `npm pack` on first use; ~60-190 MB each)."""
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm is missing: `apt-get install -y nodejs npm` (make test does it)")
    home = CACHE / f"{cli.package.replace('/', '+')}-{cli.version}"
    ready = home / "ready"
    if not ready.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        with open(CACHE / "lock", "w") as lock:  # two sessions at once: one download
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not ready.exists():
                _fetch(npm, cli, home)
                ready.touch()
    executable = home / "package" / cli.executable
    if cli.node:
        return [shutil.which("node") or "node", str(executable)]
    return [str(executable)]


def _fetch(npm: str, cli: AgentCli, home: Path) -> None:
    shutil.rmtree(home, ignore_errors=True)
    with tempfile.TemporaryDirectory(dir=CACHE) as scratch:
        packed = subprocess.run([npm, "pack", "--silent", "--pack-destination", scratch, cli.spec],
                                capture_output=True, text=True, timeout=600)
        if packed.returncode != 0:
            raise RuntimeError(f"npm pack {cli.spec} failed: {packed.stderr[-2000:]}")
        (archive,) = Path(scratch).glob("*.tgz")
        unpacked = Path(scratch) / "unpacked"
        with tarfile.open(archive) as tar:
            tar.extractall(unpacked, filter="data")
        executable = unpacked / "package" / cli.executable
        if not executable.is_file():
            raise RuntimeError(f"{cli.spec} has no {cli.executable}")
        executable.chmod(0o755)
        unpacked.rename(home)
