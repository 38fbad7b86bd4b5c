"""The menu as data: both front ends render exactly this list."""

from __future__ import annotations

from dataclasses import dataclass

from app.stats import Stats
from app.status import ServerState, Status


@dataclass(frozen=True, slots=True)
class MenuEntry:
    title: str = ""
    action: str | None = None  # a Controller action name; None for a plain line
    enabled: bool = True
    checked: bool | None = None  # None: not a toggle
    children: tuple[MenuEntry, ...] = ()
    separator: bool = False


SEPARATOR = MenuEntry(separator=True)


def _line(text: str) -> MenuEntry:
    return MenuEntry(text, enabled=False)


def _server_items(status: Status) -> list[MenuEntry]:
    if status.offer is not None:
        return [
            MenuEntry(f"Use the omlx on :{status.offer.port}", "use_running"),
            MenuEntry("Start Another on a Free Port", "start_other_port"),
        ]
    state = status.state
    up = state in (ServerState.RUNNING, ServerState.STARTING, ServerState.NOT_RESPONDING)
    own = not status.adopted
    return [
        MenuEntry("Start Server", "start", enabled=not up),
        MenuEntry("Stop Server" if own else "Disconnect", "stop", enabled=up),
        MenuEntry("Restart Server", "restart", enabled=up and own),
    ]


def build_menu(status: Status, stats: Stats | None, login_enabled: bool) -> tuple[MenuEntry, ...]:
    running = status.state is ServerState.RUNNING
    head = [_line(status.headline())]
    if status.num_restarts:
        head.append(_line(f"Restarted {status.num_restarts}× after a crash"))
    if status.message:
        head.append(_line(status.message))
    stat_lines = stats.lines() if (running and stats is not None) else ["Server not running"]
    return (
        *head,
        SEPARATOR,
        *_server_items(status),
        SEPARATOR,
        MenuEntry("Open Admin", "open_admin", enabled=running),
        MenuEntry("Open Chat", "open_chat", enabled=running),
        MenuEntry("Open in Browser", "open_browser", enabled=running),
        MenuEntry("Stats", children=tuple(_line(t) for t in stat_lines)),
        SEPARATOR,
        MenuEntry("Open Logs Folder", "open_logs"),
        MenuEntry("Launch at Login", "toggle_login", checked=login_enabled),
        SEPARATOR,
        MenuEntry("Quit omlx", "quit"),
    )


def find(menu: tuple[MenuEntry, ...], title: str) -> MenuEntry:
    """The entry with this title (searching submenus); KeyError if absent."""
    for entry in menu:
        if entry.title == title:
            return entry
        if entry.children:
            try:
                return find(entry.children, title)
            except KeyError:
                pass
    raise KeyError(title)
