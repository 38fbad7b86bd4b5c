"""Linux front end: a pystray tray icon rendering the controller's menu model.

pystray's gtk and appindicator backends need PyGObject (Debian: python3-gi); its
xorg backend shows the icon but no menu. PYSTRAY_BACKEND picks one explicitly.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Iterable

import pystray
from PIL import Image

from app import paths
from app.controller import Controller
from app.menu import MenuEntry
from app.status import Status

log = logging.getLogger("omlx.app")


def pystray_menu(entries: Iterable[MenuEntry], controller: Controller) -> pystray.Menu:
    """The pystray objects for the visible ``entries``; each item's callback dispatches."""
    return pystray.Menu(*(_item(entry, controller) for entry in entries if not entry.hidden))


def _item(entry: MenuEntry, controller: Controller) -> pystray.MenuItem:
    if entry.separator:
        return pystray.Menu.SEPARATOR
    if entry.children:
        return pystray.MenuItem(entry.title, pystray_menu(entry.children, controller))
    action = entry.action

    def on_click(_icon: pystray.Icon, _item: pystray.MenuItem) -> None:
        if action is not None:
            controller.dispatch(action)

    checked = None if entry.checked is None else (lambda _item, value=entry.checked: value)
    return pystray.MenuItem(entry.title, on_click, checked=checked, enabled=entry.enabled)


class Tray:
    def __init__(self, controller: Controller):
        self.controller = controller
        self.icon = pystray.Icon(
            "omlx",
            Image.open(paths.tray_icon()),
            "omlx",
            pystray_menu(controller.menu(), controller),
        )
        self._last_message = ""
        self._last_headline = ""
        controller.add_listener(self.refresh)
        controller.on_quit = self.icon.stop

    def refresh(self, status: Status, menu: tuple[MenuEntry, ...]) -> None:
        # pystray's gtk backend schedules these on the GTK main loop, so any thread may call.
        headline = status.headline()
        self.icon.title = f"omlx: {headline}"
        self.icon.menu = pystray_menu(menu, self.controller)
        if headline != self._last_headline:  # the log says when the menu changed
            self._last_headline = headline
            log.info("tray menu: %s", headline)
        if status.message and status.message != self._last_message:
            self._last_message = status.message
            try:
                self.icon.notify(status.message, "omlx")
            except Exception as exc:  # no notification service is not worth failing for
                log.info("notification not shown (%s): %s", exc, status.message)


def run_tray(controller: Controller, *, autostart: bool = True, welcome: bool = True) -> int:
    tray = Tray(controller)

    def setup(icon: pystray.Icon) -> None:
        icon.visible = True
        log.info("tray icon shown")
        controller.start_monitor()
        if welcome:
            controller.first_run()
        if autostart:
            controller.dispatch("start")

    # SIGTERM (logout, `kill`) quits like the menu does: the server is stopped in order.
    signal.signal(signal.SIGTERM, lambda *_: controller.dispatch("quit"))
    try:
        tray.icon.run(setup)
    except KeyboardInterrupt:
        pass
    except Exception as exc:  # GLib.Error from stop() without a notification service
        log.info("tray loop ended: %s", exc)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    controller.shutdown()
    return 0
