"""The shell's brain, with no GUI: server state, actions, the menu model, a monitor thread.

Front ends render `menu()` and call `dispatch(action)`; they are told of every change
through listeners, on the monitor or action thread (they marshal to their GUI thread).
"""

from __future__ import annotations

import json
import logging
import threading
import webbrowser
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import omlx
from app import paths
from app.login_item import LoginItem, LoginItemError, login_item
from app.menu import AppItems, MenuEntry, build_menu
from app.platform_calls import PlatformCallError, PlatformCalls, platform_calls
from app.ports import PortUse, free_port, probe_port
from app.stats import Stats, fetch_stats
from app.status import PortOffer, ServerState, Status
from app.supervisor import ServeConfig, Supervisor, SupervisorPolicy
from app.uninstall import DataSizes, UninstallError, measure, remove_data
from app.update_feed import Release
from app.updater import Outcome, UpdateError, Updater
from app.window import AdminWindow
from omlx.sizes import format_bytes

log = logging.getLogger("omlx.app")

ADMIN_PATH = "/admin/"
# The admin panel's chat page (web/ routes pages by fragment).
CHAT_PATH = "/admin/#/chat"
STATE_FILE = "app_state.json"

_UP = (ServerState.STARTING, ServerState.RUNNING, ServerState.NOT_RESPONDING)

Listener = Callable[[Status, tuple[MenuEntry, ...]], None]


@dataclass(frozen=True, slots=True)
class AppConfig:
    base_path: Path
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    extra_args: tuple[str, ...] = ()
    policy: SupervisorPolicy = field(default_factory=SupervisorPolicy)
    stats_interval_s: float = 2.0
    # The release feed (settings app.update_feed); empty: no update check, no network.
    update_feed: str = ""
    first_update_check_s: float = 60.0  # after start: the start itself is not slowed
    update_interval_s: float = 24 * 3600.0

    @classmethod
    def from_settings(cls, base_path: Path, **overrides: object) -> AppConfig:
        """Host, port and key as the server reads them (settings.json, environment)."""
        from omlx.settings import load_settings

        settings = load_settings({"base_path": str(base_path)})
        values: dict[str, object] = {
            "base_path": settings.base_path,
            "host": settings.server.host,
            "port": settings.server.port,
            "api_key": settings.server.api_key,
            "update_feed": _update_feed(settings.app.update_feed),
        }
        values.update(overrides)
        return cls(**values)  # type: ignore[arg-type]


def _update_feed(setting: str | None) -> str:
    """The setting, or (unset) the feed of the project's releases the app was built with."""
    return setting if setting is not None else paths.update_feed_of(paths.app_bundle())


