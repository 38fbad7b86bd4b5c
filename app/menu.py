"""The menu as data: both front ends render exactly this list.

The layout is fixed: every state yields the same entries (same keys, same order), and
what does not apply is hidden. So a front end makes its items once and, on each change,
updates the titles, enabled and checked states of the items that changed (`LiveMenu`):
an open menu follows the server instead of going stale, and nothing is rebuilt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

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
    key: str = ""  # stable identity across updates
    hidden: bool = False
    shortcut: str = ""  # key equivalent with the platform's command key, e.g. "q"


@dataclass(frozen=True, slots=True)
class AppItems:
    """The app's own state the menu shows: an update to install, an uninstall to confirm."""

    update_version: str | None = None  # a newer release the feed announced
    updating: bool = False  # a check or an install is running
    uninstall_total: str | None = None  # the data's size, while deleting it awaits a yes


# The Stats submenu has this many line slots (Stats.lines() gives at most five).
STATS_SLOTS = 5


def _line(key: str, text: str) -> MenuEntry:
    return MenuEntry(text, enabled=False, key=key, hidden=not text)


def _separator(key: str) -> MenuEntry:
    return MenuEntry(separator=True, key=key)


def _server_items(status: Status) -> list[MenuEntry]:
    offer = status.offer
    state = status.state
    up = state in (ServerState.RUNNING, ServerState.STARTING, ServerState.NOT_RESPONDING)
    own = not status.adopted
    use_title = f"Use the omlx on :{offer.port}" if offer else "Use the Running omlx"
    return [
        MenuEntry(use_title, "use_running", key="use_running", hidden=offer is None),
        MenuEntry(
            "Start Another on a Free Port",
            "start_other_port",
            key="start_other_port",
            hidden=offer is None,
        ),
        MenuEntry("Start Server", "start", enabled=not up, key="start", hidden=offer is not None),
        MenuEntry(
            "Stop Server" if own else "Disconnect",
            "stop",
            enabled=up,
            key="stop",
            hidden=offer is not None,
        ),
        MenuEntry(
            "Restart Server",
            "restart",
            enabled=up and own,
            key="restart",
            hidden=offer is not None,
        ),
    ]


def _stats_entry(status: Status, stats: Stats | None) -> MenuEntry:
    running = status.state is ServerState.RUNNING
    lines = stats.lines() if (running and stats is not None) else ["Server not running"]
    lines = (lines + [""] * STATS_SLOTS)[:STATS_SLOTS]
    slots = tuple(_line(f"stats.{i}", text) for i, text in enumerate(lines))
    return MenuEntry("Stats", children=slots, key="stats")


def _app_items(app: AppItems) -> list[MenuEntry]:
    version, confirm = app.update_version, app.uninstall_total
    return [
        MenuEntry("About omlx", "about", key="about"),
        MenuEntry("Check for Updates…", "check_updates", enabled=not app.updating, key="check"),
        MenuEntry(
            f"Install omlx {version} and Relaunch" if version else "Install Update",
            "install_update",
            enabled=not app.updating,
            key="install_update",
            hidden=version is None,
        ),
        MenuEntry("Uninstall omlx…", "uninstall", key="uninstall"),
        MenuEntry(
            f"Delete All omlx Data ({confirm})" if confirm else "Delete All omlx Data",
            "uninstall_confirm",
            key="uninstall_confirm",
            hidden=confirm is None,
        ),
        MenuEntry("Keep Data", "uninstall_cancel", key="uninstall_cancel", hidden=confirm is None),
    ]


def build_menu(
    status: Status, stats: Stats | None, login_enabled: bool, app: AppItems | None = None
) -> tuple[MenuEntry, ...]:
    running = status.state is ServerState.RUNNING
    restarts = f"Restarted {status.num_restarts}× after a crash" if status.num_restarts else ""
    return (
        _line("headline", status.headline()),
        _line("restarts", restarts),
        _line("message", status.message),
        _line("models", status.models_line()),
        _separator("sep.server"),
        *_server_items(status),
        _separator("sep.open"),
        MenuEntry("Open Admin", "open_admin", enabled=running, key="open_admin"),
        MenuEntry("Open Chat", "open_chat", enabled=running, key="open_chat"),
        MenuEntry("Open in Browser", "open_browser", enabled=running, key="open_browser"),
        _stats_entry(status, stats),
        _separator("sep.app"),
        MenuEntry("Open Logs Folder", "open_logs", key="open_logs"),
        MenuEntry("Reveal Data Folder", "reveal_data", key="reveal_data"),
        MenuEntry("Launch at Login", "toggle_login", checked=login_enabled, key="toggle_login"),
        _separator("sep.about"),
        *_app_items(app or AppItems()),
        _separator("sep.quit"),
        MenuEntry("Quit omlx", "quit", key="quit", shortcut="q"),
    )


def visible(menu: tuple[MenuEntry, ...]) -> list[MenuEntry]:
    return [entry for entry in menu if not entry.hidden]


def find(menu: tuple[MenuEntry, ...], title: str) -> MenuEntry:
    """The visible entry with this title (searching submenus); KeyError if absent."""
    for entry in visible(menu):
        if entry.title == title:
            return entry
        if entry.children:
            try:
                return find(entry.children, title)
            except KeyError:
                pass
    raise KeyError(title)


def walk(menu: tuple[MenuEntry, ...]) -> Iterator[MenuEntry]:
    """Every entry, submenu entries right after their parent."""
    for entry in menu:
        yield entry
        yield from walk(entry.children)


Item = TypeVar("Item")


class LiveMenu(Generic[Item]):
    """A front end's menu items, made once, then updated in place as the model changes.

    ``make(entry, child_items)`` creates an item (a native menu item, say) and
    ``update(item, entry)`` sets its title, enabled, checked and hidden state.
    """

    def __init__(
        self,
        menu: tuple[MenuEntry, ...],
        make: Callable[[MenuEntry, list[Item]], Item],
        update: Callable[[Item, MenuEntry], None],
    ):
        self._update = update
        self._layout = [entry.key for entry in walk(menu)]
        self.entries: dict[str, MenuEntry] = {}
        self.items: dict[str, Item] = {}
        self.top = [self._make(entry, make) for entry in menu]

    def _make(self, entry: MenuEntry, make: Callable[[MenuEntry, list[Item]], Item]) -> Item:
        children = [self._make(child, make) for child in entry.children]
        item = make(entry, children)
        self.entries[entry.key] = entry
        self.items[entry.key] = item
        return item

    def apply(self, menu: tuple[MenuEntry, ...]) -> list[str]:
        """Update the items whose entry changed; returns their keys."""
        new = {entry.key: entry for entry in walk(menu)}
        if list(new) != self._layout:
            raise ValueError(f"menu layout changed: {self._layout} -> {list(new)}")
        changed = [key for key, entry in new.items() if entry != self.entries[key]]
        for key in changed:
            self._update(self.items[key], new[key])
            self.entries[key] = new[key]
        return changed
