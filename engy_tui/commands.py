"""What the node manager can be told to do: the command palette's entries and the keymap file.

Commands come from the node itself. Each role registers its actions with the control API
(`restart-model-server`, `pause-traffic`, `set-log-level`, …); `command_specs` turns the node's
action list and its hub states into palette entries — pure, so which commands a node offers is
tested without a terminal — and the app runs them through its `NodeBridge`, the same path
`POST /v1/actions/{id}` takes. Two commands are the TUI's own: copy a model server's launch
command (from its hub state) and export a diagnostics bundle (what `engy-node diagnose` writes).

Keys: every binding has an id (`app.quit`, `logs.follow`, …) and a user's `keymap.toml` in the
config dir rebinds them:

    [keys]
    "app.quit" = "ctrl+q"
    "logs.follow" = "F"
"""

from __future__ import annotations

import dataclasses
import tomllib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from textual.command import DiscoveryHit, Hit, Hits, Provider

from engy_node.snapshots import MINER, NodeStates

LOG_LEVELS = ("debug", "info", "warning", "error")

Kind = Literal["action", "copy", "diagnose"]


@dataclasses.dataclass(frozen=True, slots=True)
class CommandSpec:
    title: str
    help: str
    kind: Kind
    action_id: str | None = None
    params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    text: str | None = None
    """For `copy`: what goes to the clipboard."""


def command_specs(actions: Iterable[Mapping[str, Any]], states: NodeStates) -> list[CommandSpec]:
    """The palette's entries for a node offering `actions` (`[{id, description}]`) and
    reporting `states`."""
    specs: list[CommandSpec] = []
    for action in actions:
        action_id, description = str(action.get("id", "")), str(action.get("description", ""))
        if not action_id:
            continue
        if action_id == "set-log-level":
            specs += [
                CommandSpec(
                    f"Log level: {level}",
                    f"stderr and the log file get {level} and above",
                    "action",
                    action_id,
                    {"level": level},
                )
                for level in LOG_LEVELS
            ]
        elif action_id.startswith("restart-model-server"):
            which = action_id.removeprefix("restart-model-server").lstrip("-")
            specs.append(
                CommandSpec(f"Restart model server{f' ({which})' if which else ''}", description, "action", action_id)
            )
        elif action_id == "pause-traffic":
            specs.append(CommandSpec("Pause demo traffic", description, "action", action_id))
        elif action_id == "resume-traffic":
            specs.append(CommandSpec("Resume demo traffic", description, "action", action_id))
        else:
            specs.append(CommandSpec(action_id.replace("-", " ").capitalize(), description, "action", action_id))
    for miner, server in sorted(states.model_servers.items()):
        if server.command:
            which = "" if miner == MINER else f" ({miner})"
            specs.append(
                CommandSpec(
                    f"Copy model server launch command{which}",
                    "the exact command the miner runs, to the clipboard",
                    "copy",
                    text=server.command,
                )
            )
    specs.append(
        CommandSpec(
            "Export diagnostics bundle",
            "versions, masked config, GPUs, logs and this node's status "
            "as a .tar.gz in the current directory (as engy-node diagnose)",
            "diagnose",
        )
    )
    return specs


class NodeCommands(Provider):
    """The palette's node commands; the app (a `NodeManager`) supplies and runs them."""

    async def startup(self) -> None:
        self.specs: list[CommandSpec] = await self.app.palette_commands()  # type: ignore[attr-defined]

    async def discover(self) -> Hits:
        for spec in self.specs:
            yield DiscoveryHit(spec.title, self._runner(spec), help=spec.help)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        for spec in self.specs:
            score = matcher.match(spec.title)
            if score > 0:
                yield Hit(score, matcher.highlight(spec.title), self._runner(spec), help=spec.help)

    def _runner(self, spec: CommandSpec):
        async def run() -> None:
            await self.app.run_command(spec)  # type: ignore[attr-defined]

        return run


class KeymapError(ValueError):
    pass


def load_keymap(path: Path) -> dict[str, str]:
    """The `[keys]` table of `path` (binding id -> keys); {} when the file does not exist.
    Raises `KeymapError` naming the file and what is wrong."""
    if not path.is_file():
        return {}
    try:
        document = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, OSError) as err:
        raise KeymapError(f"{path}: not readable TOML ({err}); fix it or move it aside") from None
    keys = document.get("keys", {})
    if not isinstance(keys, dict) or not all(isinstance(k, str) and isinstance(v, str) and v for k, v in keys.items()):
        raise KeymapError(f'{path}: [keys] must map binding ids to keys, e.g. "app.quit" = "ctrl+q"')
    return dict(keys)