class Controller:
    def __init__(
        self,
        config: AppConfig,
        *,
        window: AdminWindow | None = None,
        login: LoginItem | None = None,
        open_url: Callable[[str], object] = webbrowser.open,
        calls: PlatformCalls | None = None,
        updater: Updater | None = None,
    ):
        self.config = config
        self.supervisor = Supervisor(
            ServeConfig(config.base_path, config.host, config.extra_args), config.policy
        )
        self.window = window or AdminWindow(config.base_path, on_action=self.dispatch)
        self.login = login or login_item(paths.app_command(), frozen=paths.is_frozen())
        self._open_url = open_url
        self.calls = calls or platform_calls()
        self.updater = updater or Updater(
            config.update_feed, omlx.__version__, paths.app_bundle(), self.calls
        )
        self._update: Release | None = None  # newer release the feed announced
        self._updating = False
        self._uninstall: DataSizes | None = None  # awaiting the user's yes
        self._offer: PortOffer | None = None
        self._notice = ""  # from the last action (e.g. why Launch at Login was refused)
        self._stats: Stats | None = None
        self._listeners: list[Listener] = []
        self._published: tuple[Status, Stats | None, bool, AppItems] | None = None
        self._publish_lock = threading.Lock()
        self._actions = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omlx-action")
        self._stop_monitor = threading.Event()
        self._monitor: threading.Thread | None = None
        self.on_quit: Callable[[], None] = lambda: None
        # The window (its welcome page) hears where the server runs after every change.
        self.add_listener(lambda _status, _menu: self.window.show_server(self._admin_url()))

    # -- state --------------------------------------------------------------------------

    @property
    def status(self) -> Status:
        status = self.supervisor.status
        if self._notice:
            status = replace(status, message=self._notice)
        if self._offer is not None and status.state is ServerState.STOPPED:
            return replace(status, offer=self._offer)
        return status

    @property
    def base_url(self) -> str | None:
        return self.supervisor.base_url

    def menu(self) -> tuple[MenuEntry, ...]:
        return build_menu(self.status, self._stats, self.login.is_enabled(), self._app_items())

    def _app_items(self) -> AppItems:
        total = self._uninstall.total_bytes if self._uninstall else None
        return AppItems(
            update_version=self._update.version if self._update else None,
            updating=self._updating,
            uninstall_total=format_bytes(total) if total is not None else None,
        )

    def add_listener(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def _publish(self) -> None:
        with self._publish_lock:  # monitor and action threads: keep the order they saw
            current = (self.status, self._stats, self.login.is_enabled(), self._app_items())
            if current == self._published:
                return
            self._published = current
            self._notify(current[0], self.menu())

    def _notify(self, status: Status, menu: tuple[MenuEntry, ...]) -> None:
        for listener in list(self._listeners):
            try:
                listener(status, menu)
            except Exception:  # a broken front end must not stop supervision
                log.exception("menu listener failed")

    # -- monitor --------------------------------------------------------------------------

    def start_monitor(self) -> None:
        self._stop_monitor.clear()
        self._monitor = threading.Thread(
            target=self._monitor_loop, name="omlx-monitor", daemon=True
        )
        self._monitor.start()
        threading.Thread(target=self._update_loop, name="omlx-updates", daemon=True).start()

    def _monitor_loop(self) -> None:
        last_stats = 0.0
        clock = self.supervisor.clock
        while not self._stop_monitor.wait(self.config.policy.poll_interval_s):
            status = self.supervisor.poll()
            url = self.supervisor.base_url
            if status.state is not ServerState.RUNNING or url is None:
                self._stats = None
            elif clock() - last_stats >= self.config.stats_interval_s:
                last_stats = clock()
                self._stats = fetch_stats(url, self.config.api_key)
            self._publish()

    # -- actions --------------------------------------------------------------------------

    def dispatch(self, action: str) -> Future[None]:
        """Run a menu action on the action thread (they may block for seconds)."""
        handler = getattr(self, f"do_{action}", None)
        if handler is None:
            raise ValueError(f"unknown action {action!r}")

        def run() -> None:
            self._notice = ""
            try:
                handler()
            finally:
                self._publish()

        return self._actions.submit(run)

    def do_start(self) -> None:
        if self.supervisor.status.state in _UP:
            return
        host, port = self.config.host, self.config.port
        probe = probe_port(host, port)
        if probe.use is PortUse.FREE:
            self.supervisor.start(port)
        elif probe.use is PortUse.OMLX:
            # Offer, do not decide: it may be a server the user started on purpose.
            self._offer = PortOffer(port, probe.version)
            self.supervisor.stop()
        else:
            other = free_port(host)
            self.supervisor.start(other, f"Port {port} is used by another program; using {other}")
        log.info("start: %s", self.status.headline())

    def do_use_running(self) -> None:
        if self._offer is not None:
            port, self._offer = self._offer.port, None
            self.supervisor.adopt(port, f"Using the omlx already running on :{port}")

    def do_start_other_port(self) -> None:
        taken = self._offer.port if self._offer else self.config.port
        self._offer = None
        other = free_port(self.config.host)
        self.supervisor.start(other, f"Another omlx uses :{taken}; this one runs on :{other}")

    def do_stop(self) -> None:
        self._offer = None
        self.supervisor.stop()

    def do_restart(self) -> None:
        self.supervisor.stop()
        self.do_start()

    def do_open_admin(self) -> None:
        if self.base_url and self.status.state is ServerState.RUNNING:
            self.window.open(self.base_url + ADMIN_PATH)

    def do_open_chat(self) -> None:
        if self.base_url and self.status.state is ServerState.RUNNING:
            self.window.open(self.base_url + CHAT_PATH)

    def do_open_browser(self) -> None:
        if self.base_url:
            self._open_url(self.base_url + ADMIN_PATH)

    def do_open_logs(self) -> None:
        log_dir = paths.log_dir(self.config.base_path)
        log_dir.mkdir(parents=True, exist_ok=True)
        self._open_url(log_dir.as_uri())

    def do_toggle_login(self) -> None:
        try:
            self.login.set_enabled(not self.login.is_enabled())
        except LoginItemError as exc:
            self._notice = str(exc)
            log.warning("Launch at Login: %s", exc)

    def do_reveal_data(self) -> None:
        base = self.config.base_path
        base.mkdir(parents=True, exist_ok=True)
        try:
            self.calls.reveal(base)
        except PlatformCallError as exc:
            self._notice = f"Cannot show {base}: {exc}"

    def do_about(self) -> None:
        self._notice = (
            f"omlx {omlx.__version__} (build {paths.build_id()}), data in {self.config.base_path}"
        )

    # -- updates ------------------------------------------------------------------------

    def do_check_updates(self) -> None:
        self._set_updating(True)
        try:
            result = self.updater.check()
        finally:
            self._updating = False
        if result.outcome in (Outcome.AVAILABLE, Outcome.UP_TO_DATE):  # else: keep what we knew
            self._update = result.release if result.outcome is Outcome.AVAILABLE else None
        self._notice = result.message(omlx.__version__)

    def do_install_update(self) -> None:
        release = self._update
        if release is None:
            return
        self._set_updating(True, f"Downloading omlx {release.version}…")
        try:
            staged = self.updater.prepare(release)
        except (UpdateError, PlatformCallError, OSError) as exc:
            self._updating = False
            self._notice = f"Update not installed: {exc}"
            log.warning("update %s refused: %s", release.version, exc)
            return
        was_up = self.supervisor.status.state in _UP and not self.supervisor.status.adopted
        self._set_updating(True, f"Installing omlx {release.version}: stopping the server…")
        self.shutdown()  # the server stops before its app is replaced
        try:
            self.updater.swap(staged)
        except UpdateError as exc:
            self._updating = False
            self._notice = f"Update not installed: {exc}"
            self.start_monitor()
            if was_up:
                self.do_start()
            return
        log.info("updated to omlx %s; relaunching", release.version)
        self._relaunch_and_quit(release)

    def _relaunch_and_quit(self, release: Release) -> None:
        try:
            self.updater.relaunch()
        except (UpdateError, PlatformCallError) as exc:
            self._notice = f"omlx {release.version} is installed; open it again ({exc})"
            return
        self.on_quit()

    def _set_updating(self, updating: bool, notice: str = "") -> None:
        self._updating = updating
        self._notice = notice
        self._publish()

    def _update_loop(self) -> None:
        self.updater.remove_leftovers()  # the app an update replaced, once we run
        if not self.updater.feed_url:
            return
        wait_s = self.config.first_update_check_s
        while not self._stop_monitor.wait(wait_s):
            wait_s = self.config.update_interval_s
            if self._updating:
                continue
            try:
                result = self.updater.check()
            except Exception:  # a bug here must not end the daily checks
                log.exception("daily update check failed")
                continue
            log.info("daily update check: %s", result.message(omlx.__version__))
            if result.outcome is Outcome.AVAILABLE and result.release != self._update:
                self._update = result.release
                self._notice = result.message(omlx.__version__)
                self._publish()

    # -- uninstall ----------------------------------------------------------------------

    def do_uninstall(self) -> None:
        """Remove the login item now; ask before the data (the menu shows its sizes)."""
        try:
            self.login.set_enabled(False)
        except LoginItemError as exc:
            self._notice = str(exc)
            return
        base = self.config.base_path
        self._uninstall = measure(base) if base.is_dir() else None
        if self._uninstall is None:
            self._notice = "Launch at Login is off and there is no data; move omlx to the Trash"
            return
        self._notice = f"Launch at Login is off. Delete {base} too? {self._uninstall.summary()}"

    def do_uninstall_confirm(self) -> None:
        sizes, self._uninstall = self._uninstall, None
        if sizes is None:
            return
        self.window.close()  # the server and the window write into the data folder
        if not self.supervisor.status.adopted:
            self.supervisor.stop()
        try:
            remove_data(sizes.base_path)
        except UninstallError as exc:
            self._notice = str(exc)
            return
        total = format_bytes(sizes.total_bytes)
        self._notice = f"Deleted {sizes.base_path} ({total}); quit and move omlx to the Trash"

    def do_uninstall_cancel(self) -> None:
        self._uninstall = None

    def do_quit(self) -> None:
        self.shutdown()
        self.on_quit()

    def shutdown_then(self, done: Callable[[], None], timeout_s: float | None = None) -> None:
        """Shut down on a thread, then call ``done`` (also after timeout_s or an error).

        The macOS app delegate answers "may the app terminate?" from ``done``: the main
        thread keeps drawing while the server stops, and the answer always comes.
        """
        bound = timeout_s or self.config.policy.stop_timeout_s + 10
        worker = threading.Thread(target=self.shutdown, name="omlx-shutdown", daemon=True)

        def wait_then_done() -> None:
            worker.start()
            worker.join(bound)
            if worker.is_alive():
                log.error("shutdown took over %g s; quitting anyway", bound)
            done()

        threading.Thread(target=wait_then_done, name="omlx-quit", daemon=True).start()

    def shutdown(self) -> None:
        """Stop watching, close the window and stop our server (bounded by stop_timeout_s)."""
        self._stop_monitor.set()
        if self._monitor is not None and self._monitor is not threading.current_thread():
            self._monitor.join(self.config.policy.health_timeout_s + 1)
        self.window.close()
        if not self.supervisor.status.adopted:
            self.supervisor.stop()

    # -- first run ----------------------------------------------------------------------

    def _admin_url(self) -> str | None:
        return self.base_url + ADMIN_PATH if self.base_url else None

    def first_run(self) -> bool:
        """Show the welcome page once per data folder; True if it was shown now."""
        state_path = self.config.base_path / STATE_FILE
        try:
            state = json.loads(state_path.read_text())
        except (OSError, ValueError):
            state = {}
        if state.get("welcomed"):
            return False
        # The port the server really uses, not the configured one (another program may
        # hold that); none yet before a start, and the page waits until it hears of one.
        self.window.show_server(self._admin_url())
        self.window.open_welcome()
        state["welcomed"] = True
        state_path.parent.mkdir(parents=True, exist_ok=True)
        state_path.write_text(json.dumps(state))
        return True
