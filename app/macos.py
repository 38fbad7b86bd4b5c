"""macOS front end: an NSStatusItem rendering the controller's menu model (PyObjC).

Every AppKit call happens on the main thread: the controller's listeners fire on its
monitor and action threads, so `refresh` only schedules `_render` with callAfter.
Not run on Linux; see packaging/README.md for what was verified on a Mac.
"""

from __future__ import annotations

import logging

import objc
from AppKit import (
    NSApplication,
    NSApplicationActivationPolicyAccessory,
    NSControlStateValueOff,
    NSControlStateValueOn,
    NSImage,
    NSMenu,
    NSMenuItem,
    NSStatusBar,
    NSVariableStatusItemLength,
)
from Foundation import NSObject
from PyObjCTools import AppHelper

from app import paths
from app.controller import Controller
from app.menu import MenuEntry
from app.status import Status

log = logging.getLogger("omlx.app")


class _MenuTarget(NSObject):
    """Receives menu clicks (main thread) and hands them to the controller's action thread."""

    def initWithController_(self, controller: Controller) -> _MenuTarget | None:
        self = objc.super(_MenuTarget, self).init()
        if self is None:
            return None
        self.controller = controller
        return self

    def act_(self, sender: NSMenuItem) -> None:
        self.controller.dispatch(str(sender.representedObject()))


class MenuBar:
    def __init__(self, controller: Controller):
        self.controller = controller
        app = NSApplication.sharedApplication()
        # Menu-bar only, also when run unbundled (the bundle sets LSUIElement as well).
        app.setActivationPolicy_(NSApplicationActivationPolicyAccessory)
        self.item = NSStatusBar.systemStatusBar().statusItemWithLength_(NSVariableStatusItemLength)
        image = NSImage.alloc().initWithContentsOfFile_(str(paths.menubar_icon()))
        if image is not None:
            image.setTemplate_(True)  # follows light/dark menu bars
            image.setSize_((18, 18))
            self.item.button().setImage_(image)
        else:
            self.item.button().setTitle_("omlx")
        self.target = _MenuTarget.alloc().initWithController_(controller)
        controller.add_listener(self.refresh)
        controller.on_quit = lambda: AppHelper.callAfter(AppHelper.stopEventLoop)
        self._render(controller.menu(), controller.status)

    def refresh(self, status: Status, menu: tuple[MenuEntry, ...]) -> None:
        AppHelper.callAfter(self._render, menu, status)

    def _render(self, menu: tuple[MenuEntry, ...], status: Status) -> None:
        self.item.setMenu_(self._ns_menu(menu))
        self.item.button().setToolTip_(f"omlx: {status.headline()}")

    def _ns_menu(self, entries: tuple[MenuEntry, ...]) -> NSMenu:
        menu = NSMenu.alloc().init()
        menu.setAutoenablesItems_(False)  # the model decides what is enabled
        for entry in entries:
            if entry.separator:
                menu.addItem_(NSMenuItem.separatorItem())
                continue
            item = NSMenuItem.alloc().initWithTitle_action_keyEquivalent_(
                entry.title, "act:" if entry.action else None, ""
            )
            if entry.action:
                item.setTarget_(self.target)
                item.setRepresentedObject_(entry.action)
            item.setEnabled_(entry.enabled and (entry.action is not None or bool(entry.children)))
            if entry.checked is not None:
                item.setState_(NSControlStateValueOn if entry.checked else NSControlStateValueOff)
            if entry.children:
                item.setSubmenu_(self._ns_menu(entry.children))
            menu.addItem_(item)
        return menu


def run_menu_bar(controller: Controller, *, autostart: bool = True, welcome: bool = True) -> int:
    NSApplication.sharedApplication()
    MenuBar(controller)
    controller.start_monitor()
    if welcome:
        controller.first_run()
    if autostart:
        controller.dispatch("start")
    AppHelper.runEventLoop(installInterrupt=True)
    controller.shutdown()
    return 0
