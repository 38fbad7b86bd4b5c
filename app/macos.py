"""macOS front end: an NSStatusItem rendering the controller's menu model (PyObjC).

Every AppKit call happens on the main thread: the controller's listeners fire on its
monitor and action threads, so `refresh` only schedules `_apply` with callAfter.
Every way of quitting (Quit / ⌘Q, Ctrl-C or SIGTERM in a terminal, logout, the Dock)
goes through NSApp.terminate_, so through `applicationShouldTerminate_`, which stops the
server before the app exits. If the app dies without that, the server sees its
--parent-fd pipe close and stops itself (omlx.parent_watch).
Not run on Linux; see packaging/README.md for what was verified on a Mac.
"""

from __future__ import annotations

import logging
import signal

import objc
from AppKit import (
    NSApp,
    NSApplication,
    NSApplicationActivationPolicyAccessory,
    NSApplicationActivationPolicyRegular,
    NSControlStateValueOff,
    NSControlStateValueOn,
    NSImage,
    NSMenu,
    NSMenuItem,
    NSStatusBar,
    NSTerminateCancel,
    NSTerminateLater,
    NSVariableStatusItemLength,
)
from Foundation import NSObject, NSProcessInfo
from PyObjCTools import AppHelper, MachSignals

from app import paths
from app.controller import Controller
from app.menu import LiveMenu, MenuEntry
from app.status import Status

log = logging.getLogger("omlx.app")


class _MenuHandler(NSObject):
    """The menu's target and delegate (main thread): clicks go to the action thread."""

    def initWithController_(self, controller: Controller) -> _MenuHandler | None:
        self = objc.super(_MenuHandler, self).init()
        if self is None:
            return None
        self.controller = controller
        self.live = None  # set by MenuBar once the items exist
        return self

    def act_(self, sender: NSMenuItem) -> None:
        self.controller.dispatch(str(sender.representedObject()))

    def menuNeedsUpdate_(self, _menu: NSMenu) -> None:
        # Just before the menu shows: also catches what changed outside the controller
        # (Launch at Login switched off in System Settings).
        if self.live is not None:
            self.live.apply(self.controller.menu())


class _AppDelegate(NSObject):
    def initWithController_(self, controller: Controller) -> _AppDelegate | None:
        self = objc.super(_AppDelegate, self).init()
        if self is None:
            return None
        self.controller = controller
        self.accessory_after_launch = False
        self.terminating = False
        return self

    def applicationDidFinishLaunching_(self, _note: object) -> None:
        if self.accessory_after_launch:
            NSApp().setActivationPolicy_(NSApplicationActivationPolicyAccessory)

    @objc.typedSelector(b"Q@:@")  # returns NSApplicationTerminateReply (NSUInteger)
    def applicationShouldTerminate_(self, app: NSApplication) -> int:
        if self.terminating:
            return NSTerminateCancel  # the first request's answer is on its way
        self.terminating = True
        log.info("quitting: stopping the server first")

        def reply() -> None:  # on the shutdown thread; AppKit wants the main thread
            AppHelper.callAfter(app.replyToApplicationShouldTerminate_, True)

        # Off the main thread, bounded: the menu bar stays responsive while it stops.
        self.controller.shutdown_then(reply)
        return NSTerminateLater


def _make_item(handler: _MenuHandler, entry: MenuEntry, children: list[NSMenuItem]) -> NSMenuItem:
    if entry.separator:
        return NSMenuItem.separatorItem()
    if entry.action == "quit":  # through applicationShouldTerminate_, like every quit
        item = NSMenuItem.alloc().initWithTitle_action_keyEquivalent_(
            entry.title, "terminate:", entry.shortcut
        )
        item.setTarget_(NSApp())
    else:
        item = NSMenuItem.alloc().initWithTitle_action_keyEquivalent_(
            entry.title, "act:" if entry.action else None, entry.shortcut
        )
        if entry.action:
            item.setTarget_(handler)
            item.setRepresentedObject_(entry.action)
    if children:
        submenu = NSMenu.alloc().initWithTitle_(entry.title)
        submenu.setAutoenablesItems_(False)  # the model decides what is enabled
        for child in children:
            submenu.addItem_(child)
        item.setSubmenu_(submenu)
    _update_item(item, entry)
    return item


