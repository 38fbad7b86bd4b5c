"""The ceiling under the GPU's own cap: Metal's recommended working set and the macOS
wired limit, read through stand-ins for MLX's device info and sysctl (no Metal here)."""

from __future__ import annotations

from omlx.memory.budget import DeviceCap, resolve_limits
from omlx.memory.footprint import wired_limit_bytes
from omlx.memory.mlx_stats import device_cap

GIB = 1024**3
# Seed 000: a 128 GB Mac whose Metal device recommends 107.5 GB.
M3_MAX = {"memory_size": 128 * GIB, "max_recommended_working_set_size": 107_520_000_000}


def test_auto_ceiling_is_never_above_metals_working_set() -> None:
    plain = resolve_limits("auto", total_ram_bytes=128 * GIB, transient_margin_bytes=None)
    assert plain.hard_bytes > 107_520_000_000  # RAM x 0.85: 116.8 GB, past the cap
    cap = DeviceCap(working_set_bytes=107_520_000_000)
    capped = resolve_limits(
        "auto", total_ram_bytes=128 * GIB, transient_margin_bytes=None, device_cap=cap
    )
    assert capped.hard_bytes == 107_520_000_000
    assert capped.soft_bytes == int(107_520_000_000 * 0.85)


def test_a_users_ceiling_and_the_wired_limit_count_too() -> None:
    cap = DeviceCap(working_set_bytes=107_520_000_000, wired_limit_bytes=96 * GIB)
    assert cap.cap_bytes == 96 * GIB
    mine = resolve_limits(
        "64GiB", total_ram_bytes=128 * GIB, transient_margin_bytes=0, device_cap=cap
    )
    assert mine.hard_bytes == 64 * GIB  # below every cap: the user's own
    over = resolve_limits(
        "120GiB", total_ram_bytes=128 * GIB, transient_margin_bytes=0, device_cap=cap
    )
    assert over.hard_bytes == 96 * GIB
    assert DeviceCap().cap_bytes is None


def test_device_cap_reads_mlx_device_info_and_the_wired_limit() -> None:
    cap = device_cap(device_info=lambda: M3_MAX, wired_limit=lambda: None)
    assert cap == DeviceCap(working_set_bytes=107_520_000_000, wired_limit_bytes=None)
    # A backend that reports no working set (CUDA, an older MLX): no cap from it.
    assert (
        device_cap(device_info=lambda: {"memory_size": 1}, wired_limit=lambda: None) == DeviceCap()
    )


def test_the_cpu_backend_has_no_cap() -> None:
    assert device_cap().cap_bytes is None  # MLX here runs on the CPU


def test_wired_limit_is_read_in_megabytes_and_zero_means_unset() -> None:
    assert wired_limit_bytes(lambda: b"98304\n") == 96 * GIB
    assert wired_limit_bytes(lambda: b"0\n") is None
    assert wired_limit_bytes(lambda: b"unknown oid") is None

    def broken() -> bytes:
        raise OSError("sysctl: unknown oid 'iogpu.wired_limit_mb'")

    assert wired_limit_bytes(broken) is None
    assert wired_limit_bytes() is None  # not a Mac


def test_the_pool_reads_the_cap_without_waiting_for_the_worker(tmp_path) -> None:
    """The server builds its pool before it starts the MLX worker: reading the cap must
    not wait on that worker (it waited 30 s for it, at every start)."""
    import threading

    from omlx.engine.pool import EnginePool
    from omlx.engine.worker import MLXWorker
    from omlx.settings import Settings

    (tmp_path / "models").mkdir()
    settings = Settings(
        base_path=tmp_path / "base",
        models={"model_dirs": [str(tmp_path / "models")]},
        cache={"enabled": False},
    )
    built: list[EnginePool] = []
    thread = threading.Thread(target=lambda: built.append(EnginePool(settings, MLXWorker())))
    thread.start()
    thread.join(10)  # a hang detector: building takes well under a second
    assert built and built[0].memory.device_cap.cap_bytes is None