def _update_item(item: NSMenuItem, entry: MenuEntry) -> None:
    if entry.separator:
        return
    item.setTitle_(entry.title)
    item.setEnabled_(entry.enabled and (entry.action is not None or bool(entry.children)))
    item.setHidden_(entry.hidden)
    if entry.checked is not None:
        item.setState_(NSControlStateValueOn if entry.checked else NSControlStateValueOff)


class MenuBar:
    """The status item and its menu, made once; later states update the same items."""

    def __init__(self, controller: Controller):
        self.controller = controller
        self.item = NSStatusBar.systemStatusBar().statusItemWithLength_(NSVariableStatusItemLength)
        image = NSImage.alloc().initWithContentsOfFile_(str(paths.menubar_icon()))
        if image is not None:
            image.setTemplate_(True)  # follows light/dark menu bars
            image.setSize_((18, 18))
            self.item.button().setImage_(image)
        else:
            self.item.button().setTitle_("omlx")
        self.handler = _MenuHandler.alloc().initWithController_(controller)
        self.live = LiveMenu(
            controller.menu(),
            lambda entry, children: _make_item(self.handler, entry, children),
            _update_item,
        )
        self.handler.live = self.live
        self.menu = NSMenu.alloc().init()
        self.menu.setAutoenablesItems_(False)
        for top in self.live.top:
            self.menu.addItem_(top)
        self.menu.setDelegate_(self.handler)
        self.item.setMenu_(self.menu)
        self.item.button().setToolTip_(f"omlx: {controller.status.headline()}")
        controller.add_listener(self.refresh)

    def refresh(self, status: Status, menu: tuple[MenuEntry, ...]) -> None:
        AppHelper.callAfter(self._apply, menu, status)

    def _apply(self, menu: tuple[MenuEntry, ...], status: Status) -> None:
        self.live.apply(menu)
        self.item.button().setToolTip_(f"omlx: {status.headline()}")


def _starts_regular() -> bool:
    """macOS 26 and later (16 is how macOS 26 shows itself to programs built on older SDKs)."""
    major = NSProcessInfo.processInfo().operatingSystemVersion().majorVersion
    return major >= 26 or major == 16


def _log_and_continue() -> bool:
    """runEventLoop's hook for an exception in a callback: log it, no modal alert."""
    log.exception("unexpected error in the menu bar app")
    return True


def run_menu_bar(controller: Controller, *, autostart: bool = True, welcome: bool = True) -> int:
    app = NSApplication.sharedApplication()
    delegate = _AppDelegate.alloc().initWithController_(controller)
    # On macOS 26 an accessory (menu-bar only) app that LaunchServices starts can stay
    # invisible, its status item never drawn: start regular, switch once launched.
    # Earlier systems: accessory from the start, also unbundled (the bundle's
    # LSUIElement says the same).
    delegate.accessory_after_launch = _starts_regular()
    regular = delegate.accessory_after_launch
    app.setActivationPolicy_(
        NSApplicationActivationPolicyRegular if regular else NSApplicationActivationPolicyAccessory
    )
    app.setDelegate_(delegate)  # NSApp holds its delegate weakly: `delegate` lives below
    menu_bar = MenuBar(controller)
    controller.on_quit = lambda: AppHelper.callAfter(NSApp().terminate_, None)
    # NSApp exists already, so runEventLoop would not install these itself: Ctrl-C and
    # `kill` quit through terminate_ too.
    AppHelper.installMachInterrupt()
    MachSignals.signal(signal.SIGTERM, AppHelper.machInterrupt)
    controller.start_monitor()
    if welcome:
        controller.first_run()
    if autostart:
        controller.dispatch("start")
    AppHelper.runEventLoop(unexpectedErrorAlert=_log_and_continue)
    # Reached only if the loop ends without terminate_ (which exits the process).
    controller.shutdown()
    del menu_bar, delegate
    return 0
